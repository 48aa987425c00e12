// LoRA products of one fused projection over a step's rows, every adapter in one call
// (kvserve/lora/rows.py): out[i] += B_s (A_s x[i]) for row i's adapter slot s (-1: none), each part
// of a fused projection (q, k, v; gate, up) into its own columns from its own ranks. A row's result
// is computed by one thread in one fixed order (the rank's sums over k, then each output's over its
// part's ranks, in float32 and rounded once into out), so it has the same bits alone or batched,
// whatever adapters ride with it.

#include <cstdint>
#include <vector>

#include "args.h"
#include "simd.h"

namespace {

using namespace kvserve;

constexpr int kMaxRank = 512;

template <int DT>
void lora_rows(const LoraArgs& a) {
  using T = typename Elem<DT>::type;
  const int64_t work = a.rows * static_cast<int64_t>(a.n + a.k) * 16;
#pragma omp parallel for schedule(static) if (work >= (1 << 18))
  for (int64_t i = 0; i < a.rows; ++i) {
    const int s = a.slots[i];
    if (s < 0) continue;
    const int32_t* parts = a.parts[s];
    int rank = 0;
    for (int p = 0; p < parts[0]; ++p) rank += parts[1 + 3 * p];
    const T* x = static_cast<const T*>(a.x) + i * a.x_stride;
    const T* A = static_cast<const T*>(a.a[s]);
    const T* BT = static_cast<const T*>(a.bt[s]);
    T* out = static_cast<T*>(a.out) + i * a.out_stride;
    alignas(64) float h[kMaxRank];
    thread_local std::vector<float> xs, acc;
    xs.resize(a.k);
    acc.assign(a.n, 0.f);
    for (int d = 0; d < a.k; ++d) xs[d] = Elem<DT>::load(x[d]);
    int r = 0;
    for (; r + 4 <= rank; r += 4) {  // four of the rank's sums per pass over x
      const T* row = A + static_cast<int64_t>(r) * a.k;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int d = 0; d < a.k; ++d) {
        const float v = xs[d];
        s0 += v * Elem<DT>::load(row[d]);
        s1 += v * Elem<DT>::load(row[a.k + d]);
        s2 += v * Elem<DT>::load(row[2 * a.k + d]);
        s3 += v * Elem<DT>::load(row[3 * a.k + d]);
      }
      h[r] = s0, h[r + 1] = s1, h[r + 2] = s2, h[r + 3] = s3;
    }
    for (; r < rank; ++r) {
      const T* row = A + static_cast<int64_t>(r) * a.k;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int d = 0; d < a.k; ++d) sum += xs[d] * Elem<DT>::load(row[d]);
      h[r] = sum;
    }
    const T* block = BT;
    int first = 0;
    for (int p = 0; p < parts[0]; ++p) {  // each part's outputs from its own ranks
      const int part_rank = parts[1 + 3 * p], column = parts[2 + 3 * p], width = parts[3 + 3 * p];
      float* into = acc.data() + column;
      for (r = 0; r < part_rank; ++r) {
        const T* row = block + static_cast<int64_t>(r) * width;
        const float hr = h[first + r];
#pragma omp simd
        for (int j = 0; j < width; ++j) into[j] += Elem<DT>::load(row[j]) * hr;
      }
      block += static_cast<int64_t>(part_rank) * width;
      first += part_rank;
    }
    for (int j = 0; j < a.n; ++j) out[j] = Elem<DT>::store(Elem<DT>::load(out[j]) + acc[j]);
  }
}

}  // namespace

extern "C" int kvserve_lora(const kvserve::LoraArgs* args) {
  const kvserve::LoraArgs& a = *args;
  if (a.rows < 0 || a.k <= 0 || a.n <= 0 || a.adapters < 0 || !a.out || !a.x || !a.slots || a.out_stride < a.n || a.x_stride < a.k) return 1;
  for (int s = 0; s < a.adapters; ++s) {
    const int32_t* parts = a.parts[s];
    if (!parts || !a.a[s] || !a.bt[s] || parts[0] <= 0 || parts[0] > 8) return 1;
    int rank = 0;
    for (int p = 0; p < parts[0]; ++p) {
      const int r = parts[1 + 3 * p], c = parts[2 + 3 * p], w = parts[3 + 3 * p];
      if (r <= 0 || c < 0 || w <= 0 || c + w > a.n) return 1;
      rank += r;
    }
    if (rank > kMaxRank) return 1;
  }
  for (int64_t i = 0; i < a.rows; ++i)
    if (a.slots[i] < -1 || a.slots[i] >= a.adapters) return 1;
  switch (a.dtype) {
    case kvserve::kFloat32: lora_rows<kvserve::kFloat32>(a); return 0;
    case kvserve::kBFloat16: lora_rows<kvserve::kBFloat16>(a); return 0;
    default: return 2;
  }
}
