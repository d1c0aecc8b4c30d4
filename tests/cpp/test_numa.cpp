// NUMA page placement: the CPU-list parser, the nodes read from a sysfs tree (a fake one here, so the
// test means the same on any machine), and place_pages leaving every page of a range present under both
// placements, from an unaligned start. Where the pages land on a real multi-node host is checked by
// tests/python/test_pool.py (from /proc/self/numa_maps), which runs wherever there are several nodes.
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "check.h"
#include "hytrain/error.h"
#include "hytrain/numa.h"

using namespace hytrain;

namespace {

bool throws(const std::string& text) {
  try {
    parse_cpu_list(text);
  } catch (const Error&) {
    return true;
  }
  return false;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
}

std::size_t resident_pages(void* p, std::size_t bytes) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((bytes + page - 1) / page);
  if (mincore(p, bytes, vec.data()) != 0) return 0;
  std::size_t n = 0;
  for (unsigned char v : vec) n += v & 1;
  return n;
}

}  // namespace

TEST(cpu_lists) {
  CHECK((parse_cpu_list("0-3,8,10-11\n") == std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  CHECK((parse_cpu_list("5") == std::vector<int>{5}));
  CHECK(parse_cpu_list("").empty());
  CHECK(parse_cpu_list("\n").empty());
  CHECK(throws("3-1"));
  CHECK(throws("a"));
  CHECK(throws("1-"));
  CHECK(throws("-1"));
  CHECK(throws("2x"));
}

TEST(nodes_from_a_sysfs_tree_within_the_affinity) {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  CHECK(sched_getaffinity(0, sizeof mask, &mask) == 0);
  int mine = -1;
  for (int c = 0; c < CPU_SETSIZE && mine < 0; ++c) {
    if (CPU_ISSET(c, &mask)) mine = c;
  }
  CHECK(mine >= 0);
  char dir[] = "/tmp/hytrain_numa_XXXXXX";
  CHECK(mkdtemp(dir) != nullptr);
  const std::string root = dir;
  for (const char* n : {"node0", "node1", "node3", "nodeX"}) mkdir((root + "/" + n).c_str(), 0755);
  write_file(root + "/node1/cpulist", std::to_string(mine) + "\n");
  write_file(root + "/node0/cpulist", "\n");                  // a memory-only node: no CPUs
  write_file(root + "/node3/cpulist", std::to_string(CPU_SETSIZE - 1) + "\n");  // outside the affinity
  write_file(root + "/nodeX/cpulist", std::to_string(mine) + "\n");  // not a node's name
  write_file(root + "/possible", "0-3\n");
  const auto nodes = numa_nodes_of_affinity(root);
  CHECK(nodes.size() == 1);
  if (nodes.size() == 1) {
    CHECK(nodes[0].id == 1);
    CHECK((nodes[0].cpus == std::vector<int>{mine}));
  }
  CHECK(numa_nodes_of_affinity(root + "/absent").empty());
  std::system(("rm -rf " + root).c_str());
}

TEST(every_page_present_after_placement) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t bytes = 7 * kPlacementChunk + 3 * page;
  const auto real = numa_nodes_of_affinity();
  // Two nodes made of this process's own CPUs: the spread path runs whatever the machine has.
  std::vector<NumaNode> two = {{0, {}}, {1, {}}};
  cpu_set_t mask;
  CPU_ZERO(&mask);
  sched_getaffinity(0, sizeof mask, &mask);
  for (int c = 0, k = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &mask)) two[(k++) % 2].cpus.push_back(c);
  }
  if (two[1].cpus.empty()) two[1].cpus = two[0].cpus;
  for (PagePlacement how : {PagePlacement::local, PagePlacement::spread}) {
    void* map = mmap(nullptr, bytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(map != MAP_FAILED);
    char* p = static_cast<char*>(map) + page;  // a start off the chunk grid
    CHECK(resident_pages(p, bytes) == 0);
    const int used = place_pages(p, bytes, how, two);
    CHECK(used == (how == PagePlacement::spread ? 2 : 1));
    CHECK(resident_pages(p, bytes) == bytes / page);
    CHECK(resident_pages(map, page) == 0);  // nothing before the range
    CHECK(place_pages(p, page, how, two) == 1);  // too small to spread
    CHECK(place_pages(p, bytes, how, real) >= 1);
    munmap(map, bytes + page);
  }
}

TEST(placement_from_the_environment) {
  unsetenv("HYTRAIN_PAGE_PLACEMENT");
  CHECK(page_placement() == PagePlacement::spread);
  setenv("HYTRAIN_PAGE_PLACEMENT", "local", 1);
  CHECK(page_placement() == PagePlacement::local);
  setenv("HYTRAIN_PAGE_PLACEMENT", "everywhere", 1);
  bool threw = false;
  try {
    page_placement();
  } catch (const Error& e) {
    threw = std::string(e.what()).find("HYTRAIN_PAGE_PLACEMENT") != std::string::npos;
  }
  CHECK(threw);
  unsetenv("HYTRAIN_PAGE_PLACEMENT");
}

HYTEST_MAIN()
