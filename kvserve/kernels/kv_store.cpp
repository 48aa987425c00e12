// Writing tokens' K or V into a scaled format's records (int8, fp8_e4m3, fp8_e5m2), bit for bit
// what kvserve/kv/quant.py's encode writes: per token and head, scale = amax / limit (int8: 127;
// fp8: the format's largest value; or a calibrated per-head scale), at least 2^-24, rounded to
// fp16 and stored as such; values = x / scale rounded to nearest even (int8: clamped to +-127;
// fp8: clamped to +-limit, then rounded to the format), after subtracting a centered cache's
// per-head center in float (kv/centering.py). The decode step stores one token per
// sequence and layer, where the torch codec's dozen small ops cost more than the attention.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "args.h"
#include "kv_formats.h"

namespace {

using namespace kvserve;

constexpr float kTinyScale = 1.0f / 16777216.0f;  // 2^-24

inline uint16_t float_to_fp16_bits(float value) {
  const _Float16 h = static_cast<_Float16>(value);  // round to nearest even
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof(bits));
  return bits;
}

inline uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// A finite float within the format's range, rounded to nearest even into an fp8 with
// `Exponent` exponent bits (bias 2^(Exponent-1) - 1) and `Mantissa` mantissa bits; NaN to 0x7F.
template <int Exponent, int Mantissa>
inline uint8_t float_to_fp8(float value) {
  constexpr int kBias = (1 << (Exponent - 1)) - 1;
  constexpr int kShift = 23 - Mantissa;
  if (std::isnan(value)) return 0x7F;
  uint32_t bits = float_bits(value);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  bits &= 0x7FFFFFFFu;
  uint32_t code;
  if (bits < static_cast<uint32_t>(1 - kBias + 127) << 23) {
    // below the smallest normal: a multiple of the subnormal step 2^(1 - bias - mantissa bits)
    const float steps = std::nearbyint(std::ldexp(std::abs(value), kBias - 1 + Mantissa));
    code = static_cast<uint32_t>(steps);  // 2^Mantissa steps is the smallest normal's code
  } else {
    const uint32_t odd = (bits >> kShift) & 1u;
    bits += (static_cast<uint32_t>(kBias - 127) << 23) + ((1u << (kShift - 1)) - 1u) + odd;
    code = bits >> kShift;
  }
  return static_cast<uint8_t>(code | sign);
}

template <typename Load>
void store_rows(const KVStoreArgs& a, Load load) {
  const int heads = a.num_kv_heads, dim = a.head_dim;
  const float limit = a.format == kInt8 ? 127.f : a.format == kFp8E4m3 ? 448.f : 57344.f;
  const int64_t rows = a.num_tokens * heads;
#pragma omp parallel for schedule(static) if (rows >= 256)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / heads;
    const int h = static_cast<int>(r % heads);
    const int64_t slot = a.slots[t];
    const int64_t block = slot / a.block_size, within = slot % a.block_size;
    uint8_t* record = a.records + block * a.record_bytes;
    uint8_t* data = record + within * a.token_bytes + static_cast<int64_t>(h) * dim;
    uint8_t* scale_at = record + a.block_size * a.token_bytes + (within * heads + h) * 2;
    float x[512];
    load(t, h, x);
    if (a.center != nullptr)
      for (int d = 0; d < dim; ++d) x[d] -= a.center[h * dim + d];
    float scale;
    if (a.head_scales != nullptr) {
      scale = a.head_scales[h];
    } else {
      float amax = 0.f;
      for (int d = 0; d < dim; ++d) amax = std::max(amax, std::abs(x[d]));
      scale = std::max(amax / limit, kTinyScale);
    }
    const uint16_t scale_bits = float_to_fp16_bits(scale);
    std::memcpy(scale_at, &scale_bits, sizeof(scale_bits));
    scale = fp16_to_float(scale_bits);
    if (a.format == kInt8) {
      for (int d = 0; d < dim; ++d) {
        const float q = std::min(127.f, std::max(-127.f, std::nearbyint(x[d] / scale)));
        data[d] = static_cast<uint8_t>(static_cast<int8_t>(q));
      }
    } else {
      for (int d = 0; d < dim; ++d) {
        const float y = std::min(limit, std::max(-limit, x[d] / scale));
        data[d] = a.format == kFp8E4m3 ? float_to_fp8<4, 3>(y) : float_to_fp8<5, 2>(y);
      }
    }
  }
}

}  // namespace

extern "C" {

// x: [num_tokens] rows of num_kv_heads * head_dim (x_dtype: 0 fp32, 1 bf16, 2 fp16), row stride
// x_token_stride elements; slots: [num_tokens] (block id * block_size + offset); records:
// [num_blocks][record_bytes]. Returns 1 for bad arguments.
int kvserve_kv_store(const KVStoreArgs* args) {
  const KVStoreArgs& a = *args;
  if (a.num_tokens < 0 || a.num_kv_heads <= 0 || a.head_dim <= 0 || a.head_dim > 512 || a.block_size <= 0 ||
      (a.format != kInt8 && a.format != kFp8E4m3 && a.format != kFp8E5m2) || a.x_dtype < kFloat32 || a.x_dtype > kFloat16 ||
      a.token_bytes < static_cast<int64_t>(a.num_kv_heads) * a.head_dim ||
      a.record_bytes < a.block_size * (a.token_bytes + 2 * static_cast<int64_t>(a.num_kv_heads)))
    return 1;
  for (int64_t t = 0; t < a.num_tokens; ++t)
    if (a.slots[t] < 0 || a.slots[t] >= a.num_blocks * a.block_size) return 1;
  const int dim = a.head_dim;
  if (a.x_dtype == kFloat32) {
    const float* x = static_cast<const float*>(a.x);
    store_rows(a, [&](int64_t t, int h, float* out) { std::memcpy(out, x + t * a.x_token_stride + h * dim, sizeof(float) * dim); });
  } else if (a.x_dtype == kBFloat16) {
    const uint16_t* x = static_cast<const uint16_t*>(a.x);
    store_rows(a, [&](int64_t t, int h, float* out) {
      const uint16_t* p = x + t * a.x_token_stride + h * dim;
      for (int d = 0; d < dim; ++d) {
        const uint32_t bits = static_cast<uint32_t>(p[d]) << 16;
        std::memcpy(out + d, &bits, sizeof(float));
      }
    });
  } else {
    const _Float16* x = static_cast<const _Float16*>(a.x);
    store_rows(a, [&](int64_t t, int h, float* out) {
      const _Float16* p = x + t * a.x_token_stride + h * dim;
      for (int d = 0; d < dim; ++d) out[d] = static_cast<float>(p[d]);
    });
  }
  return 0;
}

}  // extern "C"
