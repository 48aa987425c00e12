// The int8 screen of a bf16 lm_head, shared by screened_argmax.cpp (greedy) and
// screened_sampler.cpp (sampling): int8 approximations of every token's logit, group by group,
// and the exact bf16 values of chosen tiles, bit-identical to packed_matmul's.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define KVSERVE_HAS_SCREEN 1
#else
#define KVSERVE_HAS_SCREEN 0
#endif

namespace kvserve::screen {

constexpr int kTile = 16;
constexpr int kMaxGroups = 32;

#if KVSERVE_HAS_SCREEN

// MR rows x NT tiles of int8 products, folded group by group into float approximations
template <int MR, int NT>
inline void screen_block(const uint8_t* qtiles, int64_t tile_stride, const int8_t* xq, int64_t ldxq, int quads,
                         int quads_per_group, const float* group_scale, int groups, __m512 (&approx)[MR][NT]) {
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) approx[m][t] = _mm512_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    __m512i acc[MR][NT];
    for (int m = 0; m < MR; ++m)
      for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_si512();
    const int q_end = std::min(quads, (g + 1) * quads_per_group);
    for (int p = g * quads_per_group; p < q_end; ++p) {
      __m512i b[NT];
      for (int t = 0; t < NT; ++t)
        b[t] = _mm512_loadu_si512(static_cast<const void*>(qtiles + t * tile_stride + static_cast<int64_t>(p) * 64));
      for (int m = 0; m < MR; ++m) {
        int32_t quad;
        std::memcpy(&quad, xq + m * ldxq + 4 * p, sizeof(quad));
        const __m512i a = _mm512_set1_epi32(quad);
        for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_dpbusd_epi32(acc[m][t], b[t], a);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 scale = _mm512_set1_ps(group_scale[m * groups + g]);
      for (int t = 0; t < NT; ++t) approx[m][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][t]), scale, approx[m][t]);
    }
  }
}

// The exact bf16 values of C candidate tiles (each for its own row): per lane the same vdpbf16ps
// sequence as packed_matmul, so the values are bit-identical; C independent chains hide latency.
template <int C>
inline void exact_tiles(const uint16_t* bf16_packed, const int64_t* tile, int k, const uint16_t* const* x, __m512* out) {
  const int pairs = k / 2;
  const uint16_t* w[C];
  for (int c = 0; c < C; ++c) {
    w[c] = bf16_packed + tile[c] * static_cast<int64_t>(pairs) * 32;
    out[c] = _mm512_setzero_ps();
  }
  for (int p = 0; p < pairs; ++p)
    for (int c = 0; c < C; ++c) {
      int32_t pair;
      std::memcpy(&pair, x[c] + 2 * p, sizeof(pair));
      out[c] = _mm512_dpbf16_ps(out[c], (__m512bh)_mm512_set1_epi32(pair),
                                (__m512bh)_mm512_loadu_si512(static_cast<const void*>(w[c] + static_cast<int64_t>(p) * 32)));
    }
}

#endif  // KVSERVE_HAS_SCREEN

}  // namespace kvserve::screen
