// x @ weight^T in bf16 with AVX512-BF16 dot products, on a weight packed once at load time.
//
// vdpbf16ps multiplies pairs of bf16 and adds both products into one float lane: twice the
// multiply-adds per instruction of a float FMA. The weight is stored as tiles of 16 output rows
// whose k-pairs interleave ([n/16][k/2][16][2]), so one 64-byte load feeds 16 outputs and each x
// pair is a broadcast folded into the instruction. A register block of MR x rows by NT tiles
// keeps MR*NT accumulators. Outputs go to a float32/bf16 matrix and/or a running argmax per row
// (greedy decoding over the lm_head without materializing logits; ties go to the lowest index,
// like torch.argmax). Rows of the packed weight past n are zero and never win the argmax.
//
// A Q8 packed weight holds the same tiles as int8 values, with one float scale per tile row and 32
// values of k (llama.cpp's Q8_0 blocks, re-laid): a bf16 weight that a Q8_0 GGUF tensor was
// dequantized into (a scale times an integer, rounded to bf16) packs this way losslessly, which
// kvserve_pack_q8_weight checks block by block. The kernel turns each value back into that exact
// bf16 value in registers and feeds the same dot products in the same order: the result is the
// bf16 weight's bit for bit, from half the bytes of memory traffic (worth it for a few rows, where
// the product waits on memory; with more, the conversions cost more than the bytes saved).

#include <algorithm>
#include <cmath>
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

// stores a block's outputs and/or folds them into each row's running argmax
template <int MR, int NT>
inline void finish_block(__m512 (&acc)[MR][NT], int64_t first, int64_t n, int row, void* out, int out_dtype, RowBest* best) {
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

// one block of NT tiles (tile `first` on, its data at `tiles`) against MR rows starting at `row`
template <int MR, int NT>
void block(const uint16_t* tiles, int64_t first, int64_t n, int pairs, const uint16_t* x, int64_t ldx,
           int row, void* out, int out_dtype, RowBest* best) {
  const int64_t tile_stride = static_cast<int64_t>(pairs) * 32;
  __m512 acc[MR][NT];
  micro_kernel<MR, NT>(tiles, tile_stride, x + row * ldx, ldx, pairs, acc);
  finish_block<MR, NT>(acc, first, n, row, out, out_dtype, best);
}

template <int NT>
void rows_block(const uint16_t* tiles, int64_t first, int64_t n, int pairs, const uint16_t* x,
                int64_t ldx, int rows, void* out, int out_dtype, RowBest* best) {
  constexpr int MR = 8;
  int row = 0;
  for (; row + MR <= rows; row += MR) block<MR, NT>(tiles, first, n, pairs, x, ldx, row, out, out_dtype, best);
  switch (rows - row) {
    case 7: block<7, NT>(tiles, first, n, pairs, x, ldx, row, out, out_dtype, best); break;
    case 6: block<6, NT>(tiles, first, n, pairs, x, ldx, row, out, out_dtype, best); break;
    case 5: block<5, NT>(tiles, first, n, pairs, x, ldx, row, out, out_dtype, best); break;
    case 4: block<4, NT>(tiles, first, n, pairs, x, ldx, row, out, out_dtype, best); break;
    case 3: block<3, NT>(tiles, first, n, pairs, x, ldx, row, out, out_dtype, best); break;
    case 2: block<2, NT>(tiles, first, n, pairs, x, ldx, row, out, out_dtype, best); break;
    case 1: block<1, NT>(tiles, first, n, pairs, x, ldx, row, out, out_dtype, best); break;
    default: break;
  }
}

template <int NT>
void rows_block_of(int64_t count, const uint16_t* tiles, int64_t first, int64_t n, int pairs, const uint16_t* x,
                   int64_t ldx, int rows, void* out, int out_dtype, RowBest* best) {
  if (count == NT) rows_block<NT>(tiles, first, n, pairs, x, ldx, rows, out, out_dtype, best);
  else if (count == 2) rows_block<2>(tiles, first, n, pairs, x, ldx, rows, out, out_dtype, best);
  else rows_block<1>(tiles, first, n, pairs, x, ldx, rows, out, out_dtype, best);
}

inline __m512bh q8_pair(const int8_t* q, __m512 scale_low, __m512 scale_high) {
  const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))), scale_low);
  const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))), scale_high);
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// micro_kernel's products with the Q8 tiles turned to bf16 in registers (for a few rows, each
// converted value feeds all of them); the same dot products in the same order, so the same sums
template <int MR, int NT>
void q8_block(const int8_t* q, const float* scales, int64_t first, int64_t n, int pairs, const uint16_t* x, int64_t ldx,
              int row, void* out, int out_dtype, RowBest* best) {
  const __m512i low = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i high = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  const int64_t tile_stride = static_cast<int64_t>(pairs) * 32;
  const int blocks = pairs / 16;
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  const uint16_t* xr = x + row * ldx;
  for (int b = 0; b < blocks; ++b) {
    __m512 scale_low[NT], scale_high[NT];
    for (int t = 0; t < NT; ++t) {
      const __m512 scale = _mm512_loadu_ps(scales + ((first + t) * blocks + b) * kTile);
      scale_low[t] = _mm512_permutexvar_ps(low, scale);
      scale_high[t] = _mm512_permutexvar_ps(high, scale);
    }
    for (int p = b * 16; p < b * 16 + 16; ++p) {
      __m512bh w[NT];
      for (int t = 0; t < NT; ++t) w[t] = q8_pair(q + (first + t) * tile_stride + static_cast<int64_t>(p) * 32, scale_low[t], scale_high[t]);
      for (int m = 0; m < MR; ++m) {
        int32_t pair;
        std::memcpy(&pair, xr + m * ldx + 2 * p, sizeof(pair));
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], a, w[t]);
      }
    }
  }
  finish_block<MR, NT>(acc, first, n, row, out, out_dtype, best);
}

template <int MR>
void q8_tiles(const int8_t* q, const float* scales, int64_t first, int64_t count, int64_t n, int pairs, const uint16_t* x,
              int64_t ldx, void* out, int out_dtype, RowBest* best) {
  int64_t t = 0;
  for (; t + 2 <= count; t += 2) q8_block<MR, 2>(q, scales, first + t, n, pairs, x, ldx, 0, out, out_dtype, best);
  if (t < count) q8_block<MR, 1>(q, scales, first + t, n, pairs, x, ldx, 0, out, out_dtype, best);
}

// up to 8 rows against `count` Q8 tiles, converting each value once in registers
void q8_few_rows(int rows, const int8_t* q, const float* scales, int64_t first, int64_t count, int64_t n, int pairs,
                 const uint16_t* x, int64_t ldx, void* out, int out_dtype, RowBest* best) {
  switch (rows) {
    case 8: q8_tiles<8>(q, scales, first, count, n, pairs, x, ldx, out, out_dtype, best); break;
    case 7: q8_tiles<7>(q, scales, first, count, n, pairs, x, ldx, out, out_dtype, best); break;
    case 6: q8_tiles<6>(q, scales, first, count, n, pairs, x, ldx, out, out_dtype, best); break;
    case 5: q8_tiles<5>(q, scales, first, count, n, pairs, x, ldx, out, out_dtype, best); break;
    case 4: q8_tiles<4>(q, scales, first, count, n, pairs, x, ldx, out, out_dtype, best); break;
    case 3: q8_tiles<3>(q, scales, first, count, n, pairs, x, ldx, out, out_dtype, best); break;
    case 2: q8_tiles<2>(q, scales, first, count, n, pairs, x, ldx, out, out_dtype, best); break;
    default: q8_tiles<1>(q, scales, first, count, n, pairs, x, ldx, out, out_dtype, best); break;
  }
}

inline uint16_t bf16_nearest_even(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// a scale and 32 integers whose products round to the 32 bf16 values exactly; false if none of
// the fp16 scales near max|v| / 127 does it
bool q8_of_block(const uint16_t* values, float& scale, int8_t* q) {
  float v[32], amax = 0.0f;
  for (int i = 0; i < 32; ++i) {
    const uint32_t bits = static_cast<uint32_t>(values[i]) << 16;
    std::memcpy(&v[i], &bits, sizeof(float));
    amax = std::max(amax, std::fabs(v[i]));
  }
  if (!(amax < std::numeric_limits<float>::infinity())) return false;  // inf or NaN
  if (amax == 0.0f) {
    for (int i = 0; i < 32; ++i) {
      if (values[i] != 0) return false;  // -0
      q[i] = 0;
    }
    scale = 0.0f;
    return true;
  }
  const int center = _cvtss_sh(amax / 127.0f, _MM_FROUND_TO_NEAREST_INT);
  for (int j = 0; j < 9; ++j) {
    const int half = center + (j % 2 ? 1 : -1) * ((j + 1) / 2);
    if (half <= 0 || half >= 0x7c00) continue;
    const float d = _cvtsh_ss(static_cast<unsigned short>(half));
    bool exact = true;
    for (int i = 0; i < 32 && exact; ++i) {
      const float integer = std::min(127.0f, std::max(-128.0f, std::nearbyint(v[i] / d)));
      q[i] = static_cast<int8_t>(integer);
      exact = bf16_nearest_even(d * integer) == values[i];
    }
    if (exact) {
      scale = d;
      return true;
    }
  }
  return false;
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

// weight: bf16 [n, k], k % 32 == 0. packed: int8 [ceil(n/16) * 16 * k] in the bf16 packing's order;
// scales: float [ceil(n/16)][k/32][16]. Returns 2 when some block of 32 is not a scale times
// integers rounded to bf16 (the weight did not come from Q8_0), or the CPU lacks AVX512-BF16.
int kvserve_pack_q8_weight(const uint16_t* weight, int64_t n, int k, int8_t* packed, float* scales) {
#if KVSERVE_HAS_BF16_DOT
  if (n <= 0 || k <= 0 || k % 32) return 1;
  const int64_t tiles = (n + kTile - 1) / kTile;
  const int pairs = k / 2, blocks = k / 32;
  int lossless = 1;
#pragma omp parallel for schedule(static) reduction(&& : lossless)
  for (int64_t t = 0; t < tiles; ++t) {
    int8_t* dst = packed + t * static_cast<int64_t>(kTile) * k;
    for (int i = 0; i < kTile; ++i) {
      const int64_t r = t * kTile + i;
      for (int b = 0; b < blocks; ++b) {
        int8_t q[32] = {};
        float scale = 0.0f;
        if (r < n && !q8_of_block(weight + r * k + b * 32, scale, q)) lossless = 0;
        scales[(t * blocks + b) * kTile + i] = scale;
        for (int j = 0; j < 32; ++j) {
          const int p = b * 16 + j / 2;
          dst[(static_cast<int64_t>(p) * kTile + i) * 2 + j % 2] = q[j];
        }
      }
    }
  }
  (void)pairs;
  return lossless ? 0 : 2;
#else
  (void)weight, (void)n, (void)k, (void)packed, (void)scales;
  return 2;
#endif
}

// x: bf16 [rows, k] (row stride ldx). out ([rows, n] in out_dtype) and argmax (int64 [rows]) may
// each be null. A Q8 weight (scales given) gives the bf16 weight's result bit for bit.
int kvserve_packed_matmul(const kvserve::PackedMatmulArgs* a) {
#if KVSERVE_HAS_BF16_DOT
  const uint16_t* packed = static_cast<const uint16_t*>(a->packed);
  const int8_t* q8 = a->scales ? static_cast<const int8_t*>(a->packed) : nullptr;
  const uint16_t* x = a->x;
  void* out = a->out;
  int64_t* argmax = a->argmax;
  const int64_t n = a->n, ldx = a->ldx;
  const int k = a->k, rows = a->rows, out_dtype = a->out_dtype;
  if (n <= 0 || k <= 0 || k % 2 || rows <= 0 || ldx < k || out_dtype < 0 || out_dtype > 2 || (q8 && k % 32)) return 1;
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
    const int64_t tile_stride = static_cast<int64_t>(pairs) * 32;
    if (q8) {
      // eight rows at a time, each value converted in registers once per eight rows: this beats the
      // bf16 weight's memory traffic for a few rows only (the caller keeps them few)
      for (int64_t b = block_begin; b < block_end; ++b) {
        const int64_t first = b * NT;
        const int64_t count = std::min<int64_t>(NT, tiles - first);
        for (int r0 = 0; r0 < rows; r0 += 8) {
          void* oc = out ? static_cast<void*>(static_cast<char*>(out) + static_cast<int64_t>(r0) * n * out_bytes) : nullptr;
          q8_few_rows(std::min(8, rows - r0), q8, a->scales, first, count, n, pairs, x + r0 * ldx, ldx, oc, out_dtype,
                      best_ptr ? best_ptr + r0 : nullptr);
        }
      }
    } else {
      for (int r0 = 0; r0 < rows; r0 += chunk_rows) {
        const int chunk = std::min(chunk_rows, rows - r0);
        const uint16_t* xc = x + r0 * ldx;
        void* oc = out ? static_cast<void*>(static_cast<char*>(out) + static_cast<int64_t>(r0) * n * out_bytes) : nullptr;
        RowBest* bc = best_ptr ? best_ptr + r0 : nullptr;
        for (int64_t b = block_begin; b < block_end; ++b) {
          const int64_t first = b * NT;
          const int64_t count = std::min<int64_t>(NT, tiles - first);
          rows_block_of<NT>(count, packed + first * tile_stride, first, n, pairs, xc, ldx, chunk, oc, out_dtype, bc);
        }
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
