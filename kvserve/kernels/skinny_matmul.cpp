// x @ weight^T for a few rows of x (1 to 16): the decode-time products of a small batch.
//
// With a handful of rows a linear layer or the lm_head is a matrix-vector product, bound by
// reading the weight once; oneDNN streams bf16 weights from DRAM at a fraction of the bandwidth
// here. Each thread streams its share of the weight rows once and dots them with every row of x
// (kept in float, in cache). The output is written in float32 or bf16, and/or reduced to a
// running maximum per row, so greedy decoding never materializes the logits. Ties in the argmax
// go to the lowest index, like torch.argmax.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "args.h"
#include "simd.h"

namespace {

using namespace kvserve;

struct Best {
  float value = -std::numeric_limits<float>::infinity();
  int64_t index = -1;
};

inline void offer(Best& best, float value, int64_t index) {
  // strictly greater keeps the first index among equals; NaN never wins, as in a max over finite logits
  if (value > best.value || best.index < 0) {
    best.value = value;
    best.index = index;
  }
}

template <int R, int DT>
void skinny_rows(const void* weight, const float* hidden, int rows, int64_t vocab, int dim, void* logits, int out_dtype,
                 int64_t* argmax) {
  const int chunks = dim / 16;
  constexpr int64_t kSlice = 64;  // weight rows per task
  const int64_t slices = (vocab + kSlice - 1) / kSlice;
  std::vector<Best> merged(rows);
#pragma omp parallel
  {
    Best local[R];
#pragma omp for schedule(static)
    for (int64_t slice = 0; slice < slices; ++slice) {
      const int64_t end = std::min(vocab, (slice + 1) * kSlice);
      // with few x rows, split each row's sum over P interleaved accumulators so the FMAs do
      // not wait on their own latency
      constexpr int P = R >= 4 ? 1 : 4 / R;
      int64_t v = slice * kSlice;
      if (P > 1 && chunks % P == 0) {
        for (; v < end; ++v) {
          f32x16 acc[P][R];
          for (int p = 0; p < P; ++p)
            for (int r = 0; r < R; ++r) acc[p][r] = f32x16{};
          const int64_t offset = v * dim;
          for (int c = 0; c < chunks; c += P) {
            for (int p = 0; p < P; ++p) {
              const f32x16 w = load16<DT>(weight, offset + (c + p) * 16);
              for (int r = 0; r < R; ++r) {
                f32x16 h;
                std::memcpy(&h, hidden + static_cast<size_t>(r) * dim + (c + p) * 16, sizeof(h));
                acc[p][r] += w * h;
              }
            }
          }
          for (int r = 0; r < rows; ++r) {
            f32x16 total = acc[0][r];
            for (int p = 1; p < P; ++p) total += acc[p][r];
            const float value = hsum(total);
            if (logits) store_element(logits, out_dtype, r * vocab + v, value);
            if (argmax) offer(local[r], value, v);
          }
        }
      }
      for (; v < end; ++v) {
        f32x16 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = f32x16{};
        for (int c = 0; c < chunks; ++c) {
          const f32x16 w = load16<DT>(weight, v * dim + c * 16);
          for (int r = 0; r < R; ++r) {
            f32x16 h;
            std::memcpy(&h, hidden + static_cast<size_t>(r) * dim + c * 16, sizeof(h));
            acc[r] += w * h;
          }
        }
        for (int r = 0; r < rows; ++r) {
          const float value = hsum(acc[r]);
          if (logits) store_element(logits, out_dtype, r * vocab + v, value);
          if (argmax) offer(local[r], value, v);
        }
      }
    }
    if (argmax) {
#pragma omp critical
      for (int r = 0; r < rows; ++r) {
        if (local[r].index < 0) continue;
        const bool better = merged[r].index < 0 || local[r].value > merged[r].value ||
                            (local[r].value == merged[r].value && local[r].index < merged[r].index);
        if (better) merged[r] = local[r];
      }
    }
  }
  if (argmax)
    for (int r = 0; r < rows; ++r) argmax[r] = merged[r].index;
}

template <int R>
int dispatch_dtype(int dtype, const void* weight, const float* hidden, int rows, int64_t vocab, int dim, void* logits,
                   int out_dtype, int64_t* argmax) {
  switch (dtype) {
    case kFloat32:
      skinny_rows<R, kFloat32>(weight, hidden, rows, vocab, dim, logits, out_dtype, argmax);
      return 0;
    case kBFloat16:
      skinny_rows<R, kBFloat16>(weight, hidden, rows, vocab, dim, logits, out_dtype, argmax);
      return 0;
    case kFloat16:
      skinny_rows<R, kFloat16>(weight, hidden, rows, vocab, dim, logits, out_dtype, argmax);
      return 0;
  }
  return 1;
}

}  // namespace

extern "C" {

// weight: [n, dim] in weight_dtype; x: float32 [rows_padded, dim] where rows_padded is rows
// rounded up to 1, 2, 4, 8 or 16 (extra rows zero). out ([rows, n] in out_dtype) and argmax
// (int64 [rows]) may each be null.
int kvserve_skinny_matmul(const kvserve::SkinnyMatmulArgs* a) {
  const void* weight = a->weight;
  const float* x = a->x;
  void* out = a->out;
  int64_t* argmax = a->argmax;
  const int64_t n = a->n;
  const int weight_dtype = a->weight_dtype, rows = a->rows, dim = a->dim, out_dtype = a->out_dtype;
  if (rows <= 0 || rows > 16 || dim % 16 != 0 || n <= 0 || out_dtype < 0 || out_dtype > 2) return 1;
  if (rows == 1) return dispatch_dtype<1>(weight_dtype, weight, x, rows, n, dim, out, out_dtype, argmax);
  if (rows <= 2) return dispatch_dtype<2>(weight_dtype, weight, x, rows, n, dim, out, out_dtype, argmax);
  if (rows <= 4) return dispatch_dtype<4>(weight_dtype, weight, x, rows, n, dim, out, out_dtype, argmax);
  if (rows <= 8) return dispatch_dtype<8>(weight_dtype, weight, x, rows, n, dim, out, out_dtype, argmax);
  return dispatch_dtype<16>(weight_dtype, weight, x, rows, n, dim, out, out_dtype, argmax);
}

}  // extern "C"
