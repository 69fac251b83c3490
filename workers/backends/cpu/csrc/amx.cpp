// amx.py: prompt-sized linears on coded weights with AMX tiles
#include <pdserve_prelude.h>  // first: its precompiled copy (build.py)

#include "binding.h"

// GCC 12's AVX-512 intrinsics (_mm512_undefined_epi32's `__m512i __Y = __Y;`) trip
// -Wmaybe-uninitialized where they are inlined (GCC bug 105593, fixed in GCC 13)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <omp.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <vector>

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,fma")

constexpr int P = PD_PANEL;  // cpu_linear.PANEL: output columns a panel (the scales' layout)
constexpr int NB = P / 16;  // 16-column blocks a panel: one accumulator tile each
constexpr int G = PD_GROUP;  // k's a group: one tile's depth (32 bf16)
constexpr int CB = PD_CHUNK_BLOCKS;  // 16-row blocks a work item: their parts stay in L2

struct TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// every tile 16 rows x 64 bytes: 0..2 a panel's accumulators (16 x 16 fp32 each); 3, 4 input
// parts (16 rows x 32 bf16), in turn; 5..7 a group's codes of each block (16 k pairs x 16 columns x 2)
static void configure() {
  alignas(64) TileConfig c;
  std::memset(&c, 0, sizeof(c));
  c.palette = 1;
  for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = 16;
  _tile_loadconfig(&c);
}

// x [M][K] fp32 -> parts [Mp/16][K/G][3][16][G] bf16 bits: for each block of 16 rows and group,
// three tiles, 1 KB each (hi, mid, lo: x = hi + mid + lo exactly, each cut by truncation so that
// each rest is exact); and sums [Mp][K/G], each group's inputs added in fp32, in order. Rows M..Mp-1 zero.
static void split(const float* __restrict__ x, int64_t M, int64_t Mp, int64_t K, uint16_t* __restrict__ parts,
                  float* __restrict__ sums, int64_t threads) {
  const int64_t groups = K / G;
  const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < Mp; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      uint16_t* o = parts + ((t / 16 * groups + g) * 3 * 16 + t % 16) * G;  // its hi row; mid, lo 16 rows on
      float s = 0.0f;
      for (int i = 0; i < G; i += 16) {
        const __m512 v = t < M ? _mm512_loadu_ps(x + t * K + g * G + i) : _mm512_setzero_ps();
        const __m512i hb = _mm512_and_si512(_mm512_castps_si512(v), top);
        const __m512 r = _mm512_sub_ps(v, _mm512_castsi512_ps(hb));  // exact: the bits below the top 8
        const __m512i mb = _mm512_and_si512(_mm512_castps_si512(r), top);
        const __m512 l = _mm512_sub_ps(r, _mm512_castsi512_ps(mb));  // exact, at most 8 significant bits
        _mm256_storeu_si256((__m256i*)(o + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(hb, 16)));
        _mm256_storeu_si256((__m256i*)(o + 16 * G + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(mb, 16)));
        _mm256_storeu_si256((__m256i*)(o + 32 * G + i),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(l), 16)));
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, v);
        for (int j = 0; j < 16; ++j) s += lanes[j];
      }
      sums[t * groups + g] = s;
    }
  }
}

// tiles: [num_panels][NB][K/G][16 k pairs][16 columns][2] bf16 codes (``tiles``); scales:
// cpu_linear's [num_panels][K/G][2][P] (each group's step d, then its offset m)
static void kernel(const float* x, const uint16_t* tiles, const float* scales, const float* bias, float* out,
                       int64_t M, int64_t N, int64_t K, int64_t has_bias, int64_t threads) {
  const int64_t groups = K / G;
  const int64_t Mp = (M + 15) / 16 * 16;
  const int64_t blocks = Mp / 16;
  const int64_t chunks = (blocks + CB - 1) / CB;
  const int64_t num_panels = (N + P - 1) / P;
  // the calling thread's buffers, kept between calls (a prompt step's fresh pages cost more than the split)
  static thread_local std::vector<uint16_t> parts;
  static thread_local std::vector<float> sums;
  if ((int64_t)parts.size() < Mp * groups * 3 * G) parts.resize(Mp * groups * 3 * G);
  if ((int64_t)sums.size() < Mp * groups) sums.resize(Mp * groups);
  uint16_t* const parts_ = parts.data();  // thread_local: the OpenMP threads below use these pointers
  float* const sums_ = sums.data();
  split(x, M, Mp, K, parts_, sums_, threads);
  #pragma omp parallel num_threads(threads)
  {
    configure();
    alignas(64) float c[2][NB][16][16];  // a (group, block)'s products, stored from the tiles, two in turn
    alignas(64) float acc[CB][NB][16][16];
    // work items: (row chunk, panel); the chunk's parts stay in L2 while its panels go past
    #pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t chunk = 0; chunk < chunks; ++chunk)
      for (int64_t p = 0; p < num_panels; ++p) {
        const uint16_t* tp = tiles + p * NB * groups * 512;
        const float* sp = scales + p * groups * 2 * P;
        const int64_t b0 = chunk * CB;
        const int64_t nblocks = (chunk + 1) * CB < blocks ? CB : blocks - b0;
        std::memset(acc, 0, sizeof(acc));
        // acc += d * products, for a (group, block): run one pair behind the tile multiplies, on
        // the products stored the pair before (by then those tile stores have landed)
        auto scale = [&](int64_t g, int64_t i, const float (*cc)[16][16]) {
          const float* sg = sp + g * 2 * P;
          for (int nb = 0; nb < NB; ++nb) {
            const __m512 d = _mm512_loadu_ps(sg + nb * 16);
            for (int r = 0; r < 16; ++r) {
              const __m512 v = _mm512_load_ps(acc[i][nb][r]);
              _mm512_store_ps(acc[i][nb][r], _mm512_fmadd_ps(d, _mm512_load_ps(cc[nb][r]), v));
            }
          }
        };
        int64_t pend_g = -1, pend_i = 0;
        int flip = 0;
        for (int64_t g = 0; g < groups; ++g) {
          _tile_loadd(5, tp + (0 * groups + g) * 512, 64);  // the group's codes: kept for every block
          _tile_loadd(6, tp + (1 * groups + g) * 512, 64);
          _tile_loadd(7, tp + (2 * groups + g) * 512, 64);
          for (int64_t i = 0; i < nblocks; ++i) {
            const uint16_t* a = parts_ + ((b0 + i) * groups + g) * 3 * 512;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_loadd(3, a, 64);  // hi
            _tile_dpbf16ps(0, 3, 5);
            _tile_dpbf16ps(1, 3, 6);
            _tile_dpbf16ps(2, 3, 7);
            _tile_loadd(4, a + 512, 64);  // mid
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(3, a + 1024, 64);  // lo
            _tile_dpbf16ps(0, 3, 5);
            _tile_dpbf16ps(1, 3, 6);
            _tile_dpbf16ps(2, 3, 7);
            if (pend_g >= 0) scale(pend_g, pend_i, c[flip ^ 1]);
            _tile_stored(0, c[flip][0], 64);
            _tile_stored(1, c[flip][1], 64);
            _tile_stored(2, c[flip][2], 64);
            pend_g = g, pend_i = i, flip ^= 1;
          }
        }
        if (pend_g >= 0) scale(pend_g, pend_i, c[flip ^ 1]);
        // acc += m * (the group's inputs summed), over the groups: 16 rows at once, in registers
        for (int64_t i = 0; i < nblocks; ++i)
          for (int nb = 0; nb < NB; ++nb) {
            __m512 v[16];
            for (int r = 0; r < 16; ++r) v[r] = _mm512_load_ps(acc[i][nb][r]);
            const float* xs = sums_ + (b0 + i) * 16 * groups;
            for (int64_t g = 0; g < groups; ++g) {
              const __m512 m = _mm512_loadu_ps(sp + g * 2 * P + P + nb * 16);
              for (int r = 0; r < 16; ++r) v[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * groups + g]), v[r]);
            }
            for (int r = 0; r < 16; ++r) _mm512_store_ps(acc[i][nb][r], v[r]);
          }
        // out = acc (+ bias): the columns and rows that exist
        for (int64_t i = 0; i < nblocks; ++i)
          for (int nb = 0; nb < NB; ++nb) {
            const int64_t col0 = p * P + nb * 16;
            if (col0 >= N) break;
            const int64_t cols = N - col0 < 16 ? N - col0 : 16;
            const __mmask16 keep = (__mmask16)((1u << cols) - 1);
            const __m512 bv = has_bias ? _mm512_maskz_loadu_ps(keep, bias + col0) : _mm512_setzero_ps();
            for (int r = 0; r < 16; ++r) {
              const int64_t row = (b0 + i) * 16 + r;
              if (row >= M) break;
              _mm512_mask_storeu_ps(out + row * N + col0, keep, _mm512_add_ps(_mm512_load_ps(acc[i][nb][r]), bv));
            }
          }
      }
    _tile_release();
  }
}
#pragma GCC pop_options

PDSERVE_MODULE(kernel)
