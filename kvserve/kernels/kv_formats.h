// Reading one token's K or V of one head from a block of the paged pool, in any KV format, as
// float: the one row reader the decode and prefill attention kernels share. The layouts are
// kvserve/kv/pool.py's and kvserve/kv/quant.py's (the Python codecs that write them):
//
// - float formats (fp32, bf16, fp16): block b, token t, head h at element
//   b * block_stride + t * token_stride + h * head_dim;
// - quantized records (one per block, layer and K/V): the values, token t and head h at byte
//   t * token_stride + h * head_dim * bits / 8, then the scales from byte block_size * token_stride:
//   int8 / fp8: an fp16 per token and head, [t][h];
//   int4 / int2 (KIVI): pairs (log2 scale byte e, int8 zero z), x = 2^((e - 160) / 8) * (q - z);
//   keys [t / group][h][channel], values [t][h][channel / value_group]; values packed low bits first;
// - ids from first_residual on: full-precision blocks (residual_dtype) of a KIVI cache;
// - negative ids: KIVI records quantized for reading only, -1 - j in scratch_key / scratch_value.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "args.h"
#include "simd.h"

namespace kvserve {

enum KVFormat : int { kInt8 = 3, kFp8E4m3 = 4, kFp8E5m2 = 5, kInt4 = 6, kInt2 = 7 };

inline bool is_float_format(int dtype) { return dtype >= kFloat32 && dtype <= kFloat16; }
inline bool is_scaled_format(int dtype) { return dtype >= kInt8 && dtype <= kFp8E5m2; }
inline int format_bits(int dtype) {
  switch (dtype) {
    case kFloat32: return 32;
    case kBFloat16: case kFloat16: return 16;
    case kInt4: return 4;
    case kInt2: return 2;
    default: return 8;
  }
}

inline float fp16_to_float(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof(h));
  return static_cast<float>(h);
}

inline float fp8_e4m3_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24;
  const int exponent = (b >> 3) & 0xF;
  const int mantissa = b & 7;
  float value;
  if (exponent == 0) {
    value = static_cast<float>(mantissa) * (1.0f / 512.0f);  // subnormal: m * 2^-9
  } else {
    const uint32_t bits = (static_cast<uint32_t>(exponent + 120) << 23) | (static_cast<uint32_t>(mantissa) << 20);
    std::memcpy(&value, &bits, sizeof(value));
  }
  return sign ? -value : value;
}

inline float fp8_e5m2_to_float(uint8_t b) { return fp16_to_float(static_cast<uint16_t>(b) << 8); }

// 16 consecutive codes of a scaled format (int8, fp8_e4m3, fp8_e5m2) as float, before the scale.
// Explicit widening instructions where the CPU has them: GCC's generic vector conversions from
// bytes and _Float16 compile to scalar code here.
template <int DT>
inline f32x16 load16_codes(const uint8_t* p) {
  static_assert(DT == kInt8 || DT == kFp8E4m3 || DT == kFp8E5m2, "a scaled KV format");
  f32x16 v;
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m512 out;
  if constexpr (DT == kInt8) {
    out = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  } else if constexpr (DT == kFp8E5m2) {
    out = _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));  // e5m2 is the top byte of an fp16
  } else {
    // e4m3's bits moved down by one exponent bit are an fp16 of 2^-8 times its value, subnormals included
    const __m256i codes = _mm256_cvtepu8_epi16(bytes);
    const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(codes, _mm256_set1_epi16(0x7F)), 7),
                                         _mm256_slli_epi16(_mm256_and_si256(codes, _mm256_set1_epi16(0x80)), 8));
    out = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.f));
  }
  std::memcpy(&v, &out, sizeof(v));
#elif defined(__AVX2__) && defined(__F16C__)
  for (int half = 0; half < 2; ++half) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * half));
    __m256 out;
    if constexpr (DT == kInt8) {
      out = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    } else if constexpr (DT == kFp8E5m2) {
      out = _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8));
    } else {
      const __m128i codes = _mm_cvtepu8_epi16(bytes);
      const __m128i bits = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(codes, _mm_set1_epi16(0x7F)), 7),
                                        _mm_slli_epi16(_mm_and_si128(codes, _mm_set1_epi16(0x80)), 8));
      out = _mm256_mul_ps(_mm256_cvtph_ps(bits), _mm256_set1_ps(256.f));
    }
    std::memcpy(reinterpret_cast<float*>(&v) + 8 * half, &out, sizeof(out));
  }
#else
  for (int i = 0; i < 16; ++i)
    v[i] = DT == kInt8 ? static_cast<float>(static_cast<int8_t>(p[i])) : DT == kFp8E5m2 ? fp8_e5m2_to_float(p[i]) : fp8_e4m3_to_float(p[i]);
#endif
  return v;
}

// 16 consecutive KIVI codes of `Bits` bits (packed low bits first, 8 / Bits per byte) as float
template <int Bits>
inline f32x16 unpack16_codes(const uint8_t* p) {
  static_assert(Bits == 4 || Bits == 2, "KIVI packs 4 or 2 bits");
  constexpr int kPerByte = 8 / Bits;
  constexpr uint32_t kMask = (1u << Bits) - 1u;
  f32x16 v;
#if defined(__AVX2__)
  // lane k takes byte k / kPerByte, shifted right by (k % kPerByte) * Bits
  __m128i bytes;
  if constexpr (Bits == 4) {
    bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  } else {
    int32_t word;
    std::memcpy(&word, p, sizeof(word));
    bytes = _mm_cvtsi32_si128(word);
  }
  const __m128i spread = Bits == 4 ? _mm_shuffle_epi8(bytes, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7))
                                   : _mm_shuffle_epi8(bytes, _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
#if defined(__AVX512F__)
  const __m512i shifts = Bits == 4 ? _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4)
                                   : _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
  const __m512i codes = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(spread), shifts), _mm512_set1_epi32(kMask));
  const __m512 out = _mm512_cvtepi32_ps(codes);
  std::memcpy(&v, &out, sizeof(v));
#else
  const __m256i shifts = Bits == 4 ? _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4) : _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  for (int half = 0; half < 2; ++half) {
    const __m256i wide = _mm256_cvtepu8_epi32(half ? _mm_srli_si128(spread, 8) : spread);
    const __m256 out = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(wide, shifts), _mm256_set1_epi32(kMask)));
    std::memcpy(reinterpret_cast<float*>(&v) + 8 * half, &out, sizeof(out));
  }
#endif
#else
  for (int k = 0; k < 16; ++k) v[k] = static_cast<float>((p[k / kPerByte] >> (Bits * (k % kPerByte))) & kMask);
#endif
  return v;
}

// The fp16 scales of a run of rows of one head inside one block of a scaled format's records
// (int8, fp8): the run's first row starts `offset` bytes into the cache at slot `within` of its
// block; row j's scale is scales[j].
class RunScales {
 public:
  RunScales(const KVView& kv, const void* cache, int64_t offset, int64_t within, int h)
      : stride_(static_cast<int64_t>(kv.num_kv_heads) * 2) {
    const uint8_t* record = static_cast<const uint8_t*>(cache) + offset - within * kv.token_stride - static_cast<int64_t>(h) * kv.head_dim;
    first_ = record + kv.block_size * kv.token_stride + (within * kv.num_kv_heads + h) * 2;
  }

  float operator[](int64_t j) const {
    uint16_t bits;
    std::memcpy(&bits, first_ + j * stride_, sizeof(bits));
    return fp16_to_float(bits);
  }

 private:
  const uint8_t* first_;
  int64_t stride_;
};

// 2^((e - 160) / 8): the scale an 8-bit log2 scale byte stands for
inline float log_scale(uint8_t e) {
  static const struct Table {
    float value[256];
    Table() {
      for (int i = 0; i < 256; ++i) value[i] = static_cast<float>(std::exp2((i - 160) / 8.0));
    }
  } table;
  return table.value[e];
}

// The byte record of quantized block `id` (below first_residual): the pool's, or a scratch one
inline const uint8_t* quantized_record(const KVView& kv, bool value, int64_t id) {
  if (id < 0) return static_cast<const uint8_t*>(value ? kv.scratch_value : kv.scratch_key) + (-1 - id) * kv.block_stride;
  return static_cast<const uint8_t*>(value ? kv.value : kv.key) + id * kv.block_stride;
}

// One block of one layer's K or V, ready to hand out rows as float.
class BlockRows {
 public:
  BlockRows(const KVView& kv, bool value, int64_t block_id) : kv_(kv), value_(value) {
    if (block_id >= kv.first_residual) {
      float_ = static_cast<const char*>(value ? kv.residual_value : kv.residual_key);
      dtype_ = kv.residual_dtype;
      offset_ = (block_id - kv.first_residual) * kv.residual_block_stride;
      token_stride_ = kv.residual_token_stride;
    } else if (is_float_format(kv.dtype)) {
      float_ = static_cast<const char*>(value ? kv.value : kv.key);
      dtype_ = kv.dtype;
      offset_ = block_id * kv.block_stride;
      token_stride_ = kv.token_stride;
    } else {
      record_ = quantized_record(kv, value, block_id);
      dtype_ = kv.dtype;
      token_stride_ = kv.token_stride;
    }
  }

  // token t's head h into out[head_dim]
  void row(int t, int h, float* out) {
    const int dim = kv_.head_dim;
    if (float_ != nullptr) {
      const int64_t at = offset_ + t * token_stride_ + static_cast<int64_t>(h) * dim;
      if (dtype_ == kFloat32) {
        std::memcpy(out, reinterpret_cast<const float*>(float_) + at, sizeof(float) * dim);
      } else if (dtype_ == kBFloat16) {
        const uint16_t* p = reinterpret_cast<const uint16_t*>(float_) + at;
#pragma omp simd
        for (int d = 0; d < dim; ++d) {
          const uint32_t bits = static_cast<uint32_t>(p[d]) << 16;
          std::memcpy(out + d, &bits, sizeof(float));
        }
      } else {
        const _Float16* p = reinterpret_cast<const _Float16*>(float_) + at;
#pragma omp simd
        for (int d = 0; d < dim; ++d) out[d] = static_cast<float>(p[d]);
      }
      return;
    }
    const int bits = format_bits(dtype_);
    const uint8_t* data = record_ + t * token_stride_ + static_cast<int64_t>(h) * dim * bits / 8;
    const uint8_t* meta = record_ + kv_.block_size * token_stride_;
    if (dtype_ == kInt8 || dtype_ == kFp8E4m3 || dtype_ == kFp8E5m2) {
      uint16_t scale_bits;
      std::memcpy(&scale_bits, meta + (static_cast<int64_t>(t) * kv_.num_kv_heads + h) * 2, sizeof(scale_bits));
      const float scale = fp16_to_float(scale_bits);
      if (dim % 16 == 0) {
        for (int d = 0; d < dim; d += 16) {
          const f32x16 v = (dtype_ == kInt8     ? load16_codes<kInt8>(data + d)
                            : dtype_ == kFp8E4m3 ? load16_codes<kFp8E4m3>(data + d)
                                                 : load16_codes<kFp8E5m2>(data + d)) * scale;
          std::memcpy(out + d, &v, sizeof(v));
        }
      } else if (dtype_ == kInt8) {
        const int8_t* q = reinterpret_cast<const int8_t*>(data);
#pragma omp simd
        for (int d = 0; d < dim; ++d) out[d] = static_cast<float>(q[d]) * scale;
      } else if (dtype_ == kFp8E5m2) {
        for (int d = 0; d < dim; ++d) out[d] = fp8_e5m2_to_float(data[d]) * scale;
      } else {
        for (int d = 0; d < dim; ++d) out[d] = fp8_e4m3_to_float(data[d]) * scale;
      }
      return;
    }
    // KIVI: unpack, then scale per channel (keys: the token's group) or per channel group (values)
    const int per_byte = 8 / bits;
    const int mask = (1 << bits) - 1;
    const bool vectors = dim % 16 == 0 && (!value_ || kv_.value_group % 16 == 0);
    if (!value_) {
      prepare_key_group(t / kv_.group_size, h, meta);
      if (vectors) {
        for (int d = 0; d < dim; d += 16) {
          f32x16 scale, offset;
          std::memcpy(&scale, scale_ + d, sizeof(scale));
          std::memcpy(&offset, offset_vec_ + d, sizeof(offset));
          const f32x16 v = (bits == 4 ? unpack16_codes<4>(data + d / 2) : unpack16_codes<2>(data + d / 4)) * scale + offset;
          std::memcpy(out + d, &v, sizeof(v));
        }
        return;
      }
      for (int d = 0; d < dim; ++d) {
        const int q = (data[d / per_byte] >> (bits * (d % per_byte))) & mask;
        out[d] = static_cast<float>(q) * scale_[d] + offset_vec_[d];
      }
      return;
    }
    const int groups = dim / kv_.value_group;
    const uint8_t* pairs = meta + (static_cast<int64_t>(t) * kv_.num_kv_heads + h) * groups * 2;
    for (int g = 0; g < groups; ++g) {
      const float scale = log_scale(pairs[2 * g]);
      const float offset = -scale * static_cast<float>(static_cast<int8_t>(pairs[2 * g + 1]));
      if (vectors) {
        for (int d = g * kv_.value_group; d < (g + 1) * kv_.value_group; d += 16) {
          const f32x16 v = (bits == 4 ? unpack16_codes<4>(data + d / 2) : unpack16_codes<2>(data + d / 4)) * scale + offset;
          std::memcpy(out + d, &v, sizeof(v));
        }
        continue;
      }
      for (int d = g * kv_.value_group; d < (g + 1) * kv_.value_group; ++d) {
        const int q = (data[d / per_byte] >> (bits * (d % per_byte))) & mask;
        out[d] = static_cast<float>(q) * scale + offset;
      }
    }
  }

 private:
  // a key group's per-channel scale and offset (-scale * zero), kept while rows of that group come
  void prepare_key_group(int group, int h, const uint8_t* meta) {
    if (group == group_ && h == head_) return;
    group_ = group;
    head_ = h;
    const int dim = kv_.head_dim;
    const uint8_t* pairs = meta + ((static_cast<int64_t>(group) * kv_.num_kv_heads + h) * dim) * 2;
    for (int d = 0; d < dim; ++d) {
      scale_[d] = log_scale(pairs[2 * d]);
      offset_vec_[d] = -scale_[d] * static_cast<float>(static_cast<int8_t>(pairs[2 * d + 1]));
    }
  }

  static constexpr int kMaxHeadDim = 512;
  const KVView& kv_;
  bool value_;
  const char* float_ = nullptr;
  const uint8_t* record_ = nullptr;
  int dtype_ = 0;
  int64_t offset_ = 0;
  int64_t token_stride_ = 0;
  int group_ = -1;
  int head_ = -1;
  float scale_[kMaxHeadDim];
  float offset_vec_[kMaxHeadDim];
};

}  // namespace kvserve
