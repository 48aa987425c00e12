// SnapKV's window scores (attention/window_scores.py): the attention a sequence's last prompt
// queries pay each cached key, summed over the queries and the query heads of each KV head, added
// to the sequence's running scores. Each query row's softmax is its own (its scores over the keys
// it sees, causally); the rows are then added to `out` one after another in row order, starting
// from what `out` holds, so a window cut across prefill chunks adds the same numbers in the same
// order as one chunk would.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "args.h"
#include "simd.h"

namespace {

using namespace kvserve;

constexpr int kLanes = 16;
constexpr int kRowsAtOnce = 8;  // query rows of a KV head scored against one 16-key slice at a time
constexpr size_t kKeptBytes = 8u << 20;

template <int DT>
inline float element(const void* base, int64_t index) {
  return Elem<DT>::load(static_cast<const typename Elem<DT>::type*>(base)[index]);
}

// fn(std::integral_constant<int, DT>{}) for a run-time dtype code (one of the three)
template <typename Fn>
inline void with_dtype(int dtype, Fn fn) {
  if (dtype == kFloat32)
    fn(std::integral_constant<int, kFloat32>{});
  else if (dtype == kBFloat16)
    fn(std::integral_constant<int, kBFloat16>{});
  else
    fn(std::integral_constant<int, kFloat16>{});
}

// pr[g][j] = qr[g] . k_j for the keys j < seen (in slices of 16), R rows held in registers
template <int R>
void logits(const float* const* qr, float* const* pr, const float* keys_t, int64_t padded, int dim, int64_t seen) {
  for (int64_t j = 0; j < seen; j += kLanes) {
    f32x16 acc[R] = {};
    for (int d = 0; d < dim; ++d) {
      f32x16 k;
      std::memcpy(&k, keys_t + d * padded + j, sizeof(k));
      for (int g = 0; g < R; ++g) acc[g] += qr[g][d] * k;
    }
    for (int g = 0; g < R; ++g) std::memcpy(pr[g] + j, &acc[g], sizeof(f32x16));
  }
}

inline void logits_for_rows(int rows, const float* const* qr, float* const* pr, const float* keys_t, int64_t padded, int dim, int64_t seen) {
  switch (rows) {
    case 1: return logits<1>(qr, pr, keys_t, padded, dim, seen);
    case 2: return logits<2>(qr, pr, keys_t, padded, dim, seen);
    case 3: return logits<3>(qr, pr, keys_t, padded, dim, seen);
    case 4: return logits<4>(qr, pr, keys_t, padded, dim, seen);
    case 5: return logits<5>(qr, pr, keys_t, padded, dim, seen);
    case 6: return logits<6>(qr, pr, keys_t, padded, dim, seen);
    case 7: return logits<7>(qr, pr, keys_t, padded, dim, seen);
    default: return logits<kRowsAtOnce>(qr, pr, keys_t, padded, dim, seen);
  }
}

// probs[r][j] = weight_r * softmax_j(scale * q_r . k_j) over the keys row r sees, 0 past them,
// for query i's rows r = i * group + g of KV head h (its query heads h * group + g)
void query_probabilities(const WindowScoresArgs& a, int h, int i, const float* keys_t, int64_t padded, const float* q, float* probs) {
  const int group = a.heads / a.kv_heads, dim = a.dim;
  const int64_t seen = std::min<int64_t>(a.first_slot + i + 1, a.length);
  const float row_weight = i >= a.weighted_from ? a.weight : 1.0f;
  for (int g0 = 0; g0 < group; g0 += kRowsAtOnce) {
    const int rows = std::min(kRowsAtOnce, group - g0);
    const float* qr[kRowsAtOnce];
    float* pr[kRowsAtOnce];
    for (int g = 0; g < rows; ++g) {
      qr[g] = q + (static_cast<int64_t>(i) * a.heads + h * group + g0 + g) * dim;
      pr[g] = probs + (static_cast<int64_t>(i) * group + g0 + g) * padded;
    }
    logits_for_rows(rows, qr, pr, keys_t, padded, dim, seen);
    const f32x16 hidden = f32x16{} - std::numeric_limits<float>::infinity();
    i32x16 lane;
    for (int l = 0; l < kLanes; ++l) lane[l] = l;
    for (int g = 0; g < rows; ++g) {  // the row's softmax, 16 keys at a time; keys past `seen` weigh 0
      float* p = pr[g];
      f32x16 top = hidden;
      for (int64_t j = 0; j < seen; j += kLanes) {
        f32x16 v;
        std::memcpy(&v, p + j, sizeof(v));
        v = lane < static_cast<int32_t>(seen - j) ? v * a.scale : hidden;
        std::memcpy(p + j, &v, sizeof(v));
        top = v > top ? v : top;
      }
      const float peak = hmax(top);
      f32x16 sum = {};
      for (int64_t j = 0; j < seen; j += kLanes) {
        f32x16 v;
        std::memcpy(&v, p + j, sizeof(v));
        v = lane < static_cast<int32_t>(seen - j) ? exp16(v - peak) : f32x16{};
        std::memcpy(p + j, &v, sizeof(v));
        sum += v;
      }
      const float by = row_weight / hsum(sum);
      for (int64_t j = 0; j < seen; j += kLanes) {
        f32x16 v;
        std::memcpy(&v, p + j, sizeof(v));
        v *= by;
        std::memcpy(p + j, &v, sizeof(v));
      }
      std::fill(p + (seen + kLanes - 1) / kLanes * kLanes, p + padded, 0.0f);
    }
  }
}

}  // namespace

extern "C" {

// AVX-512 only: on AVX2 GCC splits the 16-lane selects into 128-bit pieces and the kernel ran
// 3-5x slower than torch's batched products (which then stay)
int kvserve_window_scores_available() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

// out[h][j] += the rows' weighted probabilities of key j (j < columns), row after row; q [w, heads,
// dim] with token stride q_stride (heads packed), keys [length, kv_heads, dim] packed
int kvserve_window_scores(const kvserve::WindowScoresArgs* args) {
  const kvserve::WindowScoresArgs& a = *args;
  if (!a.out || !a.q || !a.keys || a.w <= 0 || a.kv_heads <= 0 || a.heads % a.kv_heads || a.dim <= 0 || a.length <= 0 || a.first_slot < 0 ||
      a.columns < 0 || a.columns > a.length || a.out_stride < a.columns || a.q_stride < static_cast<int64_t>(a.heads) * a.dim)
    return 1;
  if ((a.q_dtype != kFloat32 && a.q_dtype != kBFloat16 && a.q_dtype != kFloat16) ||
      (a.keys_dtype != kFloat32 && a.keys_dtype != kBFloat16 && a.keys_dtype != kFloat16))
    return 2;
  const int group = a.heads / a.kv_heads, dim = a.dim;
  const int64_t padded = (a.length + kLanes - 1) / kLanes * kLanes;
  // reused between calls up to kKeptBytes each (a fresh buffer costs a page fault every 4 KiB; a long
  // prompt's are let go after it); a key slot past `length` is read but never weighed. The calling
  // thread's: OpenMP's threads get pointers.
  static thread_local std::vector<float> keys_buffer, q_buffer, probs_buffer;
  struct LetGo {
    ~LetGo() {
      for (std::vector<float>* buffer : {&keys_buffer, &q_buffer, &probs_buffer})
        if (buffer->capacity() * sizeof(float) > kKeptBytes) std::vector<float>().swap(*buffer);
    }
  } let_go;
  const int64_t rows = static_cast<int64_t>(a.w) * group;
  keys_buffer.resize(std::max(keys_buffer.size(), static_cast<size_t>(a.kv_heads) * dim * padded));  // per KV head [dim][keys]
  q_buffer.resize(std::max(q_buffer.size(), static_cast<size_t>(a.w) * a.heads * dim));
  probs_buffer.resize(std::max(probs_buffer.size(), static_cast<size_t>(a.kv_heads) * rows * padded));
  float* const keys_t = keys_buffer.data();
  float* const q = q_buffer.data();
  float* const probs = probs_buffer.data();
  with_dtype(a.q_dtype, [&](auto dt) {
    const int64_t row = static_cast<int64_t>(a.heads) * dim;
    for (int i = 0; i < a.w; ++i)
      for (int64_t e = 0; e < row; ++e) q[i * row + e] = element<decltype(dt)::value>(a.q, i * a.q_stride + e);
  });
  with_dtype(a.keys_dtype, [&](auto dt) {
#pragma omp parallel for schedule(static) if (a.length * a.kv_heads * dim >= (1 << 15))
    for (int64_t j = 0; j < a.length; ++j)
      for (int h = 0; h < a.kv_heads; ++h)
        for (int d = 0; d < dim; ++d)
          keys_t[(static_cast<size_t>(h) * dim + d) * padded + j] = element<decltype(dt)::value>(a.keys, (j * a.kv_heads + h) * dim + d);
  });
#pragma omp parallel for collapse(2) schedule(static)
  for (int h = 0; h < a.kv_heads; ++h)
    for (int i = 0; i < a.w; ++i)
      query_probabilities(a, h, i, keys_t + static_cast<size_t>(h) * dim * padded, padded, q, probs + static_cast<size_t>(h) * rows * padded);
  const int64_t slices = (a.columns + 255) / 256;
#pragma omp parallel for collapse(2) schedule(static)
  for (int h = 0; h < a.kv_heads; ++h)
    for (int64_t s = 0; s < slices; ++s) {
      float* out = a.out + h * a.out_stride;
      const float* p = probs + static_cast<size_t>(h) * rows * padded;
      const int64_t end = std::min<int64_t>(a.columns, (s + 1) * 256);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = s * 256; j < end; ++j) out[j] += p[r * padded + j];
    }
  return 0;
}

}  // extern "C"
