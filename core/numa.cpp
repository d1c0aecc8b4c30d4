// Page placement over NUMA nodes: see hytrain/numa.h.
#include "hytrain/numa.h"

#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <system_error>
#include <thread>

#include "hytrain/error.h"

namespace hytrain {

std::vector<int> parse_cpu_list(const std::string& text) {
  std::vector<int> cpus;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, ',')) {
    part.erase(std::remove_if(part.begin(), part.end(), [](char c) { return c == ' ' || c == '\n'; }),
               part.end());
    if (part.empty()) continue;
    const auto dash = part.find('-');
    char* end = nullptr;
    const long lo = std::strtol(part.c_str(), &end, 10);
    long hi = lo;
    if (dash == std::string::npos) {
      HYTRAIN_CHECK(end && *end == '\0', "malformed CPU list '" + text + "'");
    } else {
      HYTRAIN_CHECK(end == part.c_str() + dash, "malformed CPU list '" + text + "'");
      hi = std::strtol(part.c_str() + dash + 1, &end, 10);
      HYTRAIN_CHECK(end && *end == '\0' && dash + 1 < part.size(), "malformed CPU list '" + text + "'");
    }
    HYTRAIN_CHECK(lo >= 0 && hi >= lo && hi < (1 << 20), "malformed CPU list '" + text + "'");
    for (long c = lo; c <= hi; ++c) cpus.push_back(static_cast<int>(c));
  }
  return cpus;
}

namespace {

// The process's CPUs: its main thread's affinity (the thread whose id is the process's).
bool process_cpus(cpu_set_t* mask) {
  CPU_ZERO(mask);
  return sched_getaffinity(getpid(), sizeof *mask, mask) == 0;
}

}  // namespace

void use_process_cpus() {
  cpu_set_t mask;
  if (process_cpus(&mask)) (void)pthread_setaffinity_np(pthread_self(), sizeof mask, &mask);
}

std::vector<NumaNode> numa_nodes_of_affinity(const std::string& root) {
  cpu_set_t mask;
  const bool have_mask = process_cpus(&mask);
  std::vector<NumaNode> nodes;
  DIR* dir = opendir(root.c_str());
  if (!dir) return nodes;
  while (dirent* e = readdir(dir)) {
    const std::string name = e->d_name;
    if (name.rfind("node", 0) != 0 || name.size() == 4 ||
        name.find_first_not_of("0123456789", 4) != std::string::npos) {
      continue;
    }
    std::ifstream f(root + "/" + name + "/cpulist");
    std::string text;
    if (!f || !std::getline(f, text)) continue;
    NumaNode node;
    node.id = std::atoi(name.c_str() + 4);
    try {
      for (int c : parse_cpu_list(text)) {
        if (!have_mask || (c < CPU_SETSIZE && CPU_ISSET(c, &mask))) node.cpus.push_back(c);
      }
    } catch (const Error&) {
      continue;  // an unreadable node is left out, as one without CPUs is
    }
    if (!node.cpus.empty()) nodes.push_back(std::move(node));
  }
  closedir(dir);
  std::sort(nodes.begin(), nodes.end(), [](const NumaNode& a, const NumaNode& b) { return a.id < b.id; });
  return nodes;
}

const char* page_placement_name(PagePlacement p) { return p == PagePlacement::spread ? "spread" : "local"; }

PagePlacement page_placement() {
  const char* v = std::getenv("HYTRAIN_PAGE_PLACEMENT");
  if (!v || !*v || std::string(v) == "spread") return PagePlacement::spread;
  if (std::string(v) == "local") return PagePlacement::local;
  HYTRAIN_THROW(std::string("HYTRAIN_PAGE_PLACEMENT must be 'spread' or 'local', got '") + v + "'");
}

namespace {

void touch_range(char* p, std::size_t bytes, std::size_t page) {
  for (std::size_t off = 0; off < bytes; off += page) static_cast<volatile char*>(p)[off] = 0;
}

}  // namespace

int place_pages(void* p, std::size_t bytes, PagePlacement placement, const std::vector<NumaNode>& nodes) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  char* base = static_cast<char*>(p);
  if (placement == PagePlacement::local || nodes.size() < 2 || bytes < 2 * kPlacementChunk) {
    touch_range(base, bytes, page);
    return 1;
  }
  // Chunk c spans [start + c * chunk, ...) clipped to the range, start aligned down to the chunk.
  const auto addr = reinterpret_cast<std::uintptr_t>(base);
  const std::uintptr_t start = addr / kPlacementChunk * kPlacementChunk;
  const std::size_t chunks = (addr + bytes - start + kPlacementChunk - 1) / kPlacementChunk;
  const std::size_t n = nodes.size();
  auto touch_node = [&](std::size_t node, std::size_t lane, std::size_t lanes) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c : nodes[node].cpus) {
      if (c < CPU_SETSIZE) CPU_SET(c, &set);
    }
    // Advisory: a thread that cannot be pinned still touches, and the pages land where it runs.
    (void)pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    for (std::size_t c = node + lane * n; c < chunks; c += lanes * n) {
      const std::uintptr_t lo = std::max<std::uintptr_t>(start + c * kPlacementChunk, addr);
      const std::uintptr_t hi = std::min<std::uintptr_t>(start + (c + 1) * kPlacementChunk, addr + bytes);
      touch_range(reinterpret_cast<char*>(lo), hi - lo, page);
    }
  };
  std::vector<std::thread> threads;
  try {
    for (std::size_t node = 0; node < n; ++node) {
      // Two touching threads per node where it has the CPUs: faulting pages in is where the time goes.
      const std::size_t lanes = std::min<std::size_t>(2, nodes[node].cpus.size());
      for (std::size_t lane = 0; lane < lanes; ++lane) threads.emplace_back(touch_node, node, lane, lanes);
    }
  } catch (const std::system_error&) {  // no thread to be had: the pages still get touched, here
    for (auto& t : threads) t.join();
    touch_range(base, bytes, page);
    return 1;
  }
  for (auto& t : threads) t.join();
  return static_cast<int>(n);
}

int place_pages(void* p, std::size_t bytes) {
  const PagePlacement placement = page_placement();
  if (placement == PagePlacement::local) return place_pages(p, bytes, placement, {});
  return place_pages(p, bytes, placement, numa_nodes_of_affinity());
}

}  // namespace hytrain
