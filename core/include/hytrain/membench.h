// Host memory bandwidth probes (STREAM-style copy and triad, OpenMP), the reference every CPU
// optimizer figure is compared with in the same run. Bytes are counted as each array read once plus
// each array written once, the convention used for the optimizer's own figures.
#pragma once

#include <cstdint>

namespace hytrain {

struct BandwidthResult {
  double copy_gbps;   // c = a: 8 bytes per element
  double triad_gbps;  // a = b + s*c: 12 bytes per element
};

// Runs copy and triad over three float arrays of `elements` each (allocated, first-touched by the
// threads that use them, and freed here), best of `repeats`. num_threads <= 0: OpenMP default.
BandwidthResult measure_host_bandwidth(int64_t elements, int num_threads = 0, int repeats = 5);

}  // namespace hytrain
