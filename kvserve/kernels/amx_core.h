// The AMX bf16 product's core, shared by amx_matmul.cpp (B tiles packed once at load) and
// gguf_amx.h (B tiles dequantized from GGUF blocks per call): x's row blocks staged as A tiles,
// one (row blocks x column blocks) step of up to 2 x 2 C tiles over the k steps in increasing
// order, the C tiles written out, and the threads' split of the column-block pairs.
//
// B tiles: a column block's k steps one after the other, each 16 k-pairs x 16 columns x 2 bf16
// (the VNNI layout TDPBF16PS reads, 1 KiB); a pair's second column block follows its first.
// Every C tile is zeroed, accumulates its k steps in order and is stored, whatever the shape, so
// a row's result depends only on its own row and the B tiles' values: two callers that hand the
// same B tile values get the same bits.
//
// Inline definitions in namespace amx_core: amx_matmul.cpp and gguf_matmul.cpp include it at file scope.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <immintrin.h>
#include <omp.h>

#include "amx_tiles.h"
#include "args.h"
#include "simd.h"

namespace amx_core {

using namespace kvserve;
using namespace kvserve::amx;

constexpr int kBlock = 16;               // rows per A tile, columns per B tile
constexpr int kStep = 32;                // k per tile step
constexpr int kBTileElems = 16 * 16 * 2; // bf16 per B tile

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

#if KVSERVE_AMX_SUPPORTED

// Where one 16-row block of x is read from: step s < direct_steps from x + 32 s (row stride
// `stride` bytes); the k tail step from `tail` (16 x 32, 64-byte rows).
struct RowBlock {
  const uint16_t* x;
  int64_t stride;
  int direct_steps;
  const uint16_t* tail;
};

struct ASource {
  const void* base;
  int64_t stride;
};

inline ASource a_tile(const RowBlock& block, int step) {
  if (step < block.direct_steps) return {block.x + static_cast<int64_t>(step) * kStep, block.stride};
  return {block.tail, kTileBytes};
}

// x's row blocks, with the zero-padded copies they need: the last partial block whole, and the
// k tail of every full block
struct StagedRows {
  std::vector<RowBlock> blocks;
  std::vector<uint16_t> tails;  // [full blocks][16][32]
  std::vector<uint16_t> last;   // [16][steps * 32]
};

inline void stage_rows(const uint16_t* x, int64_t ldx, int rows, int k, int steps, StagedRows& s) {
  const int full = rows / kBlock, partial = rows % kBlock, direct = k / kStep, tail = k % kStep;
  s.blocks.resize(ceil_div(rows, kBlock));
  if (tail) s.tails.assign(static_cast<size_t>(full) * kBlock * kStep, 0);
  for (int b = 0; b < full; ++b) {
    uint16_t* staged = tail ? s.tails.data() + static_cast<int64_t>(b) * kBlock * kStep : nullptr;
    for (int r = 0; tail && r < kBlock; ++r)
      std::memcpy(staged + r * kStep, x + (static_cast<int64_t>(b) * kBlock + r) * ldx + direct * kStep, tail * 2);
    s.blocks[b] = {x + static_cast<int64_t>(b) * kBlock * ldx, ldx * 2, direct, staged};
  }
  if (partial) {
    const int64_t width = static_cast<int64_t>(steps) * kStep;
    s.last.assign(kBlock * width, 0);
    for (int r = 0; r < partial; ++r)
      std::memcpy(s.last.data() + r * width, x + (static_cast<int64_t>(full) * kBlock + r) * ldx, static_cast<size_t>(k) * 2);
    s.blocks[full] = {s.last.data(), width * 2, steps, nullptr};
  }
}

// C tile (m, t) is tmm(2m + t), A tile m tmm(4 + m), B tile t tmm(6 + t); c receives them
template <int MT, int NT>
KVSERVE_AMX_TARGET void tile_product(const RowBlock* rows, const uint16_t* b0, int steps, float (*c)[kBlock][kBlock]) {
  const uint16_t* b1 = b0 + static_cast<int64_t>(steps) * kBTileElems;
  KVSERVE_TILE_ZERO(0);
  if (NT == 2) KVSERVE_TILE_ZERO(1);
  if (MT == 2) KVSERVE_TILE_ZERO(2);
  if (MT == 2 && NT == 2) KVSERVE_TILE_ZERO(3);
  // tiles are not renamed: each load waits for the products that read its register, so loads and
  // products interleave (a product issues as soon as its two operands are in)
  for (int s = 0; s < steps; ++s) {
    const ASource a0 = a_tile(rows[0], s);
    KVSERVE_TILE_LOADD(4, a0.base, a0.stride);
    KVSERVE_TILE_LOADD(6, b0 + static_cast<int64_t>(s) * kBTileElems, kTileBytes);
    KVSERVE_TILE_DPBF16PS(0, 4, 6);
    if (NT == 2) {
      KVSERVE_TILE_LOADD(7, b1 + static_cast<int64_t>(s) * kBTileElems, kTileBytes);
      KVSERVE_TILE_DPBF16PS(1, 4, 7);
    }
    if (MT == 2) {
      const ASource a1 = a_tile(rows[1], s);
      KVSERVE_TILE_LOADD(5, a1.base, a1.stride);
      KVSERVE_TILE_DPBF16PS(2, 5, 6);
      if (NT == 2) KVSERVE_TILE_DPBF16PS(3, 5, 7);
    }
  }
  KVSERVE_TILE_STORED(0, c[0], kTileBytes);
  if (NT == 2) KVSERVE_TILE_STORED(1, c[1], kTileBytes);
  if (MT == 2) KVSERVE_TILE_STORED(2, c[2], kTileBytes);
  if (MT == 2 && NT == 2) KVSERVE_TILE_STORED(3, c[3], kTileBytes);
}

// round to nearest even like torch and packed_matmul's store_tile; NaN stays NaN
inline uint16_t to_bf16(float value) {
  if (value != value) return 0x7fc0;
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// to_bf16 on 16 lanes, the same bits (integer rounding, not VCVTNEPS2BF16, which flushes denormals)
inline __m256i to_bf16x16(__m512 value) {
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0)));
}
#endif

struct Outputs {
  void* out;  // [rows, ldo] float32 or bf16 (columns 0..n-1 written), or null
  int out_dtype;
  float* best_value;   // this thread's running argmax per row, or null
  int64_t* best_index;
  int64_t n;
  int64_t ldo;
};

// one stored C tile: rows row0 .. row0 + valid_rows - 1, columns col0 .. col0 + valid_cols - 1
inline void emit(const float (&c)[kBlock][kBlock], int64_t row0, int valid_rows, int64_t col0, int valid_cols, const Outputs& o) {
  for (int m = 0; m < valid_rows; ++m) {
    const int64_t row = row0 + m;
    if (o.out && o.out_dtype == kFloat32) {
      std::memcpy(static_cast<float*>(o.out) + row * o.ldo + col0, c[m], valid_cols * sizeof(float));
    } else if (o.out) {
      uint16_t* dst = static_cast<uint16_t*>(o.out) + row * o.ldo + col0;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
      _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << valid_cols) - 1), to_bf16x16(_mm512_loadu_ps(c[m])));
#else
      for (int j = 0; j < valid_cols; ++j) dst[j] = to_bf16(c[m][j]);
#endif
    }
    if (o.best_value) {
      for (int j = 0; j < valid_cols; ++j)
        if (c[m][j] > o.best_value[row]) {  // columns arrive in increasing order: ties keep the first
          o.best_value[row] = c[m][j];
          o.best_index[row] = col0 + j;
        }
    }
  }
}

// row blocks rb (and rb + 1 when MT == 2) against column block cb (and cb + 1 when NT == 2),
// whose B tiles start at b
template <int MT, int NT>
void block(const StagedRows& staged, int rb, int rows, const uint16_t* b, int64_t cb, int steps, const Outputs& o) {
  alignas(64) float c[4][kBlock][kBlock];
  tile_product<MT, NT>(&staged.blocks[rb], b, steps, c);
  for (int m = 0; m < MT; ++m)
    for (int t = 0; t < NT; ++t) {
      const int64_t row0 = static_cast<int64_t>(rb + m) * kBlock, col0 = (cb + t) * kBlock;
      emit(c[2 * m + t], row0, static_cast<int>(std::min<int64_t>(kBlock, rows - row0)), col0,
           static_cast<int>(std::min<int64_t>(kBlock, o.n - col0)), o);
    }
}

inline void dispatch(int mt, int nt, const StagedRows& staged, int rb, int rows, const uint16_t* b, int64_t cb, int steps,
                     const Outputs& o) {
  if (mt == 2 && nt == 2) block<2, 2>(staged, rb, rows, b, cb, steps, o);
  else if (mt == 2) block<2, 1>(staged, rb, rows, b, cb, steps, o);
  else if (nt == 2) block<1, 2>(staged, rb, rows, b, cb, steps, o);
  else block<1, 1>(staged, rb, rows, b, cb, steps, o);
}

// This thread's column-block pairs [pair_begin, pair_end) of a weight with `blocks` column blocks
// against every row block, a chunk of rows (up to chunk_bytes of x, kept in L2) at a time:
// b_tiles(cb, nt) gives the B tiles of column blocks cb .. cb + nt - 1 (called once per chunk and pair).
template <typename BTiles>
KVSERVE_AMX_TARGET void walk_pairs(const StagedRows& staged, int rows, int k, int64_t blocks, int64_t pair_begin, int64_t pair_end,
                                   int64_t chunk_bytes, const Outputs& o, BTiles&& b_tiles) {
  const int steps = static_cast<int>(ceil_div(k, kStep));
  const TileConfig config = full_tiles();
  KVSERVE_TILE_LOADCONFIG(&config);
  const int row_blocks = static_cast<int>(staged.blocks.size());
  const int chunk = std::max(2, static_cast<int>(chunk_bytes / (static_cast<int64_t>(k) * 2 * kBlock)) / 2 * 2);
  for (int r0 = 0; r0 < row_blocks; r0 += chunk) {
    const int r1 = std::min(row_blocks, r0 + chunk);
    for (int64_t pair = pair_begin; pair < pair_end; ++pair) {
      const int64_t cb = 2 * pair;
      const int nt = static_cast<int>(std::min<int64_t>(2, blocks - cb));
      const uint16_t* b = b_tiles(cb, nt);
      for (int rb = r0; rb < r1; rb += 2) dispatch(std::min(2, r1 - rb), nt, staged, rb, rows, b, cb, steps, o);
    }
  }
  KVSERVE_TILE_RELEASE();
}

// Splits `pairs` column-block pairs over the threads: each runs part(begin, end, outputs) on its
// share with its own running argmax, merged into argmax (int64 [rows], nullable; ties to the
// lowest index) at the end.
template <typename Part>
void run_pairs(int64_t pairs, int rows, void* out, int out_dtype, int64_t n, int64_t ldo, int64_t* argmax, Part&& part) {
  std::vector<float> merged_value(argmax ? rows : 0, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> merged_index(argmax ? rows : 0, -1);
#pragma omp parallel
  {
    const int threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t begin = pairs * me / threads, end = pairs * (me + 1) / threads;
    std::vector<float> best_value(argmax ? rows : 0, -std::numeric_limits<float>::infinity());
    std::vector<int64_t> best_index(argmax ? rows : 0, -1);
    const Outputs o{out, out_dtype, argmax ? best_value.data() : nullptr, argmax ? best_index.data() : nullptr, n, ldo};
    if (begin < end) part(begin, end, o);
    if (argmax) {
#pragma omp critical
      for (int r = 0; r < rows; ++r) {
        if (best_index[r] >= 0 && (merged_index[r] < 0 || best_value[r] > merged_value[r] ||
                                   (best_value[r] == merged_value[r] && best_index[r] < merged_index[r]))) {
          merged_value[r] = best_value[r];
          merged_index[r] = best_index[r];
        }
      }
    }
  }
  for (int r = 0; argmax && r < rows; ++r) argmax[r] = merged_index[r] < 0 ? 0 : merged_index[r];
}

#endif  // KVSERVE_AMX_SUPPORTED

}  // namespace amx_core
