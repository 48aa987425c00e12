// Hadamard rotation of attention heads (kv/rotation.py): every head vector x becomes x R, with
// R = diag(signs) H / sqrt(D), or x R^T, by the fast Walsh-Hadamard transform in float32
// (D log2 D adds instead of a D x D product) and rounded once to the activation dtype. The
// butterflies run in the order of kv/rotation.py's torch version, so both give the same bits.

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "args.h"
#include "simd.h"

namespace {

using namespace kvserve;

constexpr int kMaxDim = 1024;

// The butterflies of one row in place, stage h = 1, 2, 4, ... in turn: (a, b) at (j, j + h) become
// (a + b, a - b). Every element's value is the same sum in the same order however the stages are
// vectorized, so all paths give the scalar loop's bits. Within a vector a stage is one permute:
// y = x with lanes j and j ^ h swapped, then x + y in the lower lane and y - x (= a - b) in the upper.
inline void scalar_stages(float* buf, int dim, int from) {
  for (int h = from; h < dim; h *= 2)
    for (int i = 0; i < dim; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = buf[j], b = buf[j + h];
        buf[j] = a + b;
        buf[j + h] = a - b;
      }
}

#if defined(__AVX512F__)
inline __m512 in_vector_stages(__m512 x) {
  __m512 y = _mm512_permute_ps(x, 0xB1);  // h = 1: lanes 1 0 3 2 within each 4
  x = _mm512_mask_sub_ps(_mm512_add_ps(x, y), 0xAAAA, y, x);
  y = _mm512_permute_ps(x, 0x4E);  // h = 2: lanes 2 3 0 1 within each 4
  x = _mm512_mask_sub_ps(_mm512_add_ps(x, y), 0xCCCC, y, x);
  y = _mm512_shuffle_f32x4(x, x, 0xB1);  // h = 4: 128-bit lanes 1 0 3 2
  x = _mm512_mask_sub_ps(_mm512_add_ps(x, y), 0xF0F0, y, x);
  y = _mm512_shuffle_f32x4(x, x, 0x4E);  // h = 8: 128-bit lanes 2 3 0 1
  return _mm512_mask_sub_ps(_mm512_add_ps(x, y), 0xFF00, y, x);
}
#elif defined(__AVX2__)
inline __m256 in_vector_stages(__m256 x) {
  __m256 y = _mm256_permute_ps(x, 0xB1);
  x = _mm256_blend_ps(_mm256_add_ps(x, y), _mm256_sub_ps(y, x), 0xAA);
  y = _mm256_permute_ps(x, 0x4E);
  x = _mm256_blend_ps(_mm256_add_ps(x, y), _mm256_sub_ps(y, x), 0xCC);
  y = _mm256_permute2f128_ps(x, x, 0x01);
  return _mm256_blend_ps(_mm256_add_ps(x, y), _mm256_sub_ps(y, x), 0xF0);
}
#endif

inline void butterflies(float* buf, int dim) {
#if defined(__AVX512F__)
  constexpr int kLanes = 16;
  using Vec = __m512;
  auto load = [](const float* p) { return _mm512_load_ps(p); };
  auto store = [](float* p, Vec v) { _mm512_store_ps(p, v); };
  auto add = [](Vec a, Vec b) { return _mm512_add_ps(a, b); };
  auto sub = [](Vec a, Vec b) { return _mm512_sub_ps(a, b); };
#elif defined(__AVX2__)
  constexpr int kLanes = 8;
  using Vec = __m256;
  auto load = [](const float* p) { return _mm256_load_ps(p); };
  auto store = [](float* p, Vec v) { _mm256_store_ps(p, v); };
  auto add = [](Vec a, Vec b) { return _mm256_add_ps(a, b); };
  auto sub = [](Vec a, Vec b) { return _mm256_sub_ps(a, b); };
#else
  constexpr int kLanes = 1;
#endif
  if (kLanes == 1 || dim < kLanes) {
    scalar_stages(buf, dim, 1);
    return;
  }
#if defined(__AVX512F__) || defined(__AVX2__)
  for (int i = 0; i < dim; i += kLanes) store(buf + i, in_vector_stages(load(buf + i)));
  for (int h = kLanes; h < dim; h *= 2)
    for (int i = 0; i < dim; i += 2 * h)
      for (int j = i; j < i + h; j += kLanes) {
        const Vec a = load(buf + j), b = load(buf + j + h);
        store(buf + j, add(a, b));
        store(buf + j + h, sub(a, b));
      }
#endif
}

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
    const T* from = in + src;
    T* into = to + dst;
    if (inverse) {
      for (int d = 0; d < dim; ++d) buf[d] = Elem<DT>::load(from[d]);
    } else {
      for (int d = 0; d < dim; ++d) buf[d] = Elem<DT>::load(from[d]) * signs[d];
    }
    butterflies(buf, dim);
    if (inverse) {
      for (int d = 0; d < dim; ++d) into[d] = Elem<DT>::store(buf[d] * scale * signs[d]);
    } else {
      for (int d = 0; d < dim; ++d) into[d] = Elem<DT>::store(buf[d] * scale);
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
