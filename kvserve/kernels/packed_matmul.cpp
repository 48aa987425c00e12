// x @ weight^T in bf16 with AVX512-BF16 dot products, on a weight packed once at load time.
//
// vdpbf16ps multiplies pairs of bf16 and adds both products into one float lane: twice the
// multiply-adds per instruction of a float FMA. The weight is stored as tiles of 16 output rows
// whose k-pairs interleave ([n/16][k/2][16][2]), so one 64-byte load feeds 16 outputs and each x
// pair is a broadcast folded into the instruction. A register block of MR x rows by NT tiles
// keeps MR*NT accumulators. Outputs go to a float32/bf16 matrix and/or a running argmax per row
// (greedy decoding over the lm_head without materializing logits; ties go to the lowest index,
// like torch.argmax). Rows of the packed weight past n are zero and never win the argmax.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

#include "args.h"
#include "simd.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KVSERVE_HAS_BF16_DOT 1
#else
#define KVSERVE_HAS_BF16_DOT 0
#endif

namespace {

using namespace kvserve;

constexpr int kTile = 16;  // output rows per packed tile (one float vector)

#if KVSERVE_HAS_BF16_DOT

struct RowBest {
  __m512 value;
  __m512i index;
};

template <int MR, int NT>
inline void micro_kernel(const uint16_t* tiles, int64_t tile_stride, const uint16_t* x, int64_t ldx, int pairs,
                         __m512 (&acc)[MR][NT]) {
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  for (int p = 0; p < pairs; ++p) {
    __m512bh b[NT];
    for (int t = 0; t < NT; ++t)
      b[t] = (__m512bh)_mm512_loadu_si512(static_cast<const void*>(tiles + t * tile_stride + static_cast<int64_t>(p) * 32));
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * p, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], a, b[t]);
    }
  }
}

inline void store_tile(void* out, int out_dtype, int64_t offset, __m512 values, __mmask16 valid) {
  if (out_dtype == kFloat32) {
    _mm512_mask_storeu_ps(static_cast<float*>(out) + offset, valid, values);
  } else if (out_dtype == kBFloat16) {
    // round to nearest even like torch (vcvtneps2bf16 would flush subnormals); NaN stays NaN
    const __m512i bits = _mm512_castps_si512(values);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + offset, valid, _mm512_cvtepi32_epi16(rounded));
  } else {
    _mm256_mask_storeu_epi16(static_cast<_Float16*>(out) + offset, valid, _mm512_cvtps_ph(values, _MM_FROUND_TO_NEAREST_INT));
  }
}

// one block of NT tiles (starting at tile `first`) against MR rows starting at `row`
template <int MR, int NT>
void block(const uint16_t* packed, int64_t first, int64_t n, int pairs, const uint16_t* x, int64_t ldx,
           int row, void* out, int out_dtype, RowBest* best) {
  const int64_t tile_stride = static_cast<int64_t>(pairs) * 32;
  __m512 acc[MR][NT];
  micro_kernel<MR, NT>(packed + first * tile_stride, tile_stride, x + row * ldx, ldx, pairs, acc);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int t = 0; t < NT; ++t) {
    const int64_t column = (first + t) * kTile;
    const int64_t left = n - column;
    const __mmask16 valid = left >= kTile ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    const __m512i index = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(column)));
    for (int m = 0; m < MR; ++m) {
      if (out) store_tile(out, out_dtype, static_cast<int64_t>(row + m) * n + column, acc[m][t], valid);
      if (best) {
        RowBest& b = best[row + m];
        const __mmask16 better = _mm512_mask_cmp_ps_mask(valid, acc[m][t], b.value, _CMP_GT_OQ);
        b.value = _mm512_mask_blend_ps(better, b.value, acc[m][t]);
        b.index = _mm512_mask_blend_epi32(better, b.index, index);
      }
    }
  }
}

template <int NT>
void rows_block(const uint16_t* packed, int64_t first, int64_t n, int pairs, const uint16_t* x,
                int64_t ldx, int rows, void* out, int out_dtype, RowBest* best) {
  constexpr int MR = 8;
  int row = 0;
  for (; row + MR <= rows; row += MR) block<MR, NT>(packed, first, n, pairs, x, ldx, row, out, out_dtype, best);
  switch (rows - row) {
    case 7: block<7, NT>(packed, first, n, pairs, x, ldx, row, out, out_dtype, best); break;
    case 6: block<6, NT>(packed, first, n, pairs, x, ldx, row, out, out_dtype, best); break;
    case 5: block<5, NT>(packed, first, n, pairs, x, ldx, row, out, out_dtype, best); break;
    case 4: block<4, NT>(packed, first, n, pairs, x, ldx, row, out, out_dtype, best); break;
    case 3: block<3, NT>(packed, first, n, pairs, x, ldx, row, out, out_dtype, best); break;
    case 2: block<2, NT>(packed, first, n, pairs, x, ldx, row, out, out_dtype, best); break;
    case 1: block<1, NT>(packed, first, n, pairs, x, ldx, row, out, out_dtype, best); break;
    default: break;
  }
}

#endif  // KVSERVE_HAS_BF16_DOT

}  // namespace

extern "C" {

int kvserve_has_bf16_dot() { return KVSERVE_HAS_BF16_DOT; }

// weight: bf16 [n, k] (row stride k), k even. packed: bf16 [ceil(n/16) * 16 * k], zero-padded.
int kvserve_pack_bf16_weight(const uint16_t* weight, int64_t n, int k, uint16_t* packed) {
  if (n <= 0 || k <= 0 || k % 2) return 1;
  const int64_t tiles = (n + kTile - 1) / kTile;
  const int pairs = k / 2;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    uint16_t* dst = packed + t * static_cast<int64_t>(kTile) * k;
    for (int p = 0; p < pairs; ++p)
      for (int i = 0; i < kTile; ++i) {
        const int64_t r = t * kTile + i;
        const bool inside = r < n;
        dst[(static_cast<int64_t>(p) * kTile + i) * 2] = inside ? weight[r * k + 2 * p] : 0;
        dst[(static_cast<int64_t>(p) * kTile + i) * 2 + 1] = inside ? weight[r * k + 2 * p + 1] : 0;
      }
  }
  return 0;
}

// x: bf16 [rows, k] (row stride ldx). out ([rows, n] in out_dtype) and argmax (int64 [rows]) may
// each be null.
int kvserve_packed_matmul(const kvserve::PackedMatmulArgs* a) {
#if KVSERVE_HAS_BF16_DOT
  const uint16_t* packed = a->packed;
  const uint16_t* x = a->x;
  void* out = a->out;
  int64_t* argmax = a->argmax;
  const int64_t n = a->n, ldx = a->ldx;
  const int k = a->k, rows = a->rows, out_dtype = a->out_dtype;
  if (n <= 0 || k <= 0 || k % 2 || rows <= 0 || ldx < k || out_dtype < 0 || out_dtype > 2) return 1;
  constexpr int NT = 3;
  const int pairs = k / 2;
  const int64_t tiles = (n + kTile - 1) / kTile;
  const int64_t blocks = (tiles + NT - 1) / NT;
  std::vector<float> merged_value(rows, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> merged_index(rows, -1);
#pragma omp parallel
  {
    std::vector<RowBest> best;
    if (argmax) best.assign(rows, RowBest{_mm512_set1_ps(-std::numeric_limits<float>::infinity()), _mm512_set1_epi32(-1)});
    RowBest* best_ptr = argmax ? best.data() : nullptr;
    // each thread takes a contiguous range of weight blocks; with many rows (a prefill) it walks
    // them once per chunk of rows small enough to stay in L2, instead of streaming all of x again
    // from L3 for every block
    const int threads = omp_get_num_threads();
    const int me = omp_get_thread_num();
    const int64_t block_begin = blocks * me / threads;
    const int64_t block_end = blocks * (me + 1) / threads;
    const int chunk_rows = std::max(8, static_cast<int>((256 << 10) / (static_cast<int64_t>(k) * 2)) / 8 * 8);
    const int64_t out_bytes = out_dtype == kFloat32 ? 4 : 2;
    for (int r0 = 0; r0 < rows; r0 += chunk_rows) {
      const int chunk = std::min(chunk_rows, rows - r0);
      const uint16_t* xc = x + r0 * ldx;
      void* oc = out ? static_cast<void*>(static_cast<char*>(out) + static_cast<int64_t>(r0) * n * out_bytes) : nullptr;
      RowBest* bc = best_ptr ? best_ptr + r0 : nullptr;
      for (int64_t b = block_begin; b < block_end; ++b) {
        const int64_t first = b * NT;
        const int64_t count = std::min<int64_t>(NT, tiles - first);
        if (count == NT) rows_block<NT>(packed, first, n, pairs, xc, ldx, chunk, oc, out_dtype, bc);
        else if (count == 2) rows_block<2>(packed, first, n, pairs, xc, ldx, chunk, oc, out_dtype, bc);
        else rows_block<1>(packed, first, n, pairs, xc, ldx, chunk, oc, out_dtype, bc);
      }
    }
    if (argmax) {
      for (int r = 0; r < rows; ++r) {
        alignas(64) float value[kTile];
        alignas(64) int32_t index[kTile];
        _mm512_store_ps(value, best[r].value);
        _mm512_store_si512(index, best[r].index);
        float top = -std::numeric_limits<float>::infinity();
        int64_t at = -1;
        for (int i = 0; i < kTile; ++i)
          if (index[i] >= 0 && (at < 0 || value[i] > top || (value[i] == top && index[i] < at))) {
            top = value[i];
            at = index[i];
          }
#pragma omp critical
        if (at >= 0 && (merged_index[r] < 0 || top > merged_value[r] || (top == merged_value[r] && at < merged_index[r]))) {
          merged_value[r] = top;
          merged_index[r] = at;
        }
      }
    }
  }
  if (argmax)
    for (int r = 0; r < rows; ++r) argmax[r] = merged_index[r] < 0 ? 0 : merged_index[r];
  return 0;
#else
  return 2;  // built for a CPU without AVX512-BF16
#endif
}

}  // extern "C"
