// Host memory bandwidth probes (STREAM-style copy and triad, OpenMP), the reference every CPU
// optimizer figure is compared with in the same run. Bytes are counted as each array read once plus
// each array written once, the convention used for the optimizer's own figures.
#pragma once

#include <cstdint>

namespace hytrain {

// STREAM's copy and triad write to an array they do not read, so the CPU also reads each written line
// first (write-allocate) and they move 3/2 and 4/3 of the bytes they count. An optimizer updates its
// state in place and pays no such read, so `update` (a read-modify-write triad) is reported beside
// them as the tighter ceiling for in-place streams.
struct BandwidthResult {
  double copy_gbps;    // c = a: 8 bytes per element
  double triad_gbps;   // a = b + s*c: 12 bytes per element
  double update_gbps;  // a = a + s*b: 12 bytes per element, in place
};

// Runs copy and triad over three float arrays of `elements` each (allocated, first-touched by the
// threads that use them, and freed here), best of `repeats`. num_threads <= 0: OpenMP default.
BandwidthResult measure_host_bandwidth(int64_t elements, int num_threads = 0, int repeats = 5);

}  // namespace hytrain
