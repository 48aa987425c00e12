// What the paged attention paths share (paged_attention.cpp includes this first inside its
// anonymous namespace): a row of queries or outputs in any float dtype, a dot product, the group
// sizes and KV dtypes the loops are compiled for, and the softmax of rows of scores.

#pragma once

inline void load_row(const void* src, int dtype, int64_t offset, int n, float* dst) {
  if (dtype == kFloat32) {
    std::memcpy(dst, static_cast<const float*>(src) + offset, sizeof(float) * n);
  } else if (dtype == kBFloat16) {
    const uint16_t* p = static_cast<const uint16_t*>(src) + offset;
#pragma omp simd
    for (int i = 0; i < n; ++i) {
      uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
      float value;
      std::memcpy(&value, &bits, sizeof(value));
      dst[i] = value;
    }
  } else {
    const _Float16* p = static_cast<const _Float16*>(src) + offset;
#pragma omp simd
    for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(p[i]);
  }
}

inline void store_row(void* dst, int dtype, int64_t offset, int n, const float* src, float factor) {
  for (int i = 0; i < n; ++i) store_element(dst, dtype, offset + i, src[i] * factor);
}

inline float dot(const float* a, const float* b, int n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}


// fn(std::integral_constant<int, G>{}) for G = group in 1..8, the group sizes the vectorized
// loops are compiled for; false for any other group
template <typename Fn>
bool with_group_size(int group, Fn fn) {
  switch (group) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 5: return fn(std::integral_constant<int, 5>{});
    case 6: return fn(std::integral_constant<int, 6>{});
    case 7: return fn(std::integral_constant<int, 7>{});
    case 8: return fn(std::integral_constant<int, 8>{});
  }
  return false;
}

// fn(std::integral_constant<int, DT>{}) for a float (fp32, bf16, fp16) or scaled (int8, fp8) KV
// dtype code; false for the KIVI formats
template <typename Fn>
bool with_kv_dtype(int dtype, Fn fn) {
  switch (dtype) {
    case kFloat32: return fn(std::integral_constant<int, kFloat32>{});
    case kBFloat16: return fn(std::integral_constant<int, kBFloat16>{});
    case kFloat16: return fn(std::integral_constant<int, kFloat16>{});
    case kInt8: return fn(std::integral_constant<int, kInt8>{});
    case kFp8E4m3: return fn(std::integral_constant<int, kFp8E4m3>{});
    case kFp8E5m2: return fn(std::integral_constant<int, kFp8E5m2>{});
  }
  return false;
}

// the largest of row[0..count): 16 running maxima, not one serial chain (scores hold no NaN)
inline float row_max(const float* row, int64_t count) {
  f32x16 peaks;
  for (int k = 0; k < 16; ++k) peaks[k] = -INFINITY;
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    f32x16 v;
    std::memcpy(&v, row + i, sizeof(v));
    peaks = v > peaks ? v : peaks;
  }
  float peak = hmax(peaks);
  for (; i < count; ++i) peak = std::max(peak, row[i]);
  return peak;
}

// scores [G][count] -> exp(score - the row's max) in place; inv_sum[g] = 1 / the row's sum, and
// where lse is given, lse[g] = log of the row's sum of exp(score) (to merge a split context's parts)
inline void softmax_rows(float* scores, int G, int64_t count, float* inv_sum, float* lse) {
  for (int g = 0; g < G; ++g) {
    float* row = scores + g * count;
    const float peak = row_max(row, count);
    f32x16 total = f32x16{};
    int64_t i = 0;
    for (; i + 16 <= count; i += 16) {
      f32x16 v;
      std::memcpy(&v, row + i, sizeof(v));
      v = exp16(v - peak);
      std::memcpy(row + i, &v, sizeof(v));
      total += v;
    }
    float tail = hsum(total);
    for (; i < count; ++i) {
      row[i] = fast_exp(row[i] - peak);
      tail += row[i];
    }
    inv_sum[g] = 1.f / tail;
    if (lse) lse[g] = peak + std::log(tail);
  }
}
