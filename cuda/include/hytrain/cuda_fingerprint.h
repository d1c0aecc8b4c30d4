// Fingerprints (hytrain/fingerprint.h) of a fixed list of device spans, computed on a stream: one
// launch writes one 64-bit fingerprint per span into a device array, equal bit for bit to what
// hytrain::fingerprint computes on the host for the same bytes.
#pragma once

#include <cstdint>
#include <vector>

namespace hytrain {
namespace cuda {

struct SpanRef {
  const void* data = nullptr;
  int64_t bytes = 0;
};

class FingerprintGroup {
 public:
  FingerprintGroup(const std::vector<SpanRef>& spans, int device);
  ~FingerprintGroup();
  FingerprintGroup(const FingerprintGroup&) = delete;
  FingerprintGroup& operator=(const FingerprintGroup&) = delete;

  // out[i] = the fingerprint of span i (out: a device array of size() uint64), enqueued on stream.
  void compute(uint64_t* out, std::uintptr_t stream);

  int64_t size() const { return size_; }

 private:
  void* descs_ = nullptr;   // device span table
  void* chunks_ = nullptr;  // device chunk table
  int64_t num_chunks_ = 0;
  int64_t size_ = 0;
  int device_;
  int grid_;
};

// out[i] = the fingerprint of spans[i] (out: a device array of spans.size() uint64), enqueued on
// stream, for spans whose addresses change from call to call (gradients): nothing is uploaded, the
// spans travel with the launch (32 at a time).
void fingerprint_spans(const std::vector<SpanRef>& spans, uint64_t* out, int device, std::uintptr_t stream);

}  // namespace cuda
}  // namespace hytrain
