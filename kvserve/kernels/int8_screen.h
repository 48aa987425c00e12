// The int8 screen of a bf16 lm_head, shared by screened_argmax.cpp (greedy) and
// screened_sampler.cpp (sampling): int8 approximations of every token's logit, group by group,
// and the exact bf16 values of chosen tiles, bit-identical to packed_matmul's.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define KVSERVE_HAS_SCREEN 1
#else
#define KVSERVE_HAS_SCREEN 0
#endif

#if KVSERVE_HAS_SCREEN && KVSERVE_AMX_SUPPORTED && !defined(KVSERVE_AMX_EMULATE)
#define KVSERVE_SCREEN_AMX 1
#else
#define KVSERVE_SCREEN_AMX 0
#endif

namespace kvserve::screen {

constexpr int kTile = 16;
constexpr int kMaxGroups = 32;
// ScreenedArgmaxArgs::bf16_layout: where the exact values come from
constexpr int kPackedLayout = 0;  // packed_matmul.cpp's [tile][k][16] bf16
constexpr int kAmxLayout = 1;     // amx_matmul.cpp's B tiles (k % 32 == 0)

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

#if KVSERVE_SCREEN_AMX
// The same on an lm_head packed in AMX B tiles (amx_matmul.cpp's layout, k % 32 == 0), as
// amx_matmul computes those logits: each tile's product is zeroed, then takes TDPBF16PS over the
// k steps in order with the row as its A tile (stride 0: the row in each of the tile's rows; an
// element depends on its own A row and B column only), so bit-identical. Four tiles at a time.
template <int C>
KVSERVE_AMX_TARGET inline void exact_tiles_amx(const uint16_t* amx_packed, const int64_t* tile, int k, const uint16_t* const* x,
                                               __m512* out) {
  static_assert(C % 4 == 0, "four C tiles per pass");
  const int steps = k / 32;
  const amx::TileConfig config = amx::full_tiles();
  KVSERVE_TILE_LOADCONFIG(&config);
  alignas(64) float c_tiles[4][16][16];
  for (int g = 0; g < C; g += 4) {
    const uint16_t* b[4];
    for (int c = 0; c < 4; ++c) b[c] = amx_packed + tile[g + c] * static_cast<int64_t>(steps) * 512;
    KVSERVE_TILE_ZERO(0);
    KVSERVE_TILE_ZERO(1);
    KVSERVE_TILE_ZERO(2);
    KVSERVE_TILE_ZERO(3);
    for (int s = 0; s < steps; ++s) {
      KVSERVE_TILE_LOADD(4, x[g] + s * 32, 0);
      KVSERVE_TILE_LOADD(6, b[0] + s * 512, 64);
      KVSERVE_TILE_DPBF16PS(0, 4, 6);
      KVSERVE_TILE_LOADD(5, x[g + 1] + s * 32, 0);
      KVSERVE_TILE_LOADD(7, b[1] + s * 512, 64);
      KVSERVE_TILE_DPBF16PS(1, 5, 7);
      KVSERVE_TILE_LOADD(4, x[g + 2] + s * 32, 0);
      KVSERVE_TILE_LOADD(6, b[2] + s * 512, 64);
      KVSERVE_TILE_DPBF16PS(2, 4, 6);
      KVSERVE_TILE_LOADD(5, x[g + 3] + s * 32, 0);
      KVSERVE_TILE_LOADD(7, b[3] + s * 512, 64);
      KVSERVE_TILE_DPBF16PS(3, 5, 7);
    }
    KVSERVE_TILE_STORED(0, c_tiles[0], 64);
    KVSERVE_TILE_STORED(1, c_tiles[1], 64);
    KVSERVE_TILE_STORED(2, c_tiles[2], 64);
    KVSERVE_TILE_STORED(3, c_tiles[3], 64);
    for (int c = 0; c < 4; ++c) out[g + c] = _mm512_load_ps(c_tiles[c][0]);
  }
  KVSERVE_TILE_RELEASE();
}
#endif  // KVSERVE_SCREEN_AMX

// exact_tiles or exact_tiles_amx, by the weight's layout
template <int C>
inline void exact_tiles_of(int layout, const uint16_t* bf16, const int64_t* tile, int k, const uint16_t* const* x, __m512* out) {
#if KVSERVE_SCREEN_AMX
  if (layout == kAmxLayout) {
    exact_tiles_amx<C>(bf16, tile, k, x, out);
    return;
  }
#endif
  (void)layout;
  exact_tiles<C>(bf16, tile, k, x, out);
}

// 0 when the screen can read a weight of this layout and k here
inline int check_layout(int layout, int k) {
  if (layout == kPackedLayout) return 0;
  return KVSERVE_SCREEN_AMX && layout == kAmxLayout && k % 32 == 0 ? 0 : 1;
}

#endif  // KVSERVE_HAS_SCREEN

}  // namespace kvserve::screen
