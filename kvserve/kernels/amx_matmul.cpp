// x @ weight^T in bf16 on Intel AMX tiles (TDPBF16PS), on a weight packed once at load time.
//
// Layouts
//   weight (B): packed [ceil(n/16)][ceil(k/32)][16 pairs][16 columns][2] bf16, zero-padded in n
//     and k. Each (column block, k step) is one B tile, 16 rows x 64 bytes, whose row p holds the
//     k-pair (2p, 2p+1) of the block's 16 output columns interleaved (the VNNI layout TDPBF16PS
//     reads); a column block's k steps lie one after the other (1 KiB each).
//   x (A): an A tile is 16 rows x 32 bf16 read straight from x (row stride ldx). The last row
//     block when rows % 16 != 0, and the k tail when k % 32 != 0, are first copied into zeroed
//     staging buffers, so no tile reads past x and padding contributes exact zeros.
//   out (C): a 16 x 16 float32 tile per (row block, column block), stored to a small buffer and
//     written out as float32 or bf16 (round to nearest even) and/or folded into a row-wise argmax
//     (ties to the lowest index).
//
// Invariance: every C tile is zeroed, then accumulates TDPBF16PS over the k steps in increasing
// order, then is stored, whatever the shape. TDPBF16PS computes each element from its own A row
// and B column only, so a row's result does not depend on the row count, on which 16-row tile or
// tile register it lands in, or on how the column blocks are split over threads.
//
// Blocking: up to 2 A tiles x 2 B tiles -> 4 C tiles (tmm0-3 C, tmm4-5 A, tmm6-7 B). Threads
// split the column-block pairs; each walks its pairs once per chunk of rows, so with 1-16 rows
// (decode) every B tile is loaded exactly once and the weight streams through once.

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

#if !defined(KVSERVE_AMX_EMULATE) && KVSERVE_AMX_SUPPORTED
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using namespace kvserve;
using namespace kvserve::amx;

constexpr int kBlock = 16;               // rows per A tile, columns per B tile
constexpr int kStep = 32;                // k per tile step
constexpr int kBTileElems = 16 * 16 * 2; // bf16 per B tile

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

#if !defined(KVSERVE_AMX_EMULATE) && KVSERVE_AMX_SUPPORTED

// CPUID.(7,0):EDX bits 22 (AMX-BF16) and 24 (AMX-TILE), and the OS enabling tile state in XCR0
// (bits 17 XTILECFG, 18 XTILEDATA)
bool cpu_has_amx_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;  // OSXSAVE, so XGETBV exists
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((lo >> 17) & 3) == 3;
}

// Linux hands out tile data state per process on request; without it the first tile instruction
// raises SIGILL. Granted once, it covers every thread.
bool process_has_tile_permission() {
  constexpr long kReqXcompPerm = 0x1023, kGetXcompPerm = 0x1022, kXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) != 0) return false;
  uint64_t granted = 0;
  return syscall(SYS_arch_prctl, kGetXcompPerm, &granted) == 0 && ((granted >> kXtiledata) & 1);
}

bool amx_ready() {
  static const bool ready = cpu_has_amx_bf16() && process_has_tile_permission();
  return ready;
}

#else

bool amx_ready() { return KVSERVE_AMX_SUPPORTED; }

#endif

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

void stage_rows(const uint16_t* x, int64_t ldx, int rows, int k, int steps, StagedRows& s) {
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
  void* out;  // [rows, n] float32 or bf16, or null
  int out_dtype;
  float* best_value;   // this thread's running argmax per row, or null
  int64_t* best_index;
  int64_t n;
};

// one stored C tile: rows row0 .. row0 + valid_rows - 1, columns col0 .. col0 + valid_cols - 1
void emit(const float (&c)[kBlock][kBlock], int64_t row0, int valid_rows, int64_t col0, int valid_cols, const Outputs& o) {
  for (int m = 0; m < valid_rows; ++m) {
    const int64_t row = row0 + m;
    if (o.out && o.out_dtype == kFloat32) {
      std::memcpy(static_cast<float*>(o.out) + row * o.n + col0, c[m], valid_cols * sizeof(float));
    } else if (o.out) {
      uint16_t* dst = static_cast<uint16_t*>(o.out) + row * o.n + col0;
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

template <int MT, int NT>
void block(const StagedRows& staged, int rb, int rows, const uint16_t* packed, int64_t cb, int steps, const Outputs& o) {
  alignas(64) float c[4][kBlock][kBlock];
  tile_product<MT, NT>(&staged.blocks[rb], packed + cb * steps * kBTileElems, steps, c);
  for (int m = 0; m < MT; ++m)
    for (int t = 0; t < NT; ++t) {
      const int64_t row0 = static_cast<int64_t>(rb + m) * kBlock, col0 = (cb + t) * kBlock;
      emit(c[2 * m + t], row0, static_cast<int>(std::min<int64_t>(kBlock, rows - row0)), col0,
           static_cast<int>(std::min<int64_t>(kBlock, o.n - col0)), o);
    }
}

void dispatch(int mt, int nt, const StagedRows& staged, int rb, int rows, const uint16_t* packed, int64_t cb, int steps,
              const Outputs& o) {
  if (mt == 2 && nt == 2) block<2, 2>(staged, rb, rows, packed, cb, steps, o);
  else if (mt == 2) block<2, 1>(staged, rb, rows, packed, cb, steps, o);
  else if (nt == 2) block<1, 2>(staged, rb, rows, packed, cb, steps, o);
  else block<1, 1>(staged, rb, rows, packed, cb, steps, o);
}

// this thread's column-block pairs [pair_begin, pair_end) against every row block; rows go in
// chunks that stay in L2 while the chunk's B tiles stream past
KVSERVE_AMX_TARGET void thread_part(const StagedRows& staged, int rows, int k, const uint16_t* packed, int64_t blocks, int steps,
                                    int64_t pair_begin, int64_t pair_end, const Outputs& o) {
  const TileConfig config = full_tiles();
  KVSERVE_TILE_LOADCONFIG(&config);
  const int row_blocks = static_cast<int>(staged.blocks.size());
  const int chunk = std::max(2, static_cast<int>((256 << 10) / (static_cast<int64_t>(k) * 2 * kBlock)) / 2 * 2);
  for (int r0 = 0; r0 < row_blocks; r0 += chunk) {
    const int r1 = std::min(row_blocks, r0 + chunk);
    for (int64_t pair = pair_begin; pair < pair_end; ++pair) {
      const int64_t cb = 2 * pair;
      const int nt = static_cast<int>(std::min<int64_t>(2, blocks - cb));
      for (int rb = r0; rb < r1; rb += 2) dispatch(std::min(2, r1 - rb), nt, staged, rb, rows, packed, cb, steps, o);
    }
  }
  KVSERVE_TILE_RELEASE();
}

#endif  // KVSERVE_AMX_SUPPORTED

}  // namespace

extern "C" {

// 1 when this library was built with AMX tile code (or its emulation)
int kvserve_amx_compiled() { return KVSERVE_AMX_SUPPORTED; }

// 1 when tile instructions can run here: the CPU has AMX-BF16, the OS enabled tile state and
// granted this process tile data (requested once, here). The emulated build: always 1.
int kvserve_amx_available() { return amx_ready() ? 1 : 0; }

// weight: bf16 [n, k], row stride k. packed: bf16 [ceil(n/16)][ceil(k/32)][16][16][2] (see above).
// Plain C++: runs on any CPU.
int kvserve_amx_pack_weight(const uint16_t* weight, int64_t n, int k, uint16_t* packed) {
  if (n <= 0 || k <= 0) return 1;
  const int64_t blocks = ceil_div(n, kBlock);
  const int steps = static_cast<int>(ceil_div(k, kStep));
#pragma omp parallel for schedule(static)
  for (int64_t cb = 0; cb < blocks; ++cb)
    for (int s = 0; s < steps; ++s) {
      uint16_t* tile = packed + (cb * steps + s) * kBTileElems;
      for (int p = 0; p < kStep / 2; ++p)
        for (int col = 0; col < kBlock; ++col)
          for (int h = 0; h < 2; ++h) {
            const int64_t row = cb * kBlock + col;
            const int kk = s * kStep + 2 * p + h;
            tile[(p * kBlock + col) * 2 + h] = row < n && kk < k ? weight[row * k + kk] : 0;
          }
    }
  return 0;
}

// x: bf16 [rows, k] (row stride ldx). out ([rows, n], out_dtype 0 float32 or 1 bf16) and argmax
// (int64 [rows]) may each be null. Returns 2 where tile instructions cannot run.
int kvserve_amx_matmul(const kvserve::AmxMatmulArgs* a) {
  if (a->n <= 0 || a->k <= 0 || a->rows <= 0 || a->ldx < a->k || a->out_dtype < 0 || a->out_dtype > 1) return 1;
  if (!amx_ready()) return 2;
#if KVSERVE_AMX_SUPPORTED
  const int rows = a->rows, k = a->k, steps = static_cast<int>(ceil_div(k, kStep));
  const int64_t n = a->n, blocks = ceil_div(n, kBlock), pairs = ceil_div(blocks, 2);
  StagedRows staged;
  stage_rows(a->x, a->ldx, rows, k, steps, staged);
  std::vector<float> merged_value(a->argmax ? rows : 0, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> merged_index(a->argmax ? rows : 0, -1);
#pragma omp parallel
  {
    const int threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t begin = pairs * me / threads, end = pairs * (me + 1) / threads;
    std::vector<float> best_value(a->argmax ? rows : 0, -std::numeric_limits<float>::infinity());
    std::vector<int64_t> best_index(a->argmax ? rows : 0, -1);
    const Outputs o{a->out, a->out_dtype, a->argmax ? best_value.data() : nullptr, a->argmax ? best_index.data() : nullptr, n};
    if (begin < end) thread_part(staged, rows, k, a->packed, blocks, steps, begin, end, o);
    if (a->argmax) {
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
  for (int r = 0; a->argmax && r < rows; ++r) a->argmax[r] = merged_index[r] < 0 ? 0 : merged_index[r];
  return 0;
#else
  return 2;
#endif
}

}  // extern "C"
