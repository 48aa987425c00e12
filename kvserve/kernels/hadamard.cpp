// Hadamard rotation of attention heads (kv/rotation.py): every head vector x becomes x R, with
// R = diag(signs) H / sqrt(D), or x R^T, by the fast Walsh-Hadamard transform in float32
// (D log2 D adds instead of a D x D product) and rounded once to the activation dtype. The
// butterflies run in the order of kv/rotation.py's torch version, so both give the same bits.

#include <cstdint>
#include <cstring>

#include "args.h"
#include "simd.h"

namespace {

using namespace kvserve;

constexpr int kMaxDim = 1024;

// one tensor [tokens, heads, dim] (token stride `stride`, heads packed) into out (token stride
// out_stride); out may be x: each row is read whole before it is written
template <int DT>
void rotate(void* out, const void* x, int64_t tokens, int64_t stride, int64_t out_stride, int heads, int dim, const float* signs,
            float scale, bool inverse) {
  using T = typename Elem<DT>::type;
  const T* in = static_cast<const T*>(x);
  T* to = static_cast<T*>(out);
  const int64_t rows = tokens * heads;
#pragma omp parallel for schedule(static) if (rows * dim >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t src = (r / heads) * stride + (r % heads) * dim;
    const int64_t dst = (r / heads) * out_stride + (r % heads) * dim;
    alignas(64) float buf[kMaxDim];
    for (int d = 0; d < dim; ++d) buf[d] = inverse ? Elem<DT>::load(in[src + d]) : Elem<DT>::load(in[src + d]) * signs[d];
    for (int h = 1; h < dim; h *= 2)
      for (int i = 0; i < dim; i += 2 * h)
#pragma omp simd
        for (int j = i; j < i + h; ++j) {
          const float a = buf[j], b = buf[j + h];
          buf[j] = a + b;
          buf[j + h] = a - b;
        }
    for (int d = 0; d < dim; ++d) {
      const float v = buf[d] * scale;
      to[dst + d] = Elem<DT>::store(inverse ? v * signs[d] : v);
    }
  }
}

}  // namespace

extern "C" {

// Up to three tensors at once (a layer's q, k and v), each [tokens, heads[i], dim] read with token
// stride x_stride[i] (elements) and written to out[i] with token stride out_stride[i] (out[i] may
// be x[i]: in place); dim a power of two <= 1024.
int kvserve_hadamard(const kvserve::HadamardArgs* args) {
  const kvserve::HadamardArgs& a = *args;
  if (a.count < 0 || a.count > 3 || a.tokens < 0 || a.dim <= 0 || a.dim > kMaxDim || (a.dim & (a.dim - 1)) || !a.signs) return 1;
  for (int i = 0; i < a.count; ++i) {
    const int64_t row = static_cast<int64_t>(a.heads[i]) * a.dim;
    if (a.heads[i] <= 0 || a.x_stride[i] < row || a.out_stride[i] < row || !a.x[i] || !a.out[i]) return 1;
#define CALL(DT) \
  rotate<DT>(a.out[i], a.x[i], a.tokens, a.x_stride[i], a.out_stride[i], a.heads[i], a.dim, a.signs, a.scale, a.inverse != 0)
    switch (a.dtype) {
      case kFloat32: CALL(kFloat32); break;
      case kBFloat16: CALL(kBFloat16); break;
      case kFloat16: CALL(kFloat16); break;
      default: return 2;
    }
#undef CALL
  }
  return 0;
}

}  // extern "C"
