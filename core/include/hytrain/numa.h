// Where host memory's pages live on machines with several NUMA nodes.
//
// A pool slab is first touched (and so placed) when it is made. Touched by one thread, every page lands
// on that thread's node, and a process whose update threads span all nodes then reads and writes
// through one node's memory channels and the socket link: one process reached a third of the update
// rate that one process per node reaches on a 2-socket host. Spread placement deals the slab's 2 MiB
// chunks (the transparent huge page) round-robin over the nodes this process may run on, each touched
// by a thread pinned to its node, so every slice the update workers take is as likely on one node as on
// another and all channels work at once. A process already confined to one node (a rank bound to its
// GPU's node) keeps local placement: there is nothing to spread over.
//
// HYTRAIN_PAGE_PLACEMENT=local keeps the old single-thread first touch (for measurement); the default
// is spread.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace hytrain {

struct NumaNode {
  int id = 0;
  std::vector<int> cpus;  // the node's CPUs this process may run on
};

// Nodes with at least one CPU in this process's affinity, from sysfs (`root`: overridable for tests).
// The process's affinity is its main thread's: a thread confined to fewer CPUs (a library's worker,
// the autograd engine's thread a first step runs in) does not confine the placement it asks for.
// Empty where the kernel does not say (no sysfs): callers then treat the machine as one node.
std::vector<NumaNode> numa_nodes_of_affinity(const std::string& root = "/sys/devices/system/node");

// Lets the calling thread run on every CPU of the process's affinity (its main thread's), where it
// may; advisory. Threads that make memory for the process call it first (PinnedPool::reserve).
void use_process_cpus();

// Parses a sysfs CPU list ("0-3,8,10-11"); throws on a malformed one.
std::vector<int> parse_cpu_list(const std::string& text);

enum class PagePlacement : int { local = 0, spread = 1 };

const char* page_placement_name(PagePlacement p);
// The placement new slabs get: HYTRAIN_PAGE_PLACEMENT ("spread" or "local"; unset: spread). Throws on
// another value, naming the variable.
PagePlacement page_placement();

// The chunk spread placement deals out: one transparent huge page.
constexpr std::size_t kPlacementChunk = std::size_t(2) << 20;

// Touches every page of [p, p + bytes) so that it is placed: with spread placement over more than one
// node, chunk c (counted from a kPlacementChunk-aligned address) goes to nodes[c % nodes.size()],
// touched by a thread pinned to that node; otherwise the calling thread touches them all. Returns the
// number of nodes the memory was spread over (1 for local placement).
int place_pages(void* p, std::size_t bytes, PagePlacement placement, const std::vector<NumaNode>& nodes);
// The same with page_placement() and numa_nodes_of_affinity().
int place_pages(void* p, std::size_t bytes);

}  // namespace hytrain
