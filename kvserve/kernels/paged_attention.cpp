// Decode attention straight from the paged KV pool, for CPUs.
//
// One query token per sequence attends to its context through the block table: no gather of the
// sequence's K/V into contiguous memory, no padding to the batch's longest context, and sliding-
// window layers read only their window. Each (sequence, kv head) pair is one task; a task loads
// its group of query heads once, scores every visible key, takes the softmax in float32 and
// accumulates the values. Memory traffic is one read of each visible K and V row.
//
// Built by kvserve/kernels/build.py with -O3 -march=native -fopenmp and called through ctypes;
// the OpenMP runtime is the one torch already loaded (same soname), so threads are shared.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "args.h"
#include "kv_formats.h"
#include "simd.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KVSERVE_DECODE_BF16_DOT 1
#else
#define KVSERVE_DECODE_BF16_DOT 0
#endif

namespace {

using namespace kvserve;

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

// ---- any KV format (quantized records, KIVI's residual blocks): a row at a time, dequantized ------
// Each visible row is read as float into a head_dim buffer (kv_formats.h) and used at once: no
// widened copy of the context.
void decode_task_rows(float* out_rows, const float* queries, int group, const KVView& kv, const int64_t* table, int64_t first,
                      int64_t count, int kv_head, float scale, std::vector<float>& scores, std::vector<float>& acc,
                      std::vector<float>& row, float* lse) {
  const int dim = kv.head_dim;
  const int bs = kv.block_size;
  scores.resize(static_cast<size_t>(group) * count);
  row.resize(dim);
  for (int64_t i = 0; i < count;) {
    const int64_t position = first + i;
    const int64_t block = position / bs;
    BlockRows keys(kv, false, table[block]);
    for (int t = static_cast<int>(position - block * bs); t < bs && i < count; ++t, ++i) {
      keys.row(t, kv_head, row.data());
      for (int g = 0; g < group; ++g) scores[g * count + i] = dot(queries + static_cast<size_t>(g) * dim, row.data(), dim) * scale;
    }
  }
  std::vector<float> inv_sum(group);
  softmax_rows(scores.data(), group, count, inv_sum.data(), lse);
  acc.assign(static_cast<size_t>(group) * dim, 0.f);
  for (int64_t i = 0; i < count;) {
    const int64_t position = first + i;
    const int64_t block = position / bs;
    BlockRows values(kv, true, table[block]);
    for (int t = static_cast<int>(position - block * bs); t < bs && i < count; ++t, ++i) {
      values.row(t, kv_head, row.data());
      for (int g = 0; g < group; ++g) {
        const float weight = scores[g * count + i];
        float* a = acc.data() + static_cast<size_t>(g) * dim;
#pragma omp simd
        for (int d = 0; d < dim; ++d) a[d] += weight * row[d];
      }
    }
  }
  for (int g = 0; g < group; ++g)
    for (int d = 0; d < dim; ++d) out_rows[g * dim + d] = acc[g * dim + d] * inv_sum[g];
}

// ---- KIVI (int4 / int2) records, head_dim and value groups multiples of 16 ----------------------
// Keys: x = s_c (q - z_c) per channel c over a group of tokens, so a query's score is
// sum_c (query_c s_c) q_c - sum_c query_c s_c z_c: the query is scaled once per key group and each
// key costs its unpacked codes' dot product. Values: x = s (q - z) per token over value_group
// channels, so a probability p adds (p s) q to the accumulator and p s z to that channel group's
// offset, subtracted at the end. Residual blocks (full precision) are read as they are.
template <int G, int Bits>
void decode_task_kivi(float* out_rows, const float* queries, const KVView& kv, const int64_t* table, int64_t first,
                      int64_t count, int kv_head, float scale, std::vector<float>& scores, std::vector<float>& acc, float* lse) {
  const int dim = kv.head_dim, chunks = dim / 16, bs = kv.block_size, heads = kv.num_kv_heads;
  const int value_groups = dim / kv.value_group, chunks_per_group = kv.value_group / 16;
  const int64_t row_bytes = static_cast<int64_t>(dim) * Bits / 8;
  scores.resize(static_cast<size_t>(G) * count);
  float* s = scores.data();
  auto residual_row = [&](int64_t id, int64_t t) {  // element offset of a residual block's row
    return (id - kv.first_residual) * kv.residual_block_stride + t * kv.residual_token_stride + static_cast<int64_t>(kv_head) * dim;
  };
  auto load_residual = [&](const void* cache, int64_t at) {
    switch (kv.residual_dtype) {
      case kFloat32: return load16<kFloat32>(cache, at);
      case kFloat16: return load16<kFloat16>(cache, at);
      default: return load16<kBFloat16>(cache, at);
    }
  };
  std::vector<float> scaled(static_cast<size_t>(G) * dim);  // the query times a key group's channel scales
  float constant[G];
  for (int64_t i = 0; i < count;) {
    const int64_t position = first + i;
    const int64_t id = table[position / bs];
    int t = static_cast<int>(position % bs);
    if (id >= kv.first_residual) {
      for (; t < bs && i < count; ++t, ++i) {
        const int64_t at = residual_row(id, t);
        f32x16 a[G];
        for (int g = 0; g < G; ++g) a[g] = f32x16{};
        for (int c = 0; c < chunks; ++c) {
          const f32x16 k = load_residual(kv.residual_key, at + c * 16);
          for (int g = 0; g < G; ++g) {
            f32x16 q;
            std::memcpy(&q, queries + g * dim + c * 16, sizeof(q));
            a[g] += q * k;
          }
        }
        for (int g = 0; g < G; ++g) s[g * count + i] = hsum(a[g]) * scale;
      }
      continue;
    }
    const uint8_t* record = static_cast<const uint8_t*>(kv.key) + id * kv.block_stride;
    const uint8_t* meta = record + bs * kv.token_stride;
    while (t < bs && i < count) {
      const int key_group = t / kv.group_size;
      const uint8_t* pairs = meta + (static_cast<int64_t>(key_group) * heads + kv_head) * dim * 2;
      for (int g = 0; g < G; ++g) constant[g] = 0.f;
      for (int d = 0; d < dim; ++d) {
        const float channel_scale = log_scale(pairs[2 * d]);
        const float zero = static_cast<float>(static_cast<int8_t>(pairs[2 * d + 1]));
        for (int g = 0; g < G; ++g) {
          scaled[g * dim + d] = queries[g * dim + d] * channel_scale;
          constant[g] += scaled[g * dim + d] * zero;
        }
      }
      const int group_end = (key_group + 1) * kv.group_size;
      for (; t < group_end && i < count; ++t, ++i) {
        const uint8_t* codes = record + t * kv.token_stride + kv_head * row_bytes;
        f32x16 a[G];
        for (int g = 0; g < G; ++g) a[g] = f32x16{};
        for (int c = 0; c < chunks; ++c) {
          const f32x16 k = unpack16_codes<Bits>(codes + c * 16 * Bits / 8);
          for (int g = 0; g < G; ++g) {
            f32x16 q;
            std::memcpy(&q, scaled.data() + g * dim + c * 16, sizeof(q));
            a[g] += q * k;
          }
        }
        for (int g = 0; g < G; ++g) s[g * count + i] = (hsum(a[g]) - constant[g]) * scale;
      }
    }
  }

  float inv_sum[G];
  softmax_rows(s, G, count, inv_sum, lse);

  // values a block's run of rows at a time, one 16-dim chunk at a time in registers
  acc.assign(static_cast<size_t>(G) * dim, 0.f);
  std::vector<float> offset(static_cast<size_t>(G) * value_groups, 0.f);
  for (int64_t i = 0; i < count;) {
    const int64_t position = first + i;
    const int64_t id = table[position / bs];
    const int t0 = static_cast<int>(position % bs);
    const int run = static_cast<int>(std::min<int64_t>(bs - t0, count - i));
    const bool residual = id >= kv.first_residual;
    const uint8_t* record = residual ? nullptr : static_cast<const uint8_t*>(kv.value) + id * kv.block_stride;
    const uint8_t* pairs = residual ? nullptr : record + bs * kv.token_stride + (static_cast<int64_t>(t0) * heads + kv_head) * value_groups * 2;
    const int64_t pair_stride = static_cast<int64_t>(heads) * value_groups * 2;
    for (int c = 0; c < chunks; ++c) {
      const int vg = c / chunks_per_group;
      const bool first_of_group = c % chunks_per_group == 0;
      f32x16 a[G];
      for (int g = 0; g < G; ++g) std::memcpy(&a[g], acc.data() + g * dim + c * 16, sizeof(a[g]));
      for (int j = 0; j < run; ++j) {
        const float* p = s + i + j;
        if (residual) {
          const f32x16 v = load_residual(kv.residual_value, residual_row(id, t0 + j) + c * 16);
          for (int g = 0; g < G; ++g) a[g] += p[g * count] * v;
          continue;
        }
        const uint8_t* pair = pairs + j * pair_stride + 2 * vg;
        const float group_scale = log_scale(pair[0]);
        const f32x16 v = unpack16_codes<Bits>(record + (t0 + j) * kv.token_stride + kv_head * row_bytes + c * 16 * Bits / 8);
        for (int g = 0; g < G; ++g) {
          const float weight = p[g * count] * group_scale;
          a[g] += weight * v;
          if (first_of_group) offset[g * value_groups + vg] += weight * static_cast<float>(static_cast<int8_t>(pair[1]));
        }
      }
      for (int g = 0; g < G; ++g) std::memcpy(acc.data() + g * dim + c * 16, &a[g], sizeof(a[g]));
    }
    i += run;
  }
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < dim; ++d) out_rows[g * dim + d] = (acc[g * dim + d] - offset[g * value_groups + d / kv.value_group]) * inv_sum[g];
}

// true when a KIVI specialization handled the task
bool decode_task_kivi_dispatch(int group, float* out_rows, const float* queries, const KVView& kv, const int64_t* table,
                               int64_t first, int64_t count, int kv_head, float scale, std::vector<float>& scores,
                               std::vector<float>& acc, float* lse) {
  if ((kv.dtype != kInt4 && kv.dtype != kInt2) || kv.head_dim % 16 != 0 || kv.value_group % 16 != 0 || kv.group_size <= 0) return false;
  return with_group_size(group, [&](auto size) {
    constexpr int G = decltype(size)::value;
    if (kv.dtype == kInt4)
      decode_task_kivi<G, 4>(out_rows, queries, kv, table, first, count, kv_head, scale, scores, acc, lse);
    else
      decode_task_kivi<G, 2>(out_rows, queries, kv, table, first, count, kv_head, scale, scores, acc, lse);
    return true;
  });
}

inline bool plain_float_view(const KVView& kv) { return is_float_format(kv.dtype) && kv.first_residual >= (int64_t{1} << 62); }


// ---- vectorized path: head_dim a multiple of 16, group size known at compile time -------------

struct NextRun {
  int64_t offset = 0;  // element offset of the next run's first row
  int64_t run = 0;     // its length (0 at the end)
};

// Element offset of slot `position` of a sequence (block table `table`), kv head `kv_head`.
inline int64_t kv_offset(const KVView& kv, const int64_t* table, int64_t position, int kv_head) {
  return table[position / kv.block_size] * kv.block_stride + (position % kv.block_size) * kv.token_stride +
         static_cast<int64_t>(kv_head) * kv.head_dim;
}

// Calls fn(i, offset, run, next) for each run of consecutive positions inside one block: i is the
// index of the run's first position relative to `first`, offset the element offset of its first
// K/V row, next the run after it. Blocks are scattered through the pool, so the hardware
// prefetcher stalls at every block edge: the first run is prefetched here; with kBulkPrefetch the
// next run is too, all at once before each call, otherwise fn spreads those prefetches over its
// own loop (measured better where fn computes much per row).
template <bool kBulkPrefetch, typename Fn>
inline void for_each_block_run(const int64_t* table, int64_t first, int64_t count, int kv_head, const KVView& kv,
                               const void* cache, int elem_bytes, Fn fn) {
  const int64_t row_stride = kv.token_stride;
  const int64_t row_bytes = static_cast<int64_t>(kv.head_dim) * elem_bytes;
  const int block_size = kv.block_size;
  auto run_at = [&](int64_t i, int64_t& offset) {
    const int64_t position = first + i;
    const int64_t block = position / block_size;
    const int64_t within = position - block * block_size;
    offset = table[block] * kv.block_stride + within * kv.token_stride + static_cast<int64_t>(kv_head) * kv.head_dim;
    return std::min<int64_t>(block_size - within, count - i);
  };
  auto prefetch = [&](int64_t offset, int64_t run) {
    const char* base = static_cast<const char*>(cache) + offset * elem_bytes;
    for (int64_t j = 0; j < run; ++j)
      for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(base + j * row_stride * elem_bytes + byte);
  };
  int64_t i = 0;
  int64_t offset = 0;
  int64_t run = count > 0 ? run_at(0, offset) : 0;
  if (run) prefetch(offset, run);
  while (i < count) {
    const int64_t next = i + run;
    NextRun ahead;
    ahead.run = next < count ? run_at(next, ahead.offset) : 0;
    if (kBulkPrefetch && ahead.run) prefetch(ahead.offset, ahead.run);
    fn(i, offset, run, ahead);
    i = next;
    offset = ahead.offset;
    run = ahead.run;
  }
}

template <int G, int DT>
void decode_task_fast(float* out_rows, const float* queries, const KVView& kv, const int64_t* table, int64_t first,
                      int64_t count, int kv_head, float scale, std::vector<float>& scores, std::vector<float>& acc, float* lse) {
  const void* key_cache = kv.key;
  const void* value_cache = kv.value;
  const int head_dim = kv.head_dim;
  const int chunks = head_dim / 16;
  const int64_t row_stride = kv.token_stride;
  scores.resize(static_cast<size_t>(G) * count);
  float* s = scores.data();

  // int8 / fp8 records: a row's codes times its fp16 scale (kv_formats.h); keys' scales multiply the
  // scores, values' the probabilities
  constexpr bool kScaled = DT == kInt8 || DT == kFp8E4m3 || DT == kFp8E5m2;
  constexpr int kElemBytes = DT == kFloat32 ? 4 : kScaled ? 1 : 2;
  auto load = [](const void* cache, int64_t offset) {
    if constexpr (kScaled)
      return load16_codes<DT>(static_cast<const uint8_t*>(cache) + offset);
    else
      return load16<DT>(cache, offset);
  };
  // a run's row scales (kv_formats.h); 1 for float formats
  auto run_scales = [&](const void* cache, int64_t i0, int64_t base) { return RunScales(kv, cache, base, (first + i0) % kv.block_size, kv_head); };
  auto scale_at = [&](const RunScales& scales, int64_t j) {
    if constexpr (kScaled)
      return scales[j];
    else
      return 1.f;
  };
  const int64_t row_bytes = static_cast<int64_t>(head_dim) * kElemBytes;
  auto prefetch_bytes = [&](const void* cache, int64_t offset, int64_t from, int64_t to) {
    const char* row = static_cast<const char*>(cache) + offset * kElemBytes;
    for (int64_t byte = from; byte < to; byte += 64) __builtin_prefetch(row + byte, 0, 2);
  };
  for_each_block_run<false>(table, first, count, kv_head, kv, key_cache, kElemBytes, [&](int64_t i0, int64_t base, int64_t run, const NextRun& next) {
    // the next run's rows, spread over this run's keys
    for (int64_t j = run; j < next.run; ++j) prefetch_bytes(key_cache, next.offset + j * row_stride, 0, row_bytes);
    const RunScales key_scales = run_scales(key_cache, i0, base);
    for (int64_t j = 0; j < run; ++j) {
      if (j < next.run) prefetch_bytes(key_cache, next.offset + j * row_stride, 0, row_bytes);
      const int64_t offset = base + j * row_stride;
      f32x16 a[G], b[G];
      for (int g = 0; g < G; ++g) a[g] = b[g] = f32x16{};
      int c = 0;
      for (; c + 1 < chunks; c += 2) {
        const f32x16 k0 = load(key_cache, offset + c * 16);
        const f32x16 k1 = load(key_cache, offset + c * 16 + 16);
        for (int g = 0; g < G; ++g) {
          f32x16 q0, q1;
          std::memcpy(&q0, queries + g * head_dim + c * 16, sizeof(q0));
          std::memcpy(&q1, queries + g * head_dim + c * 16 + 16, sizeof(q1));
          a[g] += q0 * k0;
          b[g] += q1 * k1;
        }
      }
      if (c < chunks) {
        const f32x16 k0 = load(key_cache, offset + c * 16);
        for (int g = 0; g < G; ++g) {
          f32x16 q0;
          std::memcpy(&q0, queries + g * head_dim + c * 16, sizeof(q0));
          a[g] += q0 * k0;
        }
      }
      const float key_scale = scale * scale_at(key_scales, j);
      for (int g = 0; g < G; ++g) s[g * count + i0 + j] = hsum(a[g] + b[g]) * key_scale;
    }
  });

  float inv_sum[G];
  softmax_rows(s, G, count, inv_sum, lse);
  if constexpr (kScaled)
    for_each_block_run<false>(table, first, count, kv_head, kv, value_cache, kElemBytes, [&](int64_t i0, int64_t base, int64_t run, const NextRun&) {
      const RunScales value_scales = run_scales(value_cache, i0, base);
      for (int64_t j = 0; j < run; ++j) {
        const float value_scale = scale_at(value_scales, j);
        for (int g = 0; g < G; ++g) s[g * count + i0 + j] *= value_scale;
      }
    });

  acc.assign(static_cast<size_t>(G) * head_dim, 0.f);
  for_each_block_run<false>(table, first, count, kv_head, kv, value_cache, kElemBytes, [&](int64_t i0, int64_t base, int64_t run, const NextRun& next) {
    for (int c = 0; c < chunks; ++c) {
      // the next run's rows, this chunk's bytes of each
      for (int64_t j = 0; j < next.run; ++j)
        prefetch_bytes(value_cache, next.offset + j * row_stride, c * 16 * kElemBytes, (c + 1) * 16 * kElemBytes);
      f32x16 a[G], b[G];
      for (int g = 0; g < G; ++g) {
        std::memcpy(&a[g], acc.data() + g * head_dim + c * 16, sizeof(a[g]));
        b[g] = f32x16{};
      }
      int64_t j = 0;
      for (; j + 1 < run; j += 2) {
        const f32x16 v0 = load(value_cache, base + j * row_stride + c * 16);
        const f32x16 v1 = load(value_cache, base + (j + 1) * row_stride + c * 16);
        for (int g = 0; g < G; ++g) {
          a[g] += s[g * count + i0 + j] * v0;
          b[g] += s[g * count + i0 + j + 1] * v1;
        }
      }
      if (j < run) {
        const f32x16 v0 = load(value_cache, base + j * row_stride + c * 16);
        for (int g = 0; g < G; ++g) a[g] += s[g * count + i0 + j] * v0;
      }
      for (int g = 0; g < G; ++g) {
        f32x16 sum = a[g] + b[g];
        std::memcpy(acc.data() + g * head_dim + c * 16, &sum, sizeof(sum));
      }
    }
  });
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < head_dim; ++d) out_rows[g * head_dim + d] = acc[g * head_dim + d] * inv_sum[g];
}

template <int G>
bool decode_task_dispatch_dtype(float* out_rows, const float* queries, const KVView& kv, const int64_t* table, int64_t first,
                                int64_t count, int kv_head, float scale, std::vector<float>& scores, std::vector<float>& acc,
                                float* lse) {
  if (!is_float_format(kv.dtype) && !is_scaled_format(kv.dtype)) return false;
  return with_kv_dtype(kv.dtype, [&](auto dtype) {
    decode_task_fast<G, decltype(dtype)::value>(out_rows, queries, kv, table, first, count, kv_head, scale, scores, acc, lse);
    return true;
  });
}

// true when a vectorized specialization handled the task
bool decode_task_fast_dispatch(int group, float* out_rows, const float* queries, const KVView& kv, const int64_t* table,
                               int64_t first, int64_t count, int kv_head, float scale, std::vector<float>& scores,
                               std::vector<float>& acc, float* lse) {
  if (kv.head_dim % 16 != 0) return false;
  return with_group_size(group, [&](auto size) {
    return decode_task_dispatch_dtype<decltype(size)::value>(out_rows, queries, kv, table, first, count, kv_head, scale, scores, acc, lse);
  });
}


// ---- bf16 K/V and queries on a CPU with AVX512-BF16 ---------------------------------------------
// vdpbf16ps multiplies bf16 pairs straight from the pool (no widening to float). Scores: each key's
// G dot products are 16-lane partial sums, reduced 16 keys at a time by a transposing tree (~3
// instructions per score instead of a horizontal sum each). Values: rows i and i+1 are interleaved
// (unpack lo/hi), so one instruction adds p_i v_i + p_{i+1} v_{i+1} for 16 dims, with the
// probabilities rounded to bf16 as flash attention does for its P @ V; they are normalized by the
// sum of the rounded values, in float.
#if KVSERVE_DECODE_BF16_DOT

inline __m512 sum_pairs(__m512 a, __m512 b, const __m512i& lo, const __m512i& hi) {
  return _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
}

// v[0..15], one 16-lane partial-sum vector per key -> one vector of the 16 keys' totals
inline __m512 reduce16(__m512* v) {
  const __m512i lo1 = _mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i hi1 = _mm512_set_epi32(31, 30, 29, 28, 27, 26, 25, 24, 15, 14, 13, 12, 11, 10, 9, 8);
  const __m512i lo2 = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
  const __m512i hi2 = _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4);
  const __m512i lo3 = _mm512_set_epi32(29, 28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
  const __m512i hi3 = _mm512_set_epi32(31, 30, 27, 26, 23, 22, 19, 18, 15, 14, 11, 10, 7, 6, 3, 2);
  const __m512i lo4 = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i hi4 = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) w[i] = sum_pairs(v[2 * i], v[2 * i + 1], lo1, hi1);
  for (int i = 0; i < 4; ++i) x[i] = sum_pairs(w[2 * i], w[2 * i + 1], lo2, hi2);
  for (int i = 0; i < 2; ++i) y[i] = sum_pairs(x[2 * i], x[2 * i + 1], lo3, hi3);
  return sum_pairs(y[0], y[1], lo4, hi4);
}

inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(static_cast<const void*>(p)); }

// 32 elements of a K/V row from dim c * 32 on, as bf16: a bf16 row's own; int8 and fp8 codes are
// exact in bf16 (at most 8 significant bits, exponents in range), their scale applied apart
// what load_row_bh's values are to be multiplied by (besides the row's scale)
template <int DT>
constexpr float kCodeUnit = DT == kFp8E4m3 ? 256.f : 1.f;

template <int DT>
inline __m512bh load_row_bh(const uint8_t* row, int c) {
  if constexpr (DT == kBFloat16) {
    return (__m512bh)_mm512_loadu_si512(static_cast<const void*>(row + c * 64));
  } else if constexpr (DT == kFp8E4m3 || DT == kFp8E5m2) {
    // as fp16 bits: e5m2 is an fp16's top byte; e4m3's bits moved down by one exponent bit are an
    // fp16 of 2^-8 times its value, subnormals included (kCodeUnit puts the 2^8 back)
    const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 32)));
    __m512i half = _mm512_slli_epi16(codes, 8);
    if constexpr (DT == kFp8E4m3)
      half = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(codes, _mm512_set1_epi16(0x7F)), 7), _mm512_and_si512(half, _mm512_set1_epi16(-0x8000)));
    const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(half)), hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
    return _mm512_cvtne2ps_pbh(hi, lo);
  } else {
    const f32x16 lo = load16_codes<DT>(row + c * 32), hi = load16_codes<DT>(row + c * 32 + 16);
    return _mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo);
  }
}

template <int G, int DT>
void decode_task_bf16(float* out_rows, const uint16_t* queries, const KVView& kv, const int64_t* table, int64_t first,
                      int64_t count, int kv_head, float scale, std::vector<float>& scores, std::vector<uint16_t>& probs,
                      std::vector<float>& acc, float* lse) {
  // int8 / fp8 records: each row's fp16 scale multiplies its scores (keys) or probabilities (values)
  constexpr bool kScaled = DT != kBFloat16;
  constexpr int kElemBytes = kScaled ? 1 : 2;
  const uint8_t* key_cache = static_cast<const uint8_t*>(kv.key);
  const uint8_t* value_cache = static_cast<const uint8_t*>(kv.value);
  const int head_dim = kv.head_dim;
  // a run's row scales (kv_formats.h), times what load_row_bh's codes leave out
  auto run_scales = [&](const uint8_t* cache, int64_t i0, int64_t base) { return RunScales(kv, cache, base, (first + i0) % kv.block_size, kv_head); };
  auto scale_at = [&](const RunScales& scales, int64_t j) { return scales[j] * kCodeUnit<DT>; };
  const int chunks = head_dim / 32;
  const int64_t row_stride = kv.token_stride;
  scores.resize(static_cast<size_t>(G) * count);
  float* s = scores.data();

  const int row_lines = (head_dim * kElemBytes + 63) / 64;
  auto prefetch_row = [&](const uint8_t* cache, const NextRun& next, int64_t j) {
    if (j < next.run)
      for (int line = 0; line < row_lines; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(cache + (next.offset + j * row_stride) * kElemBytes) + line * 64, _MM_HINT_T1);
  };
  for_each_block_run<false>(table, first, count, kv_head, kv, key_cache, kElemBytes, [&](int64_t i0, int64_t base, int64_t run, const NextRun& next) {
    // the next run's rows, one per key scored here (and the rest after)
    for (int64_t j = run; j < next.run; ++j) prefetch_row(key_cache, next, j);
    const RunScales key_scales = run_scales(key_cache, i0, base);  // read only for int8 / fp8
    for (int64_t j0 = 0; j0 < run; j0 += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, run - j0));
      __m512 partial[G][16];
      for (int j = 0; j < 16; ++j) {
        if (j < n) prefetch_row(key_cache, next, j0 + j);
        if (j >= n) {
          for (int g = 0; g < G; ++g) partial[g][j] = _mm512_setzero_ps();
          continue;
        }
        const uint8_t* key = key_cache + (base + (j0 + j) * row_stride) * kElemBytes;
        __m512 a[G], b[G];
        for (int g = 0; g < G; ++g) a[g] = b[g] = _mm512_setzero_ps();
        int c = 0;
        for (; c + 1 < chunks; c += 2) {
          const __m512bh k0 = load_row_bh<DT>(key, c), k1 = load_row_bh<DT>(key, c + 1);
          for (int g = 0; g < G; ++g) {
            a[g] = _mm512_dpbf16_ps(a[g], load_bh(queries + g * head_dim + c * 32), k0);
            b[g] = _mm512_dpbf16_ps(b[g], load_bh(queries + g * head_dim + c * 32 + 32), k1);
          }
        }
        if (c < chunks) {
          const __m512bh k0 = load_row_bh<DT>(key, c);
          for (int g = 0; g < G; ++g) a[g] = _mm512_dpbf16_ps(a[g], load_bh(queries + g * head_dim + c * 32), k0);
        }
        for (int g = 0; g < G; ++g) partial[g][j] = _mm512_add_ps(a[g], b[g]);
      }
      const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
      __m512 factor = _mm512_set1_ps(scale);
      if constexpr (kScaled) {
        alignas(64) float row_scale[16] = {};
        for (int j = 0; j < n; ++j) row_scale[j] = scale * scale_at(key_scales, j0 + j);
        factor = _mm512_load_ps(row_scale);
      }
      for (int g = 0; g < G; ++g) _mm512_mask_storeu_ps(s + g * count + i0 + j0, keep, _mm512_mul_ps(reduce16(partial[g]), factor));
    }
  });

  // softmax in float; probabilities rounded to bf16 (after the value rows' scales, which the
  // normalization leaves out), pairs padded with a zero
  std::vector<float> value_scales(kScaled ? count + 16 : 0, 0.f);
  if constexpr (kScaled)
    for_each_block_run<false>(table, first, count, kv_head, kv, value_cache, kElemBytes, [&](int64_t i0, int64_t base, int64_t run, const NextRun&) {
      const RunScales scales = run_scales(value_cache, i0, base);
      for (int64_t j = 0; j < run; ++j) value_scales[i0 + j] = scale_at(scales, j);
    });
  const int64_t padded = count + (count & 1);
  probs.resize(static_cast<size_t>(G) * padded);
  float inv_sum[G];
  for (int g = 0; g < G; ++g) {
    float* row = s + g * count;
    uint16_t* p = probs.data() + g * padded;
    const float peak = row_max(row, count);
    f32x16 total = f32x16{};
    int64_t i = 0;
    for (; i + 16 <= count; i += 16) {
      f32x16 v;
      std::memcpy(&v, row + i, sizeof(v));
      v = exp16(v - peak);
      f32x16 weight = v;
      if constexpr (kScaled) {
        f32x16 row_scale;
        std::memcpy(&row_scale, value_scales.data() + i, sizeof(row_scale));
        weight = v * row_scale;
      }
      const __m512i bits = _mm512_castps_si512((__m512)weight);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i), _mm512_cvtepi32_epi16(rounded));
      total += kScaled ? v : (f32x16)_mm512_castsi512_ps(_mm512_slli_epi32(rounded, 16));
    }
    float tail = hsum(total);
    for (; i < count; ++i) {
      const float prob = fast_exp(row[i] - peak);
      p[i] = bf16_bits(kScaled ? prob * value_scales[i] : prob);
      uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
      float value;
      std::memcpy(&value, &bits, sizeof(value));
      tail += kScaled ? prob : value;
    }
    if (padded > count) p[count] = 0;
    inv_sum[g] = 1.f / tail;
    if (lse) lse[g] = peak + std::log(tail);
  }

  // acc: [G][chunks][2][16] float, dims in unpack order
  acc.assign(static_cast<size_t>(G) * chunks * 32, 0.f);
  const __m512i zero = _mm512_setzero_si512();
  for_each_block_run<false>(table, first, count, kv_head, kv, value_cache, kElemBytes, [&](int64_t i0, int64_t base, int64_t run, const NextRun& next) {
    for (int c = 0; c < chunks; ++c) {
      // the next run's rows, this chunk's bytes of each
      for (int64_t j = 0; j < next.run; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(value_cache + (next.offset + j * row_stride + c * 32) * kElemBytes), _MM_HINT_T1);
      __m512 lo[G], hi[G];
      for (int g = 0; g < G; ++g) {
        lo[g] = _mm512_loadu_ps(acc.data() + (g * chunks + c) * 32);
        hi[g] = _mm512_loadu_ps(acc.data() + (g * chunks + c) * 32 + 16);
      }
      for (int64_t j = 0; j < run; j += 2) {
        const __m512i v0 = (__m512i)load_row_bh<DT>(value_cache + (base + j * row_stride) * kElemBytes, c);
        const __m512i v1 = j + 1 < run ? (__m512i)load_row_bh<DT>(value_cache + (base + (j + 1) * row_stride) * kElemBytes, c) : zero;
        const __m512bh pair_lo = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
        const __m512bh pair_hi = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
        for (int g = 0; g < G; ++g) {
          const uint16_t* p = probs.data() + g * padded + i0 + j;
          const uint32_t both = j + 1 < run ? (static_cast<uint32_t>(p[1]) << 16) | p[0] : p[0];
          const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(both));
          lo[g] = _mm512_dpbf16_ps(lo[g], pair_lo, weight);
          hi[g] = _mm512_dpbf16_ps(hi[g], pair_hi, weight);
        }
      }
      for (int g = 0; g < G; ++g) {
        _mm512_storeu_ps(acc.data() + (g * chunks + c) * 32, lo[g]);
        _mm512_storeu_ps(acc.data() + (g * chunks + c) * 32 + 16, hi[g]);
      }
    }
  });
  // back to natural dim order: lo holds dims {0-3, 8-11, 16-19, 24-27}, hi {4-7, 12-15, 20-23, 28-31}
  const __m512i first_half = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second_half = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int g = 0; g < G; ++g) {
    const __m512 norm = _mm512_set1_ps(inv_sum[g]);
    for (int c = 0; c < chunks; ++c) {
      const __m512 lo = _mm512_loadu_ps(acc.data() + (g * chunks + c) * 32);
      const __m512 hi = _mm512_loadu_ps(acc.data() + (g * chunks + c) * 32 + 16);
      _mm512_storeu_ps(out_rows + g * head_dim + c * 32, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first_half, hi), norm));
      _mm512_storeu_ps(out_rows + g * head_dim + c * 32 + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second_half, hi), norm));
    }
  }
}

// true when the bf16 dot-product path handled the task
bool decode_task_bf16_dispatch(int group, const uint16_t* queries, float* out_rows, const KVView& kv, const int64_t* table,
                               int64_t first, int64_t count, int kv_head, float scale, std::vector<float>& scores,
                               std::vector<uint16_t>& probs, std::vector<float>& acc, float* lse) {
  if (kv.head_dim % 32 != 0) return false;
  if (kv.dtype != kBFloat16 && !is_scaled_format(kv.dtype)) return false;
  return with_group_size(group, [&](auto size) {
    return with_kv_dtype(kv.dtype, [&](auto dtype) {
      constexpr int DT = decltype(dtype)::value;
      if constexpr (DT == kBFloat16 || DT == kInt8 || DT == kFp8E4m3 || DT == kFp8E5m2) {
        decode_task_bf16<decltype(size)::value, DT>(out_rows, queries, kv, table, first, count, kv_head, scale, scores, probs, acc, lse);
        return true;
      } else {
        return false;
      }
    });
  });
}


// ---- KIVI (int4 / int2) records and bf16 queries on a CPU with AVX512-BF16 ----------------------
// A code n < 16 is exact in bf16 as 128 + n, whose bits are 0x4300 | n: codes become bf16 with an
// OR, and the 128 joins the zero point (x = s (q - z) = s ((128 + q) - (128 + z))). Keys: the
// query times a key group's channel scales, rounded to bf16 once per group and laid out in the
// lane order the codes unpack to, meets each key's codes in vdpbf16ps; its dot with 128 + z is
// the group's constant. Scores are reduced 16 keys at a time (reduce16). Values: two rows' codes
// interleaved per lane, times the pair of their probabilities scaled by the rows' value-group
// scales (rounded to bf16), and the same weights times 128 + z into the group's offset.
// Residual (bf16) blocks: keys against the plain query, values permuted into the codes' lanes.

// where kivi_key_codes puts dim d (0..63) of a 64-dim key chunk: vector (k0, k1) lane / 32, element lane % 32
template <int Bits>
constexpr int kivi_key_lane(int d) {
  return Bits == 4 ? (d % 2) * 32 + d / 2 : ((d % 4) / 2) * 32 + (d % 2) * 16 + d / 4;
}

// dim (within a 32-dim value chunk) of dword lane k (0..15) of value vector v (0, 1)
template <int Bits>
constexpr int kivi_value_lane_dim(int v, int k) {
  return Bits == 4 ? 2 * k + v : 4 * (k % 8) + 2 * v + k / 8;
}

// a key row's 64 dims from `codes` (64 * Bits / 8 bytes) as two vectors of 32 bf16 (128 + code)
template <int Bits>
inline void kivi_key_codes(const uint8_t* codes, __m512i& k0, __m512i& k1) {
  const __m512i bias = _mm512_set1_epi16(0x4300);
  if constexpr (Bits == 4) {
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
    k0 = _mm512_or_si512(_mm512_and_si512(bytes, _mm512_set1_epi16(0xF)), bias);
    k1 = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), bias);
  } else {
    const __m256i half = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    const __m512i bytes = _mm512_inserti64x4(_mm512_castsi256_si512(half), half, 1);
    const __m512i shift0 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i shift1 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    const __m512i mask = _mm512_set1_epi16(3);
    k0 = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi16(bytes, shift0), mask), bias);
    k1 = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi16(bytes, shift1), mask), bias);
  }
}

// 32 dims of two value rows (a, b: 32 * Bits / 8 bytes each) as two vectors of 16 bf16 pairs
// (row a's 128 + code, row b's) in kivi_value_lane_dim order
template <int Bits>
inline void kivi_value_codes(const uint8_t* a, const uint8_t* b, __m512i& v0, __m512i& v1) {
  const __m512i bias = _mm512_set1_epi32(0x43004300);
  __m512i pairs;
  if constexpr (Bits == 4) {
    pairs = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                            _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b))), 16));
    const __m512i mask = _mm512_set1_epi32(0x000F000F);
    v0 = _mm512_or_si512(_mm512_and_si512(pairs, mask), bias);
    v1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(pairs, 4), mask), bias);
  } else {
    const __m128i ra = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)), rb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
    pairs = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(ra, ra)), _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(rb, rb)), 16));
    const __m512i shift0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i shift1 = _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6);
    const __m512i mask = _mm512_set1_epi32(0x00030003);
    v0 = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi32(pairs, shift0), mask), bias);
    v1 = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi32(pairs, shift1), mask), bias);
  }
}

// 16 KIVI (scale byte, zero) pairs, one per dword lane's low 16 bits, as the scales and 128 + z:
// 2^((e - 160) / 8) = 2^(e / 8 - 20) times 2^((e % 8) / 8), the latter from an 8-entry table (bit
// for bit log_scale's value: scaling by a power of two is exact)
inline void kivi_pairs(__m512i pairs, __m512& scale, __m512& zero) {
  const __m512 fraction = _mm512_setr_ps(1.f, std::exp2(1 / 8.), std::exp2(2 / 8.), std::exp2(3 / 8.), std::exp2(4 / 8.), std::exp2(5 / 8.),
                                         std::exp2(6 / 8.), std::exp2(7 / 8.), 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f);
  const __m512i e = _mm512_and_si512(pairs, _mm512_set1_epi32(0xFF));
  const __m512 octave = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(e, 3), _mm512_set1_epi32(20)));
  scale = _mm512_scalef_ps(_mm512_permutexvar_ps(_mm512_and_si512(e, _mm512_set1_epi32(7)), fraction), octave);
  zero = _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 24)), _mm512_set1_ps(128.f));
}

// float -> bf16 (round to nearest even, as bf16_bits) -> float: the 16 bf16 and their values
inline __m256i round_bf16(__m512 x, __m512& rounded) {
  const __m256i bits = (__m256i)_mm512_cvtneps_pbh(x);
  rounded = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  return bits;
}

template <int G, int Bits>
void decode_task_kivi_bf16(float* out_rows, const uint16_t* queries, const KVView& kv, const int64_t* table, int64_t first,
                           int64_t count, int kv_head, float scale, std::vector<float>& scores, std::vector<uint16_t>& probs,
                           std::vector<float>& acc, float* lse) {
  const int dim = kv.head_dim, bs = kv.block_size, heads = kv.num_kv_heads;
  const int key_chunks = dim / 64, value_chunks = dim / 32, value_groups = dim / kv.value_group;
  const int64_t row_bytes = static_cast<int64_t>(dim) * Bits / 8;
  const uint16_t* residual_key = static_cast<const uint16_t*>(kv.residual_key);
  const uint16_t* residual_value = static_cast<const uint16_t*>(kv.residual_value);
  auto residual_row = [&](int64_t id, int64_t t) {  // element offset of a residual block's row
    return (id - kv.first_residual) * kv.residual_block_stride + t * kv.residual_token_stride + static_cast<int64_t>(kv_head) * dim;
  };
  auto prefetch_block = [&](const uint8_t* cache, int64_t position) {  // this head's rows of the block holding `position`
    if (position >= first + count) return;
    const int64_t id = table[position / bs];
    if (id >= kv.first_residual) return;
    const uint8_t* record = cache + id * kv.block_stride + kv_head * row_bytes;
    for (int t = 0; t < bs; ++t)
      for (int64_t byte = 0; byte < row_bytes; byte += 64) _mm_prefetch(reinterpret_cast<const char*>(record + t * kv.token_stride + byte), _MM_HINT_T1);
  };
  const uint8_t* key_cache = static_cast<const uint8_t*>(kv.key);
  const uint8_t* value_cache = static_cast<const uint8_t*>(kv.value);
  scores.resize(static_cast<size_t>(G) * count);
  float* s = scores.data();

  // scores
  alignas(64) uint16_t scaled[G][8][64];  // [g][key chunk][lane]: the query times the group's scales, bf16
  float constant[G];
  __m512i key_lanes[2];  // vpermw picks: key vector v's lanes from a chunk's 64 dims
  {
    alignas(64) uint16_t dims[2][32];
    for (int d = 0; d < 64; ++d) dims[kivi_key_lane<Bits>(d) / 32][kivi_key_lane<Bits>(d) % 32] = static_cast<uint16_t>(d);
    key_lanes[0] = _mm512_load_si512(dims[0]);
    key_lanes[1] = _mm512_load_si512(dims[1]);
  }
  for (int64_t i = 0; i < count;) {
    const int64_t position = first + i;
    const int64_t id = table[position / bs];
    int t = static_cast<int>(position % bs);
    const int run = static_cast<int>(std::min<int64_t>(bs - t, count - i));
    prefetch_block(key_cache, position + run);
    const bool residual = id >= kv.first_residual;
    const uint8_t* record = residual ? nullptr : key_cache + id * kv.block_stride;
    for (int done = 0; done < run;) {
      int span = run - done;  // keys of one key group (any number in a residual block)
      if (!residual) {
        const int key_group = t / kv.group_size;
        span = std::min(span, (key_group + 1) * kv.group_size - t);
        const uint8_t* pairs = record + bs * kv.token_stride + (static_cast<int64_t>(key_group) * heads + kv_head) * dim * 2;
        __m512 sums[G];
        for (int g = 0; g < G; ++g) sums[g] = _mm512_setzero_ps();
        for (int c = 0; c < key_chunks; ++c) {
          alignas(64) uint16_t natural[G][64];  // the scaled query's 64 dims in dim order
          for (int d = 0; d < 64; d += 16) {
            __m512 channel_scale, zero;
            kivi_pairs(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + (c * 64 + d) * 2))), channel_scale, zero);
            for (int g = 0; g < G; ++g) {
              const __m512 query = _mm512_castsi512_ps(_mm512_slli_epi32(
                  _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(queries + g * dim + c * 64 + d))), 16));
              __m512 rounded;
              _mm256_store_si256(reinterpret_cast<__m256i*>(natural[g] + d), round_bf16(_mm512_mul_ps(query, channel_scale), rounded));
              sums[g] = _mm512_fmadd_ps(rounded, zero, sums[g]);
            }
          }
          for (int g = 0; g < G; ++g) {
            const __m512i lo = _mm512_load_si512(natural[g]), hi = _mm512_load_si512(natural[g] + 32);
            _mm512_store_si512(scaled[g][c], _mm512_permutex2var_epi16(lo, key_lanes[0], hi));
            _mm512_store_si512(scaled[g][c] + 32, _mm512_permutex2var_epi16(lo, key_lanes[1], hi));
          }
        }
        for (int g = 0; g < G; ++g) constant[g] = _mm512_reduce_add_ps(sums[g]);
      }
      for (int j0 = 0; j0 < span; j0 += 16) {
        const int n = std::min(16, span - j0);
        __m512 partial[G][16];
        for (int j = 0; j < 16; ++j) {
          if (j >= n) {
            for (int g = 0; g < G; ++g) partial[g][j] = _mm512_setzero_ps();
            continue;
          }
          const int row = t + j0 + j;
          __m512 a[G], b[G];
          for (int g = 0; g < G; ++g) a[g] = b[g] = _mm512_setzero_ps();
          if (residual) {
            const uint8_t* key = reinterpret_cast<const uint8_t*>(residual_key + residual_row(id, row));
            for (int c = 0; c < value_chunks; ++c) {
              const __m512bh k = load_row_bh<kBFloat16>(key, c);
              for (int g = 0; g < G; ++g) a[g] = _mm512_dpbf16_ps(a[g], load_bh(queries + g * dim + c * 32), k);
            }
          } else {
            const uint8_t* codes = record + row * kv.token_stride + kv_head * row_bytes;
            for (int c = 0; c < key_chunks; ++c) {
              __m512i k0, k1;
              kivi_key_codes<Bits>(codes + c * 64 * Bits / 8, k0, k1);
              for (int g = 0; g < G; ++g) {
                a[g] = _mm512_dpbf16_ps(a[g], (__m512bh)_mm512_load_si512(scaled[g][c]), (__m512bh)k0);
                b[g] = _mm512_dpbf16_ps(b[g], (__m512bh)_mm512_load_si512(scaled[g][c] + 32), (__m512bh)k1);
              }
            }
          }
          for (int g = 0; g < G; ++g) partial[g][j] = _mm512_add_ps(a[g], b[g]);
        }
        const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
        const __m512 factor = _mm512_set1_ps(scale);
        for (int g = 0; g < G; ++g) {
          const __m512 offset = _mm512_set1_ps(residual ? 0.f : constant[g]);
          _mm512_mask_storeu_ps(s + g * count + i + done + j0, keep, _mm512_mul_ps(_mm512_sub_ps(reduce16(partial[g]), offset), factor));
        }
      }
      done += span;
      t += span;
    }
    i += run;
  }

  float inv_sum[G];
  softmax_rows(s, G, count, inv_sum, lse);

  // values: acc [G][value chunk][2][16] float, lanes in kivi_value_lane_dim order
  acc.assign(static_cast<size_t>(G) * value_chunks * 32, 0.f);
  __m512 offset[G][16];  // per value group: the weights times 128 + z, 16 rows' partial sums
  for (int g = 0; g < G; ++g)
    for (int vg = 0; vg < value_groups; ++vg) offset[g][vg] = _mm512_setzero_ps();
  alignas(64) uint16_t residual_index[2][32];  // vpermw picks for a residual row pair, per value vector
  for (int v = 0; v < 2; ++v)
    for (int k = 0; k < 16; ++k) {
      residual_index[v][2 * k] = static_cast<uint16_t>(kivi_value_lane_dim<Bits>(v, k));
      residual_index[v][2 * k + 1] = static_cast<uint16_t>(32 + kivi_value_lane_dim<Bits>(v, k));
    }
  const __m512i pick0 = _mm512_load_si512(residual_index[0]), pick1 = _mm512_load_si512(residual_index[1]);
  probs.resize(static_cast<size_t>(G) * 16 * (bs + 16));
  // byte offsets of 16 consecutive rows' value scale pairs within a record
  const __m512i row_offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                 _mm512_set1_epi32(heads * value_groups * 2));
  for (int64_t i = 0; i < count;) {
    const int64_t position = first + i;
    const int64_t id = table[position / bs];
    const int t0 = static_cast<int>(position % bs);
    const int run = static_cast<int>(std::min<int64_t>(bs - t0, count - i));
    prefetch_block(value_cache, position + run);
    const bool residual = id >= kv.first_residual;
    const uint8_t* record = residual ? nullptr : value_cache + id * kv.block_stride;
    const int padded = (run + 15) / 16 * 16;  // rows per weight row, zeros past the run
    const int weight_groups = residual ? 1 : value_groups;
    // weights [g][value group][row]: p, times the row's group scale, as bf16, 16 rows at a time
    uint16_t* weight = probs.data();
    for (int vg = 0; vg < weight_groups; ++vg)
      for (int j = 0; j < run; j += 16) {
        const __mmask16 rows = static_cast<__mmask16>(run - j >= 16 ? 0xFFFF : (1u << (run - j)) - 1);
        __m512 row_scale = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
        if (!residual) {
          const uint8_t* pair = record + bs * kv.token_stride + ((static_cast<int64_t>(t0 + j) * heads + kv_head) * value_groups + vg) * 2;
          kivi_pairs(_mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, row_offsets, pair, 1), row_scale, zero);
        }
        for (int g = 0; g < G; ++g) {
          __m512 rounded;
          const __m256i bits = round_bf16(_mm512_mul_ps(_mm512_maskz_loadu_ps(rows, s + g * count + i + j), row_scale), rounded);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(weight + (g * weight_groups + vg) * padded + j), bits);
          offset[g][vg] = _mm512_fmadd_ps(rounded, zero, offset[g][vg]);
        }
      }
    for (int c = 0; c < value_chunks; ++c) {
      const int vg = residual ? 0 : c * 32 / kv.value_group;
      __m512 lo[G], hi[G];
      for (int g = 0; g < G; ++g) {
        lo[g] = _mm512_loadu_ps(acc.data() + (g * value_chunks + c) * 32);
        hi[g] = _mm512_loadu_ps(acc.data() + (g * value_chunks + c) * 32 + 16);
      }
      for (int j = 0; j < run; j += 2) {
        const int other = j + 1 < run ? j + 1 : j;  // an odd run's last row pairs with itself, weight 0
        __m512i v0, v1;
        if (residual) {
          const __m512i a = _mm512_loadu_si512(residual_value + residual_row(id, t0 + j) + c * 32);
          const __m512i b = _mm512_loadu_si512(residual_value + residual_row(id, t0 + other) + c * 32);
          v0 = _mm512_permutex2var_epi16(a, pick0, b);
          v1 = _mm512_permutex2var_epi16(a, pick1, b);
        } else {
          kivi_value_codes<Bits>(record + (t0 + j) * kv.token_stride + kv_head * row_bytes + c * 32 * Bits / 8,
                                 record + (t0 + other) * kv.token_stride + kv_head * row_bytes + c * 32 * Bits / 8, v0, v1);
        }
        for (int g = 0; g < G; ++g) {
          uint32_t both;
          std::memcpy(&both, weight + (g * weight_groups + vg) * padded + j, sizeof(both));
          const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(both));
          lo[g] = _mm512_dpbf16_ps(lo[g], (__m512bh)v0, w);
          hi[g] = _mm512_dpbf16_ps(hi[g], (__m512bh)v1, w);
        }
      }
      for (int g = 0; g < G; ++g) {
        _mm512_storeu_ps(acc.data() + (g * value_chunks + c) * 32, lo[g]);
        _mm512_storeu_ps(acc.data() + (g * value_chunks + c) * 32 + 16, hi[g]);
      }
    }
    i += run;
  }
  for (int g = 0; g < G; ++g) {
    float group_offset[16];
    for (int vg = 0; vg < value_groups; ++vg) group_offset[vg] = _mm512_reduce_add_ps(offset[g][vg]);
    for (int c = 0; c < value_chunks; ++c) {
      const float chunk_offset = group_offset[c * 32 / kv.value_group];
      for (int v = 0; v < 2; ++v)
        for (int k = 0; k < 16; ++k)
          out_rows[g * dim + c * 32 + kivi_value_lane_dim<Bits>(v, k)] = (acc[(g * value_chunks + c) * 32 + v * 16 + k] - chunk_offset) * inv_sum[g];
    }
  }
}

// true when the bf16 KIVI path handled the task
bool decode_task_kivi_bf16_dispatch(int group, const uint16_t* queries, float* out_rows, const KVView& kv, const int64_t* table,
                                    int64_t first, int64_t count, int kv_head, float scale, std::vector<float>& scores,
                                    std::vector<uint16_t>& probs, std::vector<float>& acc, float* lse) {
  if ((kv.dtype != kInt4 && kv.dtype != kInt2) || kv.head_dim % 64 != 0 || kv.head_dim > 512 || kv.value_group % 32 != 0 ||
      kv.head_dim / kv.value_group > 16 || kv.group_size <= 0 || kv.residual_dtype != kBFloat16)
    return false;
  return with_group_size(group, [&](auto size) {
    constexpr int G = decltype(size)::value;
    if (kv.dtype == kInt4)
      decode_task_kivi_bf16<G, 4>(out_rows, queries, kv, table, first, count, kv_head, scale, scores, probs, acc, lse);
    else
      decode_task_kivi_bf16<G, 2>(out_rows, queries, kv, table, first, count, kv_head, scale, scores, probs, acc, lse);
    return true;
  });
}

#endif  // KVSERVE_DECODE_BF16_DOT


// ---- prefill: a chunk of queries against its paged context, flash-style -----------------------
// Keys are first unpacked to float, transposed in tiles of 16 positions ([tile][head_dim][16]) so
// a tile of 8 query rows scores 16 keys with broadcast-FMAs; values are unpacked to [pos][head_dim].
// Each task is (kv head, 8 query rows), rows ordered token-major then head within the group.

constexpr int kKeyTile = 16;
constexpr int kRowTile = 8;

struct PrefillBuffers {
  std::vector<float> keys_t;   // [kv_heads][tiles][head_dim][16]
  std::vector<float> values;   // [kv_heads][tiles * 16][head_dim]
  std::vector<uint32_t> keys_pairs;    // bf16 path: [kv_heads][tiles][head_dim / 2][16] (d pairs of one key)
  std::vector<uint32_t> values_pairs;  // bf16 path: [kv_heads][tiles][8][head_dim] (one d of two keys)
};

// head_pad: head_dim rounded up to 16; the padding is zero in keys, values and queries alike.
void unpack_context(PrefillBuffers& buf, const KVView& kv, const int64_t* table, int64_t key_base, int64_t context_end,
                    int head_pad) {
  const int num_kv_heads = kv.num_kv_heads;
  const int head_dim = kv.head_dim;
  const bool plain = plain_float_view(kv);
  const int64_t tiles = (context_end - key_base + kKeyTile - 1) / kKeyTile;
  const size_t per_head = static_cast<size_t>(tiles) * kKeyTile * head_pad;
  buf.keys_t.resize(per_head * num_kv_heads);
  buf.values.resize(per_head * num_kv_heads);
  const int64_t jobs = tiles * num_kv_heads;
#pragma omp parallel
  {
    std::vector<float> key_row(head_pad, 0.f);
#pragma omp for schedule(static)
    for (int64_t job = 0; job < jobs; ++job) {
      const int kv_head = static_cast<int>(job / tiles);
      const int64_t tile = job % tiles;
      float* kt = buf.keys_t.data() + kv_head * per_head + static_cast<size_t>(tile) * head_pad * kKeyTile;
      float* vt = buf.values.data() + kv_head * per_head + static_cast<size_t>(tile) * kKeyTile * head_pad;
      for (int j = 0; j < kKeyTile; ++j) {
        const int64_t position = key_base + tile * kKeyTile + j;
        float* v_row = vt + static_cast<size_t>(j) * head_pad;
        std::fill(v_row, v_row + head_pad, 0.f);
        if (position < 0 || position >= context_end) {
          for (int d = 0; d < head_pad; ++d) kt[d * kKeyTile + j] = 0.f;
          continue;
        }
        if (plain) {
          const int64_t offset = kv_offset(kv, table, position, kv_head);
          load_row(kv.key, kv.dtype, offset, head_dim, key_row.data());
          load_row(kv.value, kv.dtype, offset, head_dim, v_row);
        } else {
          const int64_t block = position / kv.block_size;
          const int t = static_cast<int>(position - block * kv.block_size);
          BlockRows(kv, false, table[block]).row(t, kv_head, key_row.data());
          BlockRows(kv, true, table[block]).row(t, kv_head, v_row);
        }
        for (int d = 0; d < head_pad; ++d) kt[d * kKeyTile + j] = key_row[d];
      }
    }
  }
}

inline float hmax(f32x16 v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, v[i]);
  return m;
}

void prefill_rows(const PrefillBuffers& buf, float* out_rows, const float* queries, int rows, int group,
                  int64_t first_token_position, int64_t row_base, int64_t key_base, int64_t tiles, int kv_head,
                  int head_dim, int window) {
  const int chunks = head_dim / 16;
  const size_t per_head = static_cast<size_t>(tiles) * kKeyTile * head_dim;
  const float* keys_t = buf.keys_t.data() + kv_head * per_head;
  const float* values = buf.values.data() + kv_head * per_head;
  int64_t q_pos[kRowTile];
  float m[kRowTile], l[kRowTile];
  for (int r = 0; r < kRowTile; ++r) {
    q_pos[r] = first_token_position + (row_base + std::min(r, rows - 1)) / group;
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  std::fill(out_rows, out_rows + static_cast<size_t>(kRowTile) * head_dim, 0.f);
  const int64_t newest = q_pos[rows - 1];
  const int64_t oldest_visible = window > 0 ? q_pos[0] - window + 1 : 0;
  const int64_t tile_lo = std::max<int64_t>(0, (oldest_visible - key_base) / kKeyTile);
  const int64_t tile_hi = std::min<int64_t>(tiles - 1, (newest - key_base) / kKeyTile);
  alignas(64) float probs[kRowTile][kKeyTile];

  for (int64_t tile = tile_lo; tile <= tile_hi; ++tile) {
    const float* kt = keys_t + static_cast<size_t>(tile) * head_dim * kKeyTile;
    f32x16 s[kRowTile];
    for (int r = 0; r < kRowTile; ++r) s[r] = f32x16{};
    for (int d = 0; d < head_dim; ++d) {
      f32x16 k;
      std::memcpy(&k, kt + d * kKeyTile, sizeof(k));
      for (int r = 0; r < kRowTile; ++r) s[r] += queries[r * head_dim + d] * k;
    }
    const int64_t tile_pos = key_base + tile * kKeyTile;
    // every row sees every key of the tile: no masking needed
    const bool whole = tile_pos >= 0 && tile_pos + kKeyTile - 1 <= q_pos[0] && (window <= 0 || tile_pos > newest - window);
    for (int r = 0; r < rows; ++r) {
      if (!whole) {
        bool any = false;
        for (int j = 0; j < kKeyTile; ++j) {
          const int64_t kp = tile_pos + j;
          const bool visible = kp <= q_pos[r] && (window <= 0 || kp > q_pos[r] - window) && kp >= 0;
          if (!visible) s[r][j] = -INFINITY;
          any |= visible;
        }
        if (!any) {
          std::fill(probs[r], probs[r] + kKeyTile, 0.f);
          continue;
        }
      }
      const float peak = std::max(m[r], hmax(s[r]));
      const float alpha = std::exp(m[r] - peak);  // 0 on the first visible tile (m = -inf)
      f32x16 p = exp16(s[r] - peak);
      if (!whole)
        for (int j = 0; j < kKeyTile; ++j)
          if (s[r][j] == -INFINITY) p[j] = 0.f;
      l[r] = l[r] * alpha + hsum(p);
      m[r] = peak;
      std::memcpy(probs[r], &p, sizeof(p));
      if (alpha != 1.f) {
        float* a = out_rows + static_cast<size_t>(r) * head_dim;
        for (int d = 0; d < head_dim; ++d) a[d] *= alpha;
      }
    }
    for (int r = rows; r < kRowTile; ++r) std::fill(probs[r], probs[r] + kKeyTile, 0.f);
    const float* vt = values + static_cast<size_t>(tile) * kKeyTile * head_dim;
    for (int c = 0; c < chunks; ++c) {
      f32x16 a[kRowTile];
      for (int r = 0; r < kRowTile; ++r) std::memcpy(&a[r], out_rows + r * head_dim + c * 16, sizeof(a[r]));
      for (int j = 0; j < kKeyTile; ++j) {
        f32x16 v;
        std::memcpy(&v, vt + j * head_dim + c * 16, sizeof(v));
        for (int r = 0; r < kRowTile; ++r) a[r] += probs[r][j] * v;
      }
      for (int r = 0; r < kRowTile; ++r) std::memcpy(out_rows + r * head_dim + c * 16, &a[r], sizeof(a[r]));
    }
  }
  for (int r = 0; r < rows; ++r) {
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int d = 0; d < head_dim; ++d) out_rows[r * head_dim + d] *= inv;
  }
}

#if KVSERVE_DECODE_BF16_DOT
// The bf16 prefill path (bf16 queries and pool, head_dim % 32 == 0): the context is copied without
// widening into pair layouts for vdpbf16ps. Scores: a key tile is [d pair][16 keys], so one
// instruction adds q[2p] k[2p] + q[2p+1] k[2p+1] for 16 keys. Values: a tile is [key pair][d],
// so one instruction adds p_i v_i + p_{i+1} v_{i+1} for 16 dims, with the probabilities rounded to
// bf16 (as flash attention does for P @ V). Half the instructions of the float path, half the bytes.
void unpack_context_bf16(PrefillBuffers& buf, const KVView& kv, const int64_t* table, int64_t key_base, int64_t context_end) {
  const uint16_t* key_cache = static_cast<const uint16_t*>(kv.key);
  const uint16_t* value_cache = static_cast<const uint16_t*>(kv.value);
  const int num_kv_heads = kv.num_kv_heads;
  const int head_dim = kv.head_dim;
  const int64_t tiles = (context_end - key_base + kKeyTile - 1) / kKeyTile;
  const size_t per_head = static_cast<size_t>(tiles) * kKeyTile * head_dim / 2;  // in 32-bit pairs
  buf.keys_pairs.resize(per_head * num_kv_heads);
  buf.values_pairs.resize(per_head * num_kv_heads);
  const int64_t jobs = tiles * num_kv_heads;
  const int pairs = head_dim / 2;
#pragma omp parallel for schedule(static)
  for (int64_t job = 0; job < jobs; ++job) {
    const int kv_head = static_cast<int>(job / tiles);
    const int64_t tile = job % tiles;
    uint32_t* kt = buf.keys_pairs.data() + kv_head * per_head + static_cast<size_t>(tile) * pairs * kKeyTile;
    uint16_t* vt = reinterpret_cast<uint16_t*>(buf.values_pairs.data() + kv_head * per_head + static_cast<size_t>(tile) * pairs * kKeyTile);
    for (int j = 0; j < kKeyTile; ++j) {
      const int64_t position = key_base + tile * kKeyTile + j;
      uint16_t* v_out = vt + static_cast<size_t>(j / 2) * head_dim * 2 + (j & 1);
      if (position < 0 || position >= context_end) {
        for (int p = 0; p < pairs; ++p) kt[p * kKeyTile + j] = 0;
        for (int d = 0; d < head_dim; ++d) v_out[2 * d] = 0;
        continue;
      }
      const int64_t offset = kv_offset(kv, table, position, kv_head);
      const uint32_t* k_row = reinterpret_cast<const uint32_t*>(key_cache + offset);
      for (int p = 0; p < pairs; ++p) kt[p * kKeyTile + j] = k_row[p];
      const uint16_t* v_row = value_cache + offset;
      for (int d = 0; d < head_dim; ++d) v_out[2 * d] = v_row[d];
    }
  }
}

// like prefill_rows, for kRowTileBf16 rows; queries: bf16 rows of head_dim (unscaled: the scale
// applies to the scores)
constexpr int kRowTileBf16 = 16;

void prefill_rows_bf16(const PrefillBuffers& buf, float* out_rows, const uint16_t* queries, int rows, int group,
                       int64_t first_token_position, int64_t row_base, int64_t key_base, int64_t tiles, int kv_head,
                       int head_dim, int window, float scale) {
  const int pairs = head_dim / 2;
  const int chunks = head_dim / 16;
  const size_t per_head = static_cast<size_t>(tiles) * kKeyTile * pairs;
  const uint32_t* keys = buf.keys_pairs.data() + kv_head * per_head;
  const uint32_t* values = buf.values_pairs.data() + kv_head * per_head;
  int64_t q_pos[kRowTileBf16];
  float m[kRowTileBf16], l[kRowTileBf16];
  for (int r = 0; r < kRowTileBf16; ++r) {
    q_pos[r] = first_token_position + (row_base + std::min(r, rows - 1)) / group;
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  std::fill(out_rows, out_rows + static_cast<size_t>(kRowTileBf16) * head_dim, 0.f);
  const int64_t newest = q_pos[rows - 1];
  const int64_t oldest_visible = window > 0 ? q_pos[0] - window + 1 : 0;
  const int64_t tile_lo = std::max<int64_t>(0, (oldest_visible - key_base) / kKeyTile);
  const int64_t tile_hi = std::min<int64_t>(tiles - 1, (newest - key_base) / kKeyTile);
  alignas(64) uint32_t prob_pairs[kRowTileBf16][kKeyTile / 2];
  const __m512 scale_v = _mm512_set1_ps(scale);

  for (int64_t tile = tile_lo; tile <= tile_hi; ++tile) {
    const uint32_t* kt = keys + static_cast<size_t>(tile) * pairs * kKeyTile;
    __m512 acc[kRowTileBf16];
    for (int r = 0; r < kRowTileBf16; ++r) acc[r] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; ++p) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(static_cast<const void*>(kt + p * kKeyTile));
      for (int r = 0; r < kRowTileBf16; ++r) {
        int32_t q;
        std::memcpy(&q, queries + r * head_dim + 2 * p, sizeof(q));
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(q), k);
      }
    }
    f32x16 s[kRowTileBf16];
    for (int r = 0; r < kRowTileBf16; ++r) s[r] = (f32x16)_mm512_mul_ps(acc[r], scale_v);
    const int64_t tile_pos = key_base + tile * kKeyTile;
    const bool whole = tile_pos >= 0 && tile_pos + kKeyTile - 1 <= q_pos[0] && (window <= 0 || tile_pos > newest - window);
    for (int r = 0; r < rows; ++r) {
      if (!whole) {
        bool any = false;
        for (int j = 0; j < kKeyTile; ++j) {
          const int64_t kp = tile_pos + j;
          const bool visible = kp <= q_pos[r] && (window <= 0 || kp > q_pos[r] - window) && kp >= 0;
          if (!visible) s[r][j] = -INFINITY;
          any |= visible;
        }
        if (!any) {
          std::fill(prob_pairs[r], prob_pairs[r] + kKeyTile / 2, 0u);
          continue;
        }
      }
      const float peak = std::max(m[r], _mm512_reduce_max_ps((__m512)s[r]));
      const float alpha = std::exp(m[r] - peak);  // 0 on the first visible tile (m = -inf)
      f32x16 p = exp16(s[r] - peak);
      if (!whole)
        for (int j = 0; j < kKeyTile; ++j)
          if (s[r][j] == -INFINITY) p[j] = 0.f;
      // round to bf16 (nearest even) and sum what is actually used
      const __m512i bits = _mm512_castps_si512((__m512)p);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(rounded, 16)));
      m[r] = peak;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prob_pairs[r]), _mm512_cvtepi32_epi16(rounded));
      if (alpha != 1.f) {
        float* a = out_rows + static_cast<size_t>(r) * head_dim;
        for (int d = 0; d < head_dim; d += 16) _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), _mm512_set1_ps(alpha)));
      }
    }
    for (int r = rows; r < kRowTileBf16; ++r) std::fill(prob_pairs[r], prob_pairs[r] + kKeyTile / 2, 0u);
    const uint32_t* vt = values + static_cast<size_t>(tile) * pairs * kKeyTile;
    for (int c = 0; c < chunks; ++c) {
      __m512 a[kRowTileBf16];
      for (int r = 0; r < kRowTileBf16; ++r) a[r] = _mm512_loadu_ps(out_rows + r * head_dim + c * 16);
      for (int kp = 0; kp < kKeyTile / 2; ++kp) {
        const __m512bh v = (__m512bh)_mm512_loadu_si512(static_cast<const void*>(vt + static_cast<size_t>(kp) * head_dim + c * 16));
        for (int r = 0; r < kRowTileBf16; ++r)
          a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(prob_pairs[r][kp])), v);
      }
      for (int r = 0; r < kRowTileBf16; ++r) _mm512_storeu_ps(out_rows + r * head_dim + c * 16, a[r]);
    }
  }
  for (int r = 0; r < rows; ++r) {
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int d = 0; d < head_dim; ++d) out_rows[r * head_dim + d] *= inv;
  }
}
#endif  // KVSERVE_DECODE_BF16_DOT

// Calls fn(kv_head, row_base, rows, offsets) in parallel for each tile of kRows query rows of
// each kv head; rows run token-major, then head within the group, and offsets[r] is the element
// offset of row r's [token][head][dim] vector in the query and the output. Later tiles see more
// keys: they are handed out first so the threads finish together.
template <int kRows, typename Fn>
void for_each_query_tile(int64_t rows_per_head, int group, int num_heads, int num_kv_heads, int head_dim, Fn fn) {
  const int64_t row_tiles = (rows_per_head + kRows - 1) / kRows;
  const int64_t tasks = row_tiles * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const int kv_head = static_cast<int>(task % num_kv_heads);
    const int64_t row_base = (row_tiles - 1 - task / num_kv_heads) * kRows;
    const int rows = static_cast<int>(std::min<int64_t>(kRows, rows_per_head - row_base));
    int64_t offsets[kRows];
    for (int r = 0; r < rows; ++r) {
      const int64_t token = (row_base + r) / group;
      const int head = kv_head * group + static_cast<int>((row_base + r) % group);
      offsets[r] = (token * num_heads + head) * head_dim;
    }
    fn(kv_head, row_base, rows, offsets);
  }
}

}  // namespace

extern "C" {

// Decode: see DecodeAttentionArgs. Each query attends to slots max(0, len - window) .. len - 1.
// A task is one sequence's KV head. A context of at least 2 * kSplitTokens slots is split at the
// multiples of kSplitTokens into parts that threads compute apart (flash-decoding: one long
// sequence, a model with one KV head, keep every thread busy); each part's output and log-sum-exp
// are merged after. The parts depend on the sequence's own context alone, never on the batch or
// the thread count, so a sequence decodes the same bits whatever it is batched with.
int kvserve_paged_decode_attention(const DecodeAttentionArgs* args) {
  constexpr int64_t kSplitTokens = 512;
  const DecodeAttentionArgs& a = *args;
  const KVView& kv = *a.kv;
  const int num_heads = a.num_heads, num_kv_heads = kv.num_kv_heads, head_dim = kv.head_dim, window = a.window;
  const int query_dtype = a.query_dtype, kv_dtype = kv.dtype;
  const float scale = a.scale;
  void* out = a.out;
  const void* query = a.query;
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || kv.block_size <= 0 || kv_dtype < 0 || kv_dtype > 7 ||
      head_dim > 512) return 1;
  const int group = num_heads / num_kv_heads;
  const int64_t tasks = a.num_seqs * num_kv_heads;

  struct Part {
    int64_t task, first, count;
    int index, parts;  // this part's index among its task's parts
  };
  std::vector<Part> work;
  work.reserve(static_cast<size_t>(tasks));
  int status = 0;
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t context = a.kv_lens[task / num_kv_heads];
    const int64_t first = window > 0 ? std::max<int64_t>(0, context - window) : 0;
    const int64_t count = context - first;
    if (count <= 0 || (context + kv.block_size - 1) / kv.block_size > a.max_blocks) {
      status = 2;
      continue;
    }
    if (count < 2 * kSplitTokens) {
      work.push_back({task, first, count, 0, 1});
      continue;
    }
    const int parts = static_cast<int>((context - 1) / kSplitTokens - first / kSplitTokens + 1);
    for (int p = 0; p < parts; ++p) {
      const int64_t from = std::max(first, (first / kSplitTokens + p) * kSplitTokens);
      const int64_t to = std::min(context, (first / kSplitTokens + p + 1) * kSplitTokens);
      work.push_back({task, from, to - from, p, parts});
    }
  }
  // split tasks' parts: outputs [part][group][head_dim] and log-sum-exps [part][group], by task
  std::vector<int64_t> part_base(static_cast<size_t>(tasks), -1);
  std::vector<int> part_count(static_cast<size_t>(tasks), 1);
  int64_t split_parts = 0;
  for (const Part& part : work)
    if (part.parts > 1 && part.index == 0) {
      part_base[part.task] = split_parts;
      part_count[part.task] = part.parts;
      split_parts += part.parts;
    }
  std::vector<float> part_out(static_cast<size_t>(split_parts) * group * head_dim), part_lse(static_cast<size_t>(split_parts) * group);

#pragma omp parallel
  {
    std::vector<float> queries(static_cast<size_t>(group) * head_dim);
    std::vector<float> row(head_dim);
    std::vector<float> acc(static_cast<size_t>(group) * head_dim);
    std::vector<float> result(static_cast<size_t>(group) * head_dim);
    std::vector<float> inv_sum(group), lse(group);
    std::vector<float> scores;
    std::vector<uint16_t> probs;

    // result (normalized) and lse for one part of one task
    auto attend = [&](int64_t seq, int kv_head, const int64_t* table, int64_t first, int64_t count) {
#if KVSERVE_DECODE_BF16_DOT
      if (query_dtype == kBFloat16 && ((kv_dtype == kBFloat16 && plain_float_view(kv)) || is_scaled_format(kv_dtype))) {
        const uint16_t* group_queries = static_cast<const uint16_t*>(query) + (seq * num_heads + kv_head * group) * head_dim;
        if (decode_task_bf16_dispatch(group, group_queries, result.data(), kv, table, first, count, kv_head, scale, scores, probs, acc,
                                      lse.data()))
          return;
      }
      if (query_dtype == kBFloat16 && (kv_dtype == kInt4 || kv_dtype == kInt2)) {
        const uint16_t* group_queries = static_cast<const uint16_t*>(query) + (seq * num_heads + kv_head * group) * head_dim;
        if (decode_task_kivi_bf16_dispatch(group, group_queries, result.data(), kv, table, first, count, kv_head, scale, scores, probs,
                                           acc, lse.data()))
          return;
      }
#endif
      for (int g = 0; g < group; ++g) {
        const int64_t q_offset = (seq * num_heads + kv_head * group + g) * head_dim;
        load_row(query, query_dtype, q_offset, head_dim, queries.data() + static_cast<size_t>(g) * head_dim);
      }
      // int8 / fp8 records take the float path's vectorized loop, KIVI records their own; other shapes a row at a time
      if (((plain_float_view(kv) || is_scaled_format(kv_dtype)) &&
           decode_task_fast_dispatch(group, result.data(), queries.data(), kv, table, first, count, kv_head, scale, scores, acc,
                                     lse.data())) ||
          decode_task_kivi_dispatch(group, result.data(), queries.data(), kv, table, first, count, kv_head, scale, scores, acc, lse.data()))
        return;
      if (!plain_float_view(kv)) {
        decode_task_rows(result.data(), queries.data(), group, kv, table, first, count, kv_head, scale, scores, acc, row, lse.data());
        return;
      }
      scores.resize(static_cast<size_t>(group) * count);
      for (int64_t i = 0; i < count; ++i) {
        load_row(kv.key, kv_dtype, kv_offset(kv, table, first + i, kv_head), head_dim, row.data());
        for (int g = 0; g < group; ++g)
          scores[g * count + i] = dot(queries.data() + static_cast<size_t>(g) * head_dim, row.data(), head_dim) * scale;
      }
      softmax_rows(scores.data(), group, count, inv_sum.data(), lse.data());
      acc.assign(static_cast<size_t>(group) * head_dim, 0.f);
      for (int64_t i = 0; i < count; ++i) {
        load_row(kv.value, kv_dtype, kv_offset(kv, table, first + i, kv_head), head_dim, row.data());
        for (int g = 0; g < group; ++g) {
          const float weight = scores[g * count + i];
          float* acc_row = acc.data() + static_cast<size_t>(g) * head_dim;
#pragma omp simd
          for (int d = 0; d < head_dim; ++d) acc_row[d] += weight * row[d];
        }
      }
      for (int g = 0; g < group; ++g)
        for (int d = 0; d < head_dim; ++d) result[g * head_dim + d] = acc[g * head_dim + d] * inv_sum[g];
    };
    auto store_rows = [&](int64_t seq, int kv_head, const float* rows) {
      for (int g = 0; g < group; ++g) {
        const int64_t o_offset = (seq * num_heads + kv_head * group + g) * head_dim;
        store_row(out, query_dtype, o_offset, head_dim, rows + static_cast<size_t>(g) * head_dim, 1.f);
      }
    };

#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < static_cast<int64_t>(work.size()); ++w) {
      const Part& part = work[w];
      const int64_t seq = part.task / num_kv_heads;
      const int kv_head = static_cast<int>(part.task % num_kv_heads);
      attend(seq, kv_head, a.block_tables + seq * a.max_blocks, part.first, part.count);
      if (part.parts == 1) {
        store_rows(seq, kv_head, result.data());
        continue;
      }
      const int64_t at = part_base[part.task] + part.index;
      std::memcpy(part_out.data() + at * group * head_dim, result.data(), sizeof(float) * group * head_dim);
      std::memcpy(part_lse.data() + at * group, lse.data(), sizeof(float) * group);
    }

    // merge: out = sum over parts of exp(lse_p - total) * out_p, total the log of the whole sum
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      if (part_base[task] < 0) continue;
      const int64_t base = part_base[task];
      const int parts = part_count[task];
      for (int g = 0; g < group; ++g) {
        float peak = -INFINITY;
        for (int p = 0; p < parts; ++p) peak = std::max(peak, part_lse[(base + p) * group + g]);
        float total = 0.f;
        for (int p = 0; p < parts; ++p) total += std::exp(part_lse[(base + p) * group + g] - peak);
        float* merged = result.data() + static_cast<size_t>(g) * head_dim;
        std::fill(merged, merged + head_dim, 0.f);
        for (int p = 0; p < parts; ++p) {
          const float weight = std::exp(part_lse[(base + p) * group + g] - peak) / total;
          const float* rows = part_out.data() + ((base + p) * group + g) * head_dim;
          for (int d = 0; d < head_dim; ++d) merged[d] += weight * rows[d];
        }
      }
      store_rows(task / num_kv_heads, static_cast<int>(task % num_kv_heads), result.data());
    }
  }
  return status;
}


// One prefill chunk of one sequence: see PrefillAttentionArgs.
int kvserve_paged_prefill_attention(const PrefillAttentionArgs* args) {
  const PrefillAttentionArgs& a = *args;
  const KVView& kv = *a.kv;
  const int num_heads = a.num_heads, num_kv_heads = kv.num_kv_heads, head_dim = kv.head_dim, window = a.window;
  const int query_dtype = a.query_dtype;
  const int64_t num_tokens = a.num_tokens, context_start = a.kv_start;
  const float scale = a.scale;
  void* out = a.out;
  const void* query = a.query;
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_tokens <= 0 || kv.dtype < 0 || kv.dtype > 7 || kv.block_size <= 0 ||
      head_dim > 512) return 1;
  if ((context_start + num_tokens + kv.block_size - 1) / kv.block_size > a.num_blocks) return 2;
  const int group = num_heads / num_kv_heads;
  const int64_t context_end = context_start + num_tokens;
  const int64_t oldest = window > 0 ? std::max<int64_t>(0, context_start - window + 1) : 0;
  const int64_t key_base = oldest - oldest % kKeyTile;
  const int64_t tiles = (context_end - key_base + kKeyTile - 1) / kKeyTile;
  thread_local PrefillBuffers caller_buffers;  // reused across calls; grown, never shrunk
  PrefillBuffers& buf = caller_buffers;  // a plain reference, so the worker threads share the caller's buffers
  const int64_t rows_per_head = num_tokens * group;
#if KVSERVE_DECODE_BF16_DOT
  if (query_dtype == kBFloat16 && kv.dtype == kBFloat16 && head_dim % 32 == 0 && plain_float_view(kv)) {
    unpack_context_bf16(buf, kv, a.block_table, key_base, context_end);
    for_each_query_tile<kRowTileBf16>(rows_per_head, group, num_heads, num_kv_heads, head_dim, [&](int kv_head, int64_t row_base, int rows, const int64_t* offsets) {
      thread_local std::vector<uint16_t> queries;
      thread_local std::vector<float> result;
      queries.assign(static_cast<size_t>(kRowTileBf16) * head_dim, 0);
      result.resize(static_cast<size_t>(kRowTileBf16) * head_dim);
      for (int r = 0; r < rows; ++r)
        std::memcpy(queries.data() + static_cast<size_t>(r) * head_dim, static_cast<const uint16_t*>(query) + offsets[r], sizeof(uint16_t) * head_dim);
      prefill_rows_bf16(buf, result.data(), queries.data(), rows, group, context_start, row_base, key_base, tiles, kv_head,
                        head_dim, window, scale);
      for (int r = 0; r < rows; ++r) store_row(out, query_dtype, offsets[r], head_dim, result.data() + static_cast<size_t>(r) * head_dim, 1.f);
    });
    return 0;
  }
#endif
  const int head_pad = (head_dim + 15) / 16 * 16;
  unpack_context(buf, kv, a.block_table, key_base, context_end, head_pad);
  for_each_query_tile<kRowTile>(rows_per_head, group, num_heads, num_kv_heads, head_dim, [&](int kv_head, int64_t row_base, int rows, const int64_t* offsets) {
    thread_local std::vector<float> queries;
    thread_local std::vector<float> result;
    queries.assign(static_cast<size_t>(kRowTile) * head_pad, 0.f);
    result.resize(static_cast<size_t>(kRowTile) * head_pad);
    for (int r = 0; r < rows; ++r) {
      float* q = queries.data() + static_cast<size_t>(r) * head_pad;
      load_row(query, query_dtype, offsets[r], head_dim, q);
      for (int d = 0; d < head_dim; ++d) q[d] *= scale;
    }
    prefill_rows(buf, result.data(), queries.data(), rows, group, context_start, row_base, key_base, tiles, kv_head, head_pad, window);
    for (int r = 0; r < rows; ++r) store_row(out, query_dtype, offsets[r], head_dim, result.data() + static_cast<size_t>(r) * head_pad, 1.f);
  });
  return 0;
}

}  // extern "C"
