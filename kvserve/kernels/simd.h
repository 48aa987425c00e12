// Shared by the kvserve CPU kernels: dtype codes, 16-float vectors, exp.
//
// GCC vector extensions lower a 16-float vector to one AVX-512 register or two AVX2 registers,
// so the same source serves both kinds of CPU under -march=native.

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace kvserve {

enum Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef _Float16 f16x16 __attribute__((vector_size(32)));

// 16 consecutive elements of a DT array, as float
template <int DT>
inline f32x16 load16(const void* base, int64_t offset) {
  f32x16 v;
  if constexpr (DT == kFloat32) {
    std::memcpy(&v, static_cast<const float*>(base) + offset, sizeof(v));
  } else if constexpr (DT == kBFloat16) {
    u16x16 half;
    std::memcpy(&half, static_cast<const uint16_t*>(base) + offset, sizeof(half));
    u32x16 wide = __builtin_convertvector(half, u32x16) << 16;
    std::memcpy(&v, &wide, sizeof(v));
  } else {
#if defined(__AVX512F__)
    const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const _Float16*>(base) + offset)));
    std::memcpy(&v, &wide, sizeof(v));
#else
    f16x16 half;  // GCC widens a _Float16 vector element by element
    std::memcpy(&half, static_cast<const _Float16*>(base) + offset, sizeof(half));
    v = __builtin_convertvector(half, f32x16);
#endif
  }
  return v;
}

inline float hsum(f32x16 v) {
  typedef float f32x8 __attribute__((vector_size(32)));
  typedef float f32x4 __attribute__((vector_size(16)));
  f32x8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  f32x4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

inline float hmax(f32x16 v) {
  typedef float f32x8 __attribute__((vector_size(32)));
  typedef float f32x4 __attribute__((vector_size(16)));
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const f32x8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x8 h = a > b ? a : b;
  const f32x4 c = __builtin_shufflevector(h, h, 0, 1, 2, 3);
  const f32x4 d = __builtin_shufflevector(h, h, 4, 5, 6, 7);
  const f32x4 q = c > d ? c : d;
  const float x = q[0] > q[1] ? q[0] : q[1];
  const float y = q[2] > q[3] ? q[2] : q[3];
  return x > y ? x : y;
}

// bit i set where v[i] > t (false for NaN lanes)
inline uint32_t mask_gt(f32x16 v, float t) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(reinterpret_cast<__m512&>(v), _mm512_set1_ps(t), _CMP_GT_OQ);
#elif defined(__AVX__)
  typedef float f32x8 __attribute__((vector_size(32)));
  const f32x8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const f32x8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m256 threshold = _mm256_set1_ps(t);
  const uint32_t low = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(reinterpret_cast<const __m256&>(lo), threshold, _CMP_GT_OQ)));
  const uint32_t high = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(reinterpret_cast<const __m256&>(hi), threshold, _CMP_GT_OQ)));
  return low | (high << 8);
#else
  uint32_t bits = 0;
  for (int i = 0; i < 16; ++i) bits |= static_cast<uint32_t>(v[i] > t) << i;
  return bits;
#endif
}

// float -> bf16 bits, round to nearest even as torch does; NaN stays NaN
inline uint16_t bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint16_t nearest_even = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  return (bits & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>(0x7fc0) : nearest_even;
}

// one element of a float32 / bf16 / fp16 array, chosen at run time
inline void store_element(void* out, int dtype, int64_t index, float value) {
  if (dtype == kFloat32) {
    static_cast<float*>(out)[index] = value;
  } else if (dtype == kBFloat16) {
    static_cast<uint16_t*>(out)[index] = bf16_bits(value);
  } else {
    static_cast<_Float16*>(out)[index] = static_cast<_Float16>(value);
  }
}

// one element of a DT array: its C type, read as float, written from float as torch rounds
template <int DT>
struct Elem;
template <>
struct Elem<kFloat32> {
  using type = float;
  static inline float load(float v) { return v; }
  static inline float store(float v) { return v; }
};
template <>
struct Elem<kBFloat16> {
  using type = uint16_t;
  static inline float load(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  static inline uint16_t store(float f) { return bf16_bits(f); }
};
template <>
struct Elem<kFloat16> {
  using type = _Float16;
  static inline float load(_Float16 v) { return static_cast<float>(v); }
  static inline _Float16 store(float f) { return static_cast<_Float16>(f); }
};

// exp(x) = 2^n * 2^f with f in [-0.5, 0.5] from a degree-6 polynomial: relative error ~2e-7,
// saturating outside [-87, 88]. Branch-free, so it works on a float (and auto-vectorizes in a
// loop) or on an f32x16.
template <typename F, typename I>
inline F exp_approx(F x) {
  x = x < -87.f ? F{} - 87.f : x;
  x = x > 88.f ? F{} + 88.f : x;
  const F y = x * 1.44269504088896341f;
  const F n = (y + 12582912.f) - 12582912.f;  // round to nearest: 1.5 * 2^23 pushes the fraction out
  const F f = y - n;
  F p = F{} + 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  I exponent;
  if constexpr (sizeof(F) == sizeof(float)) {
    exponent = (static_cast<I>(n) + 127) << 23;
  } else {
    exponent = (__builtin_convertvector(n, I) + 127) << 23;
  }
  F scale;
  std::memcpy(&scale, &exponent, sizeof(scale));
  return p * scale;
}

inline float fast_exp(float x) { return exp_approx<float, int32_t>(x); }
inline f32x16 exp16(f32x16 x) { return exp_approx<f32x16, i32x16>(x); }

}  // namespace kvserve
