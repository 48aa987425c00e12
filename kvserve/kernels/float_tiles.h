// The register-blocked float32 product shared by float_matmul.cpp (a packed float32/bf16
// weight) and gguf_matmul.cpp (GGUF blocks dequantized into the same tile layout): 16-output
// tiles, k-major inside a tile ([tiles][k][16]), one float32 FMA chain per output in k order.
// See float_matmul.cpp for why a row's result does not depend on its batch.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include <omp.h>

#include "simd.h"

namespace {

using namespace kvserve;

constexpr int kTile = 16;  // output rows per packed tile (one f32x16)

#if defined(__AVX512F__)
// 24 accumulators, 3 weight vectors and a broadcast fit the 32 zmm registers
constexpr int kMaxRows = 8;
constexpr int kTiles = 3;
#else
// a tile is two ymm registers (micro_kernel's AVX2 form): 12 accumulators, a tile's two weight
// vectors and a broadcast fit the 16 ymm registers
constexpr int kMaxRows = 6;
constexpr int kTiles = 1;
#endif

// c + a * b per lane, rounded once
inline f32x16 fma16(f32x16 a, f32x16 b, f32x16 c) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  typedef float f32x8 __attribute__((vector_size(32)));
  const f32x8 lo = (f32x8)_mm256_fmadd_ps((__m256)__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
                                          (__m256)__builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
                                          (__m256)__builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
  const f32x8 hi = (f32x8)_mm256_fmadd_ps((__m256)__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
                                          (__m256)__builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
                                          (__m256)__builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  for (int i = 0; i < kTile; ++i) c[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return c;
#endif
}

inline f32x16 broadcast16(float v) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_set1_ps(v);
#else
  return f32x16{v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v};
#endif
}

// 16 packed weights as float (bf16: the bits shifted up by 16, exact)
template <int DT>
inline f32x16 load_weight(const void* packed, int64_t offset) {
#if defined(__AVX512F__)
  if constexpr (DT == kBFloat16) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(packed) + offset));
    return (f32x16)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
#endif
  return load16<DT>(packed, offset);
}

struct RowBest {
  f32x16 value;
  i32x16 index;
};

// the packed weight, its element type, and what a product writes
struct Problem {
  const void* packed;
  int weight_dtype;
  int64_t n;
  int k;
  const float* x;  // float rows, row stride ldx
  int64_t ldx;
  void* out;       // [rows, ldo] in out_dtype (columns 0..n-1 written), or null
  int out_dtype;
  int64_t ldo;
};

#if !defined(__AVX512F__) && defined(__FMA__)
// AVX2: the same FMA per output and step as below, on explicit ymm halves of each tile. gcc keeps
// 64-byte generic vectors in memory on a 256-bit machine (every FMA a store and two loads): this
// form ran 20-50x faster on a Zen 3 EPYC.
template <int DT>
inline void load_weight_halves(const void* packed, int64_t offset, __m256& lo, __m256& hi) {
  if constexpr (DT == kBFloat16) {
    const uint16_t* w = static_cast<const uint16_t*>(packed) + offset;
    const __m256i half_lo = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m256i half_hi = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8)));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(half_lo, 16));
    hi = _mm256_castsi256_ps(_mm256_slli_epi32(half_hi, 16));
  } else {
    const float* w = static_cast<const float*>(packed) + offset;
    lo = _mm256_loadu_ps(w);
    hi = _mm256_loadu_ps(w + 8);
  }
}

template <int DT, int MR, int NT>
inline void micro_kernel(const void* packed, int64_t first, int k, const float* x, int64_t ldx, f32x16 (&acc)[MR][NT]) {
  const int64_t tile_stride = static_cast<int64_t>(k) * kTile;
  __m256 lo[MR][NT], hi[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) lo[m][t] = hi[m][t] = _mm256_setzero_ps();
  for (int kk = 0; kk < k; ++kk) {
    __m256 w_lo[NT], w_hi[NT];
    for (int t = 0; t < NT; ++t)
      load_weight_halves<DT>(packed, (first + t) * tile_stride + static_cast<int64_t>(kk) * kTile, w_lo[t], w_hi[t]);
    for (int m = 0; m < MR; ++m) {
      const __m256 a = _mm256_broadcast_ss(x + m * ldx + kk);
      for (int t = 0; t < NT; ++t) {
        lo[m][t] = _mm256_fmadd_ps(a, w_lo[t], lo[m][t]);
        hi[m][t] = _mm256_fmadd_ps(a, w_hi[t], hi[m][t]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) {
      float lanes[kTile];
      _mm256_storeu_ps(lanes, lo[m][t]);
      _mm256_storeu_ps(lanes + 8, hi[m][t]);
      std::memcpy(&acc[m][t], lanes, sizeof(lanes));
    }
}
#else
template <int DT, int MR, int NT>
inline void micro_kernel(const void* packed, int64_t first, int k, const float* x, int64_t ldx, f32x16 (&acc)[MR][NT]) {
  const int64_t tile_stride = static_cast<int64_t>(k) * kTile;
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = f32x16{};
  for (int kk = 0; kk < k; ++kk) {
    f32x16 w[NT];
    for (int t = 0; t < NT; ++t) w[t] = load_weight<DT>(packed, (first + t) * tile_stride + static_cast<int64_t>(kk) * kTile);
    for (int m = 0; m < MR; ++m) {
      const f32x16 a = broadcast16(x[m * ldx + kk]);
      for (int t = 0; t < NT; ++t) acc[m][t] = fma16(a, w[t], acc[m][t]);
    }
  }
}
#endif

inline void store_tile(void* out, int out_dtype, int64_t offset, f32x16 values, int valid) {
  if (out_dtype == kFloat32) {
    std::memcpy(static_cast<float*>(out) + offset, &values, valid * sizeof(float));
  } else if (out_dtype == kBFloat16) {
    u32x16 bits;
    std::memcpy(&bits, &values, sizeof(bits));
    // round to nearest even like torch (and bf16_bits); NaN stays NaN
    u32x16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    rounded = (bits & 0x7fffffffu) > 0x7f800000u ? u32x16{} + 0x7fc0u : rounded;
    const u16x16 half = __builtin_convertvector(rounded, u16x16);
    std::memcpy(static_cast<uint16_t*>(out) + offset, &half, valid * sizeof(uint16_t));
  } else {
    const f16x16 half = __builtin_convertvector(values, f16x16);
    std::memcpy(static_cast<_Float16*>(out) + offset, &half, valid * sizeof(_Float16));
  }
}

// one row's accumulator for output tile `tile` into out (row `row`, ldo apart) and/or its best
inline void emit(const Problem& p, int64_t tile, int row, const f32x16& acc, void* out, RowBest* best) {
  const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int64_t column = tile * kTile;
  const int valid = static_cast<int>(std::min<int64_t>(kTile, p.n - column));
  if (out) store_tile(out, p.out_dtype, static_cast<int64_t>(row) * p.ldo + column, acc, valid);
  if (best) {
    RowBest& b = best[row];
    const i32x16 better = (acc > b.value) & (lane < valid);
    b.value = better ? acc : b.value;
    b.index = better ? lane + static_cast<int32_t>(column) : b.index;
  }
}

// one block of NT tiles (outputs from tile `first`, weights from tile `packed_first` of
// p.packed) against MR rows from `row`
template <int DT, int MR, int NT>
void block(const Problem& p, int64_t packed_first, int64_t first, const float* x, int row, void* out, RowBest* best) {
  f32x16 acc[MR][NT];
  micro_kernel<DT, MR, NT>(p.packed, packed_first, p.k, x + row * p.ldx, p.ldx, acc);
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MR; ++m) emit(p, first + t, row + m, acc[m][t], out, best);
}

// the last rows - row (< MR) rows of a chunk: the largest block that fits, then smaller ones
template <int DT, int MR, int NT>
void remainder(const Problem& p, int64_t packed_first, int64_t first, const float* x, int row, int rows, void* out, RowBest* best) {
  if constexpr (MR > 0) {
    if (rows - row >= MR) {
      block<DT, MR, NT>(p, packed_first, first, x, row, out, best);
      row += MR;
    }
    remainder<DT, MR - 1, NT>(p, packed_first, first, x, row, rows, out, best);
  }
}

template <int DT, int NT>
void rows_block(const Problem& p, int64_t packed_first, int64_t first, const float* x, int rows, void* out, RowBest* best) {
  int row = 0;
  for (; row + kMaxRows <= rows; row += kMaxRows) block<DT, kMaxRows, NT>(p, packed_first, first, x, row, out, best);
  remainder<DT, kMaxRows - 1, NT>(p, packed_first, first, x, row, rows, out, best);
}

template <int DT>
void tiles_block(const Problem& p, int64_t packed_first, int64_t first, int64_t count, const float* x, int rows, void* out, RowBest* best) {
  if constexpr (kTiles >= 3) {
    if (count >= 3) return rows_block<DT, 3>(p, packed_first, first, x, rows, out, best);
  }
  if constexpr (kTiles >= 2) {
    if (count == 2) return rows_block<DT, 2>(p, packed_first, first, x, rows, out, best);
  }
  rows_block<DT, 1>(p, packed_first, first, x, rows, out, best);
}

// best[] (one per row, 16 lanes) folded into merged_value / merged_index, lowest index on ties
void merge_best(const std::vector<RowBest>& best, std::vector<float>& merged_value, std::vector<int64_t>& merged_index) {
  for (size_t r = 0; r < best.size(); ++r) {
    float top = -std::numeric_limits<float>::infinity();
    int64_t at = -1;
    for (int i = 0; i < kTile; ++i) {
      const float value = best[r].value[i];
      const int64_t index = best[r].index[i];
      if (index >= 0 && (at < 0 || value > top || (value == top && index < at))) {
        top = value;
        at = index;
      }
    }
#pragma omp critical
    if (at >= 0 && (merged_index[r] < 0 || top > merged_value[r] || (top == merged_value[r] && at < merged_index[r]))) {
      merged_value[r] = top;
      merged_index[r] = at;
    }
  }
}

// The walk both products share: each thread takes a contiguous range of weight blocks (kTiles
// tiles) and walks it once per chunk of rows small enough to stay in L2, instead of streaming all
// of x again for every block. make_tiles() runs once per thread and returns a callable that, for a
// block (first tile, tile count), gives the packed weight to read and the tile index in it:
// float_matmul's packed weight itself, or the tiles gguf_matmul has just decoded.
template <int DT, typename MakeTiles>
void run_chunked(const Problem& p, int rows, int64_t* argmax, MakeTiles make_tiles) {
  const int64_t tiles = (p.n + kTile - 1) / kTile;
  const int64_t blocks = (tiles + kTiles - 1) / kTiles;
  std::vector<float> merged_value(rows, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> merged_index(rows, -1);
#pragma omp parallel
  {
    std::vector<RowBest> best;
    if (argmax) best.assign(rows, RowBest{f32x16{} - std::numeric_limits<float>::infinity(), i32x16{} - 1});
    auto tiles_for = make_tiles();
    Problem q = p;
    const int threads = omp_get_num_threads();
    const int me = omp_get_thread_num();
    const int64_t block_begin = blocks * me / threads;
    const int64_t block_end = blocks * (me + 1) / threads;
    const int chunk_rows = std::max(kMaxRows, static_cast<int>((256 << 10) / (static_cast<int64_t>(p.k) * 4)) / kMaxRows * kMaxRows);
    const int64_t out_bytes = p.out_dtype == kFloat32 ? 4 : 2;
    for (int r0 = 0; r0 < rows; r0 += chunk_rows) {
      const int chunk = std::min(chunk_rows, rows - r0);
      const float* xc = p.x + r0 * p.ldx;
      void* oc = p.out ? static_cast<void*>(static_cast<char*>(p.out) + static_cast<int64_t>(r0) * p.ldo * out_bytes) : nullptr;
      RowBest* bc = argmax ? best.data() + r0 : nullptr;
      for (int64_t b = block_begin; b < block_end; ++b) {
        const int64_t first = b * kTiles;
        const int64_t count = std::min<int64_t>(kTiles, tiles - first);
        const std::pair<const void*, int64_t> packed = tiles_for(first, count);
        q.packed = packed.first;
        tiles_block<DT>(q, packed.second, first, count, xc, chunk, oc, bc);
      }
    }
    if (argmax) merge_best(best, merged_value, merged_index);
  }
  if (argmax)
    for (int r = 0; r < rows; ++r) argmax[r] = merged_index[r] < 0 ? 0 : merged_index[r];
}

}  // namespace
