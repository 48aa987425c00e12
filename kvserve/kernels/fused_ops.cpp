// Fused elementwise work of a decoder layer: RMS norms (with the residual add), per-head QK norm
// with RoPE, and the gated activation of the MLP.
//
// In torch each of these is five to fifteen ops, every one a pass over memory (and, for a small
// decode batch, ~10 us of dispatch). Here each is one pass that computes in float32 and rounds
// to the activation dtype where HF's model code holds a tensor in it. Rows are independent, so
// they are split across the OpenMP threads torch already runs. Loops are branch-free so the
// compiler vectorizes them, exp included.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "args.h"
#include "simd.h"

namespace {

using namespace kvserve;

// the value torch would hold after rounding to the activation dtype
template <int DT>
inline float rounded(float v) {
  return Elem<DT>::load(Elem<DT>::store(v));
}

inline float inverse_rms(const float* row, int dim, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int d = 0; d < dim; ++d) sum += row[d] * row[d];
  return 1.f / std::sqrt(sum / dim + eps);
}

// dst = norm(row) * weight; scale_after_cast rounds the normed row first (Llama's order)
template <int DT>
inline void write_normed(typename Elem<DT>::type* dst, const float* row, const float* weight, int dim, float eps,
                         bool scale_after_cast) {
  const float inv = inverse_rms(row, dim, eps);
  if (scale_after_cast) {
    for (int d = 0; d < dim; ++d) dst[d] = Elem<DT>::store(rounded<DT>(row[d] * inv) * weight[d]);
  } else {
    for (int d = 0; d < dim; ++d) dst[d] = Elem<DT>::store(row[d] * inv * weight[d]);
  }
}

inline float gelu_tanh(float x) {
  const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  const float tanh = 1.f - 2.f / (fast_exp(2.f * inner) + 1.f);
  return 0.5f * x * (1.f + tanh);
}

inline float silu(float x) { return x / (1.f + fast_exp(-x)); }

template <int DT>
void rms_norm(void* out, const void* x, int64_t x_stride, const float* weight, int64_t rows, int dim, float eps,
              bool scale_after_cast) {
  using T = typename Elem<DT>::type;
  const T* src = static_cast<const T*>(x);
  T* dst = static_cast<T*>(out);
#pragma omp parallel
  {
    std::vector<float> row(dim);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      for (int d = 0; d < dim; ++d) row[d] = Elem<DT>::load(src[r * x_stride + d]);
      write_normed<DT>(dst + r * dim, row.data(), weight, dim, eps, scale_after_cast);
    }
  }
}

template <int DT>
void add_rms_norm(void* out, void* residual, const void* addend, const float* addend_weight, const float* weight,
                  int64_t rows, int dim, float eps, bool scale_after_cast) {
  using T = typename Elem<DT>::type;
  T* res = static_cast<T*>(residual);
  const T* add = static_cast<const T*>(addend);
  T* dst = static_cast<T*>(out);
#pragma omp parallel
  {
    std::vector<float> row(dim);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t base = r * dim;
      for (int d = 0; d < dim; ++d) row[d] = Elem<DT>::load(add[base + d]);
      if (addend_weight) {
        const float inv = inverse_rms(row.data(), dim, eps);
        for (int d = 0; d < dim; ++d) row[d] = rounded<DT>(row[d] * inv * addend_weight[d]);
      }
      for (int d = 0; d < dim; ++d) {
        const T sum = Elem<DT>::store(Elem<DT>::load(res[base + d]) + row[d]);
        res[base + d] = sum;
        row[d] = Elem<DT>::load(sum);
      }
      if (!weight) continue;
      write_normed<DT>(dst + base, row.data(), weight, dim, eps, scale_after_cast);
    }
  }
}

template <int DT>
void qk_norm_rope(void* q_out, void* k_out, const void* qkv, int64_t tokens, int64_t qkv_width, int q_heads, int kv_heads,
                  int head_dim, const float* q_weight, const float* k_weight, float eps, const int64_t* positions,
                  const float* cos_table, const float* sin_table) {
  using T = typename Elem<DT>::type;
  const T* src = static_cast<const T*>(qkv);
  const int half = head_dim / 2;
  const int64_t jobs = tokens * (q_heads + kv_heads);
#pragma omp parallel
  {
    std::vector<float> row(head_dim);
#pragma omp for schedule(static)
    for (int64_t job = 0; job < jobs; ++job) {
      const int64_t t = job / (q_heads + kv_heads);
      const int head = static_cast<int>(job % (q_heads + kv_heads));
      const bool is_query = head < q_heads;
      const T* in = src + t * qkv_width + static_cast<int64_t>(head) * head_dim;
      for (int d = 0; d < head_dim; ++d) row[d] = Elem<DT>::load(in[d]);
      const float* weight = is_query ? q_weight : k_weight;
      if (weight) {
        const float inv = inverse_rms(row.data(), head_dim, eps);
        for (int d = 0; d < head_dim; ++d) row[d] = rounded<DT>(row[d] * inv * weight[d]);
      }
      const float* c = cos_table + positions[t] * half;  // the angle of dimension d and of d + half
      const float* s = sin_table + positions[t] * half;
      T* out = is_query ? static_cast<T*>(q_out) + (t * q_heads + head) * head_dim
                        : static_cast<T*>(k_out) + (t * kv_heads + head - q_heads) * head_dim;
      for (int d = 0; d < half; ++d) {
        const float x1 = row[d], x2 = row[d + half];
        const float cd = rounded<DT>(c[d]), sd = rounded<DT>(s[d]);
        out[d] = Elem<DT>::store(x1 * cd - x2 * sd);
        out[d + half] = Elem<DT>::store(x2 * cd + x1 * sd);
      }
    }
  }
}

template <int DT>
void gated_activation(void* out, const void* gate_up, int64_t rows, int64_t inter, int act) {
  using T = typename Elem<DT>::type;
  const T* src = static_cast<const T*>(gate_up);
  T* dst = static_cast<T*>(out);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = src + r * 2 * inter;
    const T* up = gate + inter;
    T* o = dst + r * inter;
    if (act == 0) {
#pragma omp simd
      for (int64_t j = 0; j < inter; ++j)
        o[j] = Elem<DT>::store(rounded<DT>(gelu_tanh(Elem<DT>::load(gate[j]))) * Elem<DT>::load(up[j]));
    } else {
#pragma omp simd
      for (int64_t j = 0; j < inter; ++j)
        o[j] = Elem<DT>::store(rounded<DT>(silu(Elem<DT>::load(gate[j]))) * Elem<DT>::load(up[j]));
    }
  }
}

}  // namespace

#define KVSERVE_DISPATCH(dtype, call) \
  switch (dtype) {                    \
    case kFloat32:                    \
      call(kFloat32);                 \
      return 0;                       \
    case kBFloat16:                   \
      call(kBFloat16);                \
      return 0;                       \
    case kFloat16:                    \
      call(kFloat16);                 \
      return 0;                       \
  }                                   \
  return 1;

extern "C" {

// out[r] = norm(x[r]) * weight for rows of `dim` elements at x + r * x_stride; out is contiguous.
// scale_after_cast: Llama's order (round the normed row, then multiply by the weight).
int kvserve_rms_norm(const kvserve::RmsNormArgs* args) {
  const kvserve::RmsNormArgs& a = *args;
  if (a.rows < 0 || a.dim <= 0) return 1;
#define CALL(DT) rms_norm<DT>(a.out, a.x, a.x_stride, a.weight, a.rows, a.dim, a.eps, a.scale_after_cast != 0)
  KVSERVE_DISPATCH(a.dtype, CALL)
#undef CALL
}

// The residual stream step between sublayers, in one pass over contiguous [rows, dim]:
//   residual += addend_weight ? norm(addend) * addend_weight : addend     (rounded to dtype)
//   out = norm(residual) * weight
// Gemma's sandwich norms pass addend_weight (post-attention / post-feedforward norm); Llama null.
// A null weight skips out (the last layer's residual needs no norm).
int kvserve_add_rms_norm(const kvserve::AddRmsNormArgs* args) {
  const kvserve::AddRmsNormArgs& a = *args;
  if (a.rows < 0 || a.dim <= 0) return 1;
#define CALL(DT) add_rms_norm<DT>(a.out, a.residual, a.addend, a.addend_weight, a.weight, a.rows, a.dim, a.eps, a.scale_after_cast != 0)
  KVSERVE_DISPATCH(a.dtype, CALL)
#undef CALL
}

// Queries and keys from the fused QKV projection ([tokens, qkv_width], q heads first, then k
// heads): optional per-head RMS norm (rounded to dtype, as HF holds it), then half-rotation RoPE
// at each token's position into contiguous q_out [tokens, q_heads, head_dim] and k_out
// [tokens, kv_heads, head_dim]. cos/sin: float32 [max_positions, head_dim / 2] (both halves of a head
// rotate by the same angles).
int kvserve_qk_norm_rope(const kvserve::QkNormRopeArgs* args) {
  const kvserve::QkNormRopeArgs& a = *args;
  if (a.tokens < 0 || a.head_dim <= 0 || a.head_dim % 2) return 1;
#define CALL(DT)                                                                                                              \
  qk_norm_rope<DT>(a.q_out, a.k_out, a.qkv, a.tokens, a.qkv_stride, a.num_heads, a.num_kv_heads, a.head_dim, a.q_weight, \
                   a.k_weight, a.eps, a.positions, a.cos, a.sin)
  KVSERVE_DISPATCH(a.dtype, CALL)
#undef CALL
}

// out[r] = act(gate_up[r, :inter]) * gate_up[r, inter:]; act 0 = tanh-approximated GELU, 1 = SiLU.
int kvserve_gated_activation(const kvserve::GatedActivationArgs* args) {
  const kvserve::GatedActivationArgs& a = *args;
  if (a.rows < 0 || a.inter <= 0 || a.activation < 0 || a.activation > 1) return 1;
#define CALL(DT) gated_activation<DT>(a.out, a.gate_up, a.rows, a.inter, a.activation)
  KVSERVE_DISPATCH(a.dtype, CALL)
#undef CALL
}

}  // extern "C"
