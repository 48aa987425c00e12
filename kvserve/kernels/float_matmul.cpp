// x @ weight^T in float32 arithmetic, on a float32 or bf16 weight packed once at load time, with
// results that do not depend on the batch.
//
// Layout: tiles of 16 output rows, k-major inside a tile ([n/16][k][16], rows past n zero), in the
// weight's own dtype (bf16 is widened to float in registers by a 16-bit shift). One 16-float
// load at step kk feeds 16 outputs, and x[row][kk] is a broadcast.
//
// Invariance: every output element has exactly one float32 accumulator, started at 0 and updated
// by a fused multiply-add acc = fma(x[kk], w[kk], acc) for kk = 0, 1, ..., k-1, in that order.
// Each FMA rounds once, so the value depends only on that row of x and that row of the weight:
// not on how many rows ride along, how rows and tiles are blocked into registers, how threads
// split the tiles, or whether a vector is one AVX-512 register or two AVX2 ones. The FMAs are
// intrinsics (fma16), never a multiply and an add the compiler may or may not contract.
//
// A register block of MR rows by NT tiles keeps MR*NT accumulators. Outputs go to a
// float32/bf16/fp16 matrix (rounded to nearest even, like torch) and/or a running argmax per row
// (ties to the lowest index, like torch.argmax; padded rows never win).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

#include "args.h"
#include "float_tiles.h"

namespace {

template <int DT>
void run(const Problem& p, int rows, int64_t* argmax) {
  run_chunked<DT>(p, rows, argmax, [&p] {
    return [&p](int64_t first, int64_t) { return std::pair<const void*, int64_t>{p.packed, first}; };
  });
}

}  // namespace

extern "C" {

// weight: float32 or bf16 [n, k] (row stride k). packed: the same dtype, [ceil(n/16)][k][16], zero-padded.
int kvserve_pack_float_weight(const void* weight, int weight_dtype, int64_t n, int k, void* packed) {
  if (n <= 0 || k <= 0 || (weight_dtype != kFloat32 && weight_dtype != kBFloat16)) return 1;
  const int64_t tiles = (n + kTile - 1) / kTile;
  const size_t bytes = weight_dtype == kFloat32 ? 4 : 2;
  const char* src = static_cast<const char*>(weight);
  char* dst = static_cast<char*>(packed);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t)
    for (int kk = 0; kk < k; ++kk)
      for (int i = 0; i < kTile; ++i) {
        const int64_t r = t * kTile + i;
        char* to = dst + ((t * k + kk) * kTile + i) * bytes;
        if (r < n) std::memcpy(to, src + (r * k + kk) * bytes, bytes);
        else std::memset(to, 0, bytes);
      }
  return 0;
}

// x: float32 or bf16 [rows, k] (row stride ldx). out ([rows, n] in out_dtype) and argmax (int64
// [rows]) may each be null.
int kvserve_float_matmul(const kvserve::FloatMatmulArgs* a) {
  const int64_t n = a->n, ldx = a->ldx;
  const int k = a->k, rows = a->rows;
  const bool float_dtypes = (a->weight_dtype == kFloat32 || a->weight_dtype == kBFloat16) && (a->x_dtype == kFloat32 || a->x_dtype == kBFloat16);
  if (n <= 0 || k <= 0 || rows <= 0 || ldx < k || !float_dtypes || a->out_dtype < 0 || a->out_dtype > 2) return 1;
  Problem p{a->packed, a->weight_dtype, n, k, static_cast<const float*>(a->x), ldx, a->out, a->out_dtype, n};
  std::vector<float> widened;
  if (a->x_dtype == kBFloat16) {
    // bf16 -> float is exact: widen once, so the kernel broadcasts floats either way
    widened.resize(static_cast<size_t>(rows) * k);
    const uint16_t* x = static_cast<const uint16_t*>(a->x);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; ++r)
      for (int kk = 0; kk < k; ++kk) widened[static_cast<size_t>(r) * k + kk] = Elem<kBFloat16>::load(x[r * ldx + kk]);
    p.x = widened.data();
    p.ldx = k;
  }
  if (p.weight_dtype == kFloat32) run<kFloat32>(p, rows, a->argmax);
  else run<kBFloat16>(p, rows, a->argmax);
  return 0;
}

}  // extern "C"
