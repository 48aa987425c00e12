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

#include "amx_core.h"
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
using amx_core::ceil_div;
using amx_core::kBlock;
using amx_core::kBTileElems;
using amx_core::kStep;

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

using namespace amx_core;

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
  run_pairs(pairs, rows, a->out, a->out_dtype, n, n, a->argmax, [&](int64_t begin, int64_t end, const Outputs& o) {
    // rows in chunks of 256 KiB of x while the chunk's B tiles stream past
    walk_pairs(staged, rows, k, blocks, begin, end, 256 << 10, o,
               [&](int64_t cb, int) { return a->packed + cb * steps * kBTileElems; });
  });
  return 0;
#else
  return 2;
#endif
}

}  // extern "C"
