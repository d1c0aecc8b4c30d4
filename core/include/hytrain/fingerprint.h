// Content fingerprints of weights: whether the training loop wrote a parameter's bf16/fp16/fp32 copy
// since the optimizer last wrote it, by any path (.data, raw pointers, other threads), without
// keeping a second copy of the weights.
//
// A span of memory is read as 16-bit words w[0..n) (a trailing odd byte is one more word). Its
// fingerprint is the sum, modulo 2^64, of mix(i, w[i]) over the words, where mix is a 32-bit avalanche
// of the word's index (modulo 2^32) and its value. For each index, mix is a bijection of the value, so a
// change of any one word always changes the fingerprint; changes of several words go unseen only
// when their differences cancel exactly (about one in 2^32 for unrelated writes). The sum is
// order-free: the host and the device compute it in any split and agree bit for bit.
#pragma once

#include <cstdint>

#include "hytrain/dtype.h"  // HYTRAIN_HOST_DEVICE

namespace hytrain {

HYTRAIN_HOST_DEVICE inline uint32_t fingerprint_mix(uint64_t index, uint32_t word) {
  uint32_t x = static_cast<uint32_t>(index) * 0x9E3779B1u + (word + 1u) * 0x85EBCA77u;
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  x ^= x >> 12;
  x *= 0x297A2D39u;
  x ^= x >> 15;
  return x;
}

// The fingerprint of data[0, bytes) on the host (multi-threaded above a few MB).
uint64_t fingerprint(const void* data, int64_t bytes);

}  // namespace hytrain
