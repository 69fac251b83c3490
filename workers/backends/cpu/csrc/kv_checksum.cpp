// checksum.py: KV blocks copied between a cache and a transfer's wire buffer, checksummed on the way
// (the definition: workers/transfer/checksum.py).
#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "binding.h"

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#endif

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;  // a word's key: its position times this
constexpr uint64_t kMix = 0xBF58476D1CE4E5B9ull;     // odd: multiplying by it is a bijection

// GCC 12's AVX-512 headers fill vectors from _mm512_undefined_epi32() in _mm512_srli_epi64 and
// _mm512_reduce_add_epi64, which -Wuninitialized reports here (GCC bug 105593, fixed in 13).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// sum over i of mix(words[i] ^ (first + i) * kGolden), mod 2^64; mix(x) = y ^ (y >> 32), y = x * kMix.
// Each term is a bijection of its word, so a changed word always changes the sum.
inline uint64_t chunk_sum(const uint64_t* __restrict__ words, int64_t n, uint64_t first) {
  uint64_t acc = 0;
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  // four independent chains of 8 lanes: the multiplies' latency hides behind each other
  const __m512i golden = _mm512_set1_epi64(static_cast<int64_t>(kGolden));
  const __m512i mix = _mm512_set1_epi64(static_cast<int64_t>(kMix));
  const __m512i step = _mm512_set1_epi64(static_cast<int64_t>(32 * kGolden));
  const __m512i lane = _mm512_set1_epi64(static_cast<int64_t>(8 * kGolden));
  __m512i key[4];
  key[0] = _mm512_mullo_epi64(
      _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(first)), _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0)),
      golden);
  for (int k = 1; k < 4; ++k) key[k] = _mm512_add_epi64(key[k - 1], lane);
  __m512i sum[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  for (; i + 32 <= n; i += 32) {
    for (int k = 0; k < 4; ++k) {
      const __m512i y = _mm512_mullo_epi64(_mm512_xor_si512(_mm512_loadu_si512(words + i + 8 * k), key[k]), mix);
      sum[k] = _mm512_add_epi64(sum[k], _mm512_xor_si512(y, _mm512_srli_epi64(y, 32)));
      key[k] = _mm512_add_epi64(key[k], step);
    }
  }
  acc = static_cast<uint64_t>(
      _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(sum[0], sum[1]), _mm512_add_epi64(sum[2], sum[3]))));
#endif
  for (; i < n; ++i) {
    const uint64_t y = (words[i] ^ ((first + static_cast<uint64_t>(i)) * kGolden)) * kMix;
    acc += y ^ (y >> 32);
  }
  return acc;
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace

// Chunks [begin, end) of the wire (kernel below): each copied, then summed where the copy has just
// put it, in cache, unless the cache's rows are apart (a run of heads): then the wire's copy is
// summed before the scatter. partial[c]: chunk c's sum.
static void copy_and_sum(const int64_t* layer_ptrs, const int64_t* ids, uint8_t* wire, int64_t* partial,
                         int64_t begin, int64_t end, int64_t n, int64_t plane, int64_t block, int64_t row,
                         int64_t rows, int64_t seg, int64_t mode) {
  const int64_t chunk = rows * seg;
  const int64_t words = chunk / 8;
  const bool whole = row == seg;
  for (int64_t c = begin; c < end; ++c) {
    const int64_t lp = c / n, j = c % n, l = lp / 2, p = lp % 2;
    uint8_t* out = wire + c * chunk;
    const uint64_t first = static_cast<uint64_t>(lp * words);
    if (mode == 2) {
      partial[c] = static_cast<int64_t>(chunk_sum(reinterpret_cast<const uint64_t*>(out), words, first));
      continue;
    }
    uint8_t* cache = reinterpret_cast<uint8_t*>(layer_ptrs[l]) + p * plane + ids[j] * block;
    if (mode == 0) {
      if (whole) std::memcpy(out, cache, chunk);
      else for (int64_t r = 0; r < rows; ++r) std::memcpy(out + r * seg, cache + r * row, seg);
      partial[c] = static_cast<int64_t>(chunk_sum(reinterpret_cast<const uint64_t*>(out), words, first));
    } else if (whole) {
      std::memcpy(cache, out, chunk);
      partial[c] = static_cast<int64_t>(chunk_sum(reinterpret_cast<const uint64_t*>(cache), words, first));
    } else {
      partial[c] = static_cast<int64_t>(chunk_sum(reinterpret_cast<const uint64_t*>(out), words, first));
      for (int64_t r = 0; r < rows; ++r) std::memcpy(cache + r * row, out + r * seg, seg);
    }
  }
}

// wire: [layers, 2, n, rows * seg] bytes (a transfer's buffer); layer l's cache: its data at
// layer_ptrs[l], block b's row r of plane p at p * plane + b * block + r * row bytes, seg bytes
// of it (a run of heads). mode 0: gather (cache -> wire), 1: scatter (wire -> cache), 2: only sum.
// sums[j] = the checksum of block ids[j]'s bytes on the wire, its chunk of layer l and plane p
// numbered (l * 2 + p) * words + i for i < words = rows * seg / 8. ids are in range (checked by
// the caller); seg is a multiple of 8 bytes. partial: layers * 2 * n int64 of scratch.
// Each thread takes a run of chunks in wire order (writes to the wire stay sequential). The threads
// are plain ones, joined at the end: an OpenMP team would stay spinning after the copy, on the
// core the process group's send needs.
static void kernel(const int64_t* layer_ptrs, const int64_t* ids, uint8_t* wire, int64_t* sums, int64_t* partial,
                   int64_t layers, int64_t n, int64_t plane, int64_t block, int64_t row, int64_t rows, int64_t seg,
                   int64_t mode, int64_t threads) {
  const int64_t chunks = layers * 2 * n;
  const int64_t nt = std::max<int64_t>(1, std::min(threads, chunks));
  std::vector<std::thread> team;
  for (int64_t t = 1; t < nt; ++t)
    team.emplace_back(copy_and_sum, layer_ptrs, ids, wire, partial, chunks * t / nt, chunks * (t + 1) / nt, n, plane,
                      block, row, rows, seg, mode);
  copy_and_sum(layer_ptrs, ids, wire, partial, 0, chunks / nt, n, plane, block, row, rows, seg, mode);
  for (auto& thread : team) thread.join();
  for (int64_t j = 0; j < n; ++j) {
    uint64_t acc = 0;
    for (int64_t lp = 0; lp < layers * 2; ++lp) acc += static_cast<uint64_t>(partial[lp * n + j]);
    sums[j] = static_cast<int64_t>(acc);
  }
}

PDSERVE_MODULE(kernel)
