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
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "args.h"
#include "kv_formats.h"
#include "simd.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KVSERVE_DECODE_BF16_DOT 1
#else
#define KVSERVE_DECODE_BF16_DOT 0
#endif

#if KVSERVE_DECODE_BF16_DOT && KVSERVE_AMX_SUPPORTED && !defined(KVSERVE_AMX_EMULATE)
#define KVSERVE_ATTENTION_AMX 1
#else
#define KVSERVE_ATTENTION_AMX 0
#endif

extern "C" int kvserve_amx_available();

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
    const uint8_t* record = quantized_record(kv, false, id);
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
    const uint8_t* record = residual ? nullptr : quantized_record(kv, true, id);
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


// ---- a tile of query rows over one KV head, head_dim a multiple of 16 ---------------------------
// Rows are a decode step's group of query heads, or a prefill tile's tokens times that group; row r
// sees slots [first[r], end[r]) of one sequence (one block table). Every row's arithmetic is fixed
// by its own range and the slots' positions, never by the other rows: keys are walked block by
// block from the start of the block holding the tile's first slot, a key's score is its own dot
// product, and values are paired at even offsets within a block (a slot outside a row's range
// weighs exactly 0 there, so it adds nothing). That is what lets a prefill tile share each key and
// value load among its tokens and still give each token the bits it would get decoding alone.

struct TileRows {
  int count;             // query rows
  const int64_t* first;  // [count]: the first visible slot of each row
  const int64_t* end;    // [count]: one past its last
  int64_t lo() const { return *std::min_element(first, first + count); }
  int64_t hi() const { return *std::max_element(end, end + count); }
};

struct TileScratch {
  std::vector<float> scores;   // [rows][span]: scores, then probabilities (the float path)
  std::vector<uint16_t> probs; // [rows][span + 1]: bf16 probabilities (the bf16 path)
  std::vector<float> acc;      // [rows][head_dim]
  std::vector<float> value_scales;
  std::vector<float> vectors;  // 64-byte vectors for the bf16 path (partial sums, value pairs)
  std::vector<uint16_t> staged_queries;  // the AMX path's B tiles of queries
  std::vector<uint16_t> staged_values;   // the AMX path's B tiles of value pairs

  // n zeroed 64-byte vectors of type V, aligned
  template <typename V>
  V* aligned(size_t n) {
    vectors.assign(n * 16 + 16, 0.f);
    const uintptr_t at = (reinterpret_cast<uintptr_t>(vectors.data()) + 63) & ~uintptr_t{63};
    return reinterpret_cast<V*>(at);
  }
};

// Element offset of the block of slot `position` (its first row, kv head kv_head).
inline int64_t block_offset(const KVView& kv, const int64_t* table, int64_t position, int kv_head) {
  return table[position / kv.block_size] * kv.block_stride + static_cast<int64_t>(kv_head) * kv.head_dim;
}

// Calls fn(block_start, begin, end, offset, next_offset) for each block of slots covering [lo, hi):
// the block's first slot, the part [begin, end) of it inside [lo, hi), the element offset of the
// block's first row and of the next block's (-1 at the end, for prefetching).
template <typename Fn>
inline void for_each_block(const KVView& kv, const int64_t* table, int64_t lo, int64_t hi, int kv_head, Fn fn) {
  const int bs = kv.block_size;
  for (int64_t start = lo - lo % bs; start < hi; start += bs) {
    const int64_t next = start + bs < hi ? block_offset(kv, table, start + bs, kv_head) : -1;
    fn(start, std::max(lo, start), std::min(hi, start + bs), block_offset(kv, table, start, kv_head), next);
  }
}

inline void prefetch_row(const void* cache, int64_t offset, int elem_bytes, int row_bytes) {
  const char* row = static_cast<const char*>(cache) + offset * elem_bytes;
  for (int byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(row + byte, 0, 2);
}

// softmax over each row's own range of scores [rows][span] (span from slot `base`); outside its
// range a row's entries become exactly 0. inv_sum[r], and lse[r] where given.
inline void tile_softmax(float* scores, int64_t span, int64_t base, const TileRows& rows, float* inv_sum, float* lse) {
  for (int r = 0; r < rows.count; ++r) {
    float* row = scores + r * span;
    const int64_t from = rows.first[r] - base, to = rows.end[r] - base;
    softmax_rows(row + from, 1, to - from, inv_sum + r, lse ? lse + r : nullptr);
    std::fill(row, row + from, 0.f);
    std::fill(row + to, row + span, 0.f);
  }
}

template <int RB, typename Load>
inline void float_scores_block(float* s, int64_t span, const float* queries, int head_dim, const void* key_cache, int64_t offset,
                               Load load, int64_t at, float key_scale) {
  const int chunks = head_dim / 16;
  f32x16 a[RB], b[RB];
  for (int r = 0; r < RB; ++r) a[r] = b[r] = f32x16{};
  int c = 0;
  for (; c + 1 < chunks; c += 2) {
    const f32x16 k0 = load(key_cache, offset + c * 16);
    const f32x16 k1 = load(key_cache, offset + c * 16 + 16);
    for (int r = 0; r < RB; ++r) {
      f32x16 q0, q1;
      std::memcpy(&q0, queries + r * head_dim + c * 16, sizeof(q0));
      std::memcpy(&q1, queries + r * head_dim + c * 16 + 16, sizeof(q1));
      a[r] += q0 * k0;
      b[r] += q1 * k1;
    }
  }
  if (c < chunks) {
    const f32x16 k0 = load(key_cache, offset + c * 16);
    for (int r = 0; r < RB; ++r) {
      f32x16 q0;
      std::memcpy(&q0, queries + r * head_dim + c * 16, sizeof(q0));
      a[r] += q0 * k0;
    }
  }
  for (int r = 0; r < RB; ++r) s[r * span + at] = hsum(a[r] + b[r]) * key_scale;
}

template <int RB, typename Load>
inline void float_values_block(float* acc, const float* p, int64_t span, int head_dim, int c, const void* value_cache, int64_t offset,
                               int64_t row_stride, Load load, int64_t at, int64_t from, int64_t to) {
  // pairs at even offsets of the block: slot j adds into a, j + 1 into b
  f32x16 a[RB], b[RB];
  for (int r = 0; r < RB; ++r) {
    std::memcpy(&a[r], acc + r * head_dim + c * 16, sizeof(a[r]));
    b[r] = f32x16{};
  }
  for (int64_t j = from - from % 2; j < to; j += 2) {
    const f32x16 v0 = j >= from ? load(value_cache, offset + j * row_stride + c * 16) : f32x16{};
    const f32x16 v1 = j + 1 < to ? load(value_cache, offset + (j + 1) * row_stride + c * 16) : f32x16{};
    for (int r = 0; r < RB; ++r) {
      a[r] += p[r * span + at + j] * v0;
      b[r] += p[r * span + at + j + 1] * v1;
    }
  }
  for (int r = 0; r < RB; ++r) {
    const f32x16 sum = a[r] + b[r];
    std::memcpy(acc + r * head_dim + c * 16, &sum, sizeof(sum));
  }
}

// fn(std::integral_constant<int, RB>{}, row) over the rows in blocks of up to 8
template <typename Fn>
inline void for_each_row_block(int rows, Fn fn) {
  int r = 0;
  for (; r + 8 <= rows; r += 8) fn(std::integral_constant<int, 8>{}, r);
  switch (rows - r) {
    case 7: fn(std::integral_constant<int, 7>{}, r); break;
    case 6: fn(std::integral_constant<int, 6>{}, r); break;
    case 5: fn(std::integral_constant<int, 5>{}, r); break;
    case 4: fn(std::integral_constant<int, 4>{}, r); break;
    case 3: fn(std::integral_constant<int, 3>{}, r); break;
    case 2: fn(std::integral_constant<int, 2>{}, r); break;
    case 1: fn(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// float queries [rows][head_dim] (unscaled); float or int8 / fp8 K/V. out_rows [rows][head_dim].
template <int DT>
void attend_tile_float(float* out_rows, float* lse, const float* queries, const TileRows& rows, const KVView& kv, const int64_t* table,
                       int kv_head, float scale, TileScratch& scratch) {
  constexpr bool kScaled = DT == kInt8 || DT == kFp8E4m3 || DT == kFp8E5m2;
  constexpr int kElemBytes = DT == kFloat32 ? 4 : kScaled ? 1 : 2;
  auto load = [](const void* cache, int64_t offset) {
    if constexpr (kScaled)
      return load16_codes<DT>(static_cast<const uint8_t*>(cache) + offset);
    else
      return load16<DT>(cache, offset);
  };
  auto row_scale = [&](const void* cache, int64_t offset, int64_t within) {
    if constexpr (kScaled)
      return RunScales(kv, cache, offset + within * kv.token_stride, within, kv_head)[0];
    else
      return 1.f;
  };
  const int head_dim = kv.head_dim;
  const int64_t row_stride = kv.token_stride;
  const int row_bytes = head_dim * kElemBytes;
  const int64_t lo = rows.lo(), hi = rows.hi();
  const int64_t base = lo - lo % kv.block_size, span = hi - base + 1;  // + 1: the pair past the last slot
  scratch.scores.resize(static_cast<size_t>(rows.count) * span);  // tile_softmax zeroes all but each row's range
  float* s = scratch.scores.data();

  for_each_block(kv, table, lo, hi, kv_head, [&](int64_t start, int64_t begin, int64_t end, int64_t offset, int64_t next) {
    for (int64_t j = begin - start; j < end - start; ++j) {
      if (next >= 0) prefetch_row(kv.key, next + j * row_stride, kElemBytes, row_bytes);
      const float key_scale = scale * row_scale(kv.key, offset, j);
      for_each_row_block(rows.count, [&](auto size, int r0) {
        float_scores_block<decltype(size)::value>(s + r0 * span, span, queries + static_cast<size_t>(r0) * head_dim, head_dim, kv.key,
                                                  offset + j * row_stride, load, start + j - base, key_scale);
      });
    }
  });

  std::vector<float> inv_sum(rows.count);
  tile_softmax(s, span, base, rows, inv_sum.data(), lse);
  if constexpr (kScaled)
    for_each_block(kv, table, lo, hi, kv_head, [&](int64_t start, int64_t begin, int64_t end, int64_t offset, int64_t) {
      for (int64_t j = begin - start; j < end - start; ++j) {
        const float value_scale = row_scale(kv.value, offset, j);
        for (int r = 0; r < rows.count; ++r) s[r * span + start + j - base] *= value_scale;
      }
    });

  scratch.acc.assign(static_cast<size_t>(rows.count) * head_dim, 0.f);
  float* acc = scratch.acc.data();
  for_each_block(kv, table, lo, hi, kv_head, [&](int64_t start, int64_t begin, int64_t end, int64_t offset, int64_t next) {
    for (int c = 0; c < head_dim / 16; ++c) {
      if (next >= 0)
        for (int64_t j = 0; j < kv.block_size; ++j) __builtin_prefetch(static_cast<const char*>(kv.value) + (next + j * row_stride + c * 16) * kElemBytes, 0, 2);
      for_each_row_block(rows.count, [&](auto size, int r0) {
        float_values_block<decltype(size)::value>(acc + static_cast<size_t>(r0) * head_dim, s + r0 * span, span, head_dim, c, kv.value,
                                                  offset, row_stride, load, start - base, begin - start, end - start);
      });
    }
  });
  for (int r = 0; r < rows.count; ++r)
    for (int d = 0; d < head_dim; ++d) out_rows[r * head_dim + d] = acc[r * head_dim + d] * inv_sum[r];
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

// bf16 queries [rows][head_dim] over bf16 or int8 / fp8 K/V, head_dim a multiple of 32 (see the
// section's comment for the arithmetic; TileRows for what fixes a row's bits).
template <int RB, int DT>
inline void bf16_partials_block(__m512* partial, const uint16_t* queries, int head_dim, const uint8_t* key, int j) {
  const int chunks = head_dim / 32;
  __m512 a[RB], b[RB];
  for (int r = 0; r < RB; ++r) a[r] = b[r] = _mm512_setzero_ps();
  int c = 0;
  for (; c + 1 < chunks; c += 2) {
    const __m512bh k0 = load_row_bh<DT>(key, c), k1 = load_row_bh<DT>(key, c + 1);
    for (int r = 0; r < RB; ++r) {
      a[r] = _mm512_dpbf16_ps(a[r], load_bh(queries + r * head_dim + c * 32), k0);
      b[r] = _mm512_dpbf16_ps(b[r], load_bh(queries + r * head_dim + c * 32 + 32), k1);
    }
  }
  if (c < chunks) {
    const __m512bh k0 = load_row_bh<DT>(key, c);
    for (int r = 0; r < RB; ++r) a[r] = _mm512_dpbf16_ps(a[r], load_bh(queries + r * head_dim + c * 32), k0);
  }
  for (int r = 0; r < RB; ++r) partial[r * 16 + j] = _mm512_add_ps(a[r], b[r]);
}

template <int RB>
inline void bf16_values_block(float* acc, const uint16_t* p, int64_t pitch, int chunks, int c, const __m512bh* pairs_lo,
                              const __m512bh* pairs_hi, int pair_count, int64_t at) {
  __m512 lo[RB], hi[RB];
  for (int r = 0; r < RB; ++r) {
    lo[r] = _mm512_loadu_ps(acc + (r * chunks + c) * 32);
    hi[r] = _mm512_loadu_ps(acc + (r * chunks + c) * 32 + 16);
  }
  for (int i = 0; i < pair_count; ++i)
    for (int r = 0; r < RB; ++r) {
      uint32_t both;
      std::memcpy(&both, p + r * pitch + at + 2 * i, sizeof(both));
      const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(both));
      lo[r] = _mm512_dpbf16_ps(lo[r], pairs_lo[i], weight);
      hi[r] = _mm512_dpbf16_ps(hi[r], pairs_hi[i], weight);
    }
  for (int r = 0; r < RB; ++r) {
    _mm512_storeu_ps(acc + (r * chunks + c) * 32, lo[r]);
    _mm512_storeu_ps(acc + (r * chunks + c) * 32 + 16, hi[r]);
  }
}

// Softmax in float over each row's range of scores s [rows][span] (slot base + i at column i);
// the probabilities rounded to bf16 into probs [rows][pitch] (after the value rows' scales, which
// the normalization leaves out: kScaled), 0 outside the range up to pitch. inv_sum[r] = 1 / the sum
// of what each row's values are weighed by; lse[r] where given.
template <bool kScaled>
void bf16_probabilities(const float* s, int64_t span, int64_t base, const TileRows& rows, const float* value_scales, uint16_t* probs,
                        int64_t pitch, float* inv_sum, float* lse) {
  const int count = rows.count;
  for (int r = 0; r < count; ++r) {
    const int64_t from = rows.first[r] - base, length = rows.end[r] - rows.first[r];
    const float* row = s + r * span + from;
    uint16_t* p = probs + r * pitch + from;
    const float* row_scales = kScaled ? value_scales + from : nullptr;
    std::fill(p - from, p, uint16_t{0});  // outside the row's range, and the pad slots: weight 0
    std::fill(p + length, p - from + pitch, uint16_t{0});
    const float peak = row_max(row, length);
    f32x16 total = f32x16{};
    int64_t i = 0;
    for (; i + 16 <= length; i += 16) {
      f32x16 v;
      std::memcpy(&v, row + i, sizeof(v));
      v = exp16(v - peak);
      f32x16 weight = v;
      if constexpr (kScaled) {
        f32x16 value_scale;
        std::memcpy(&value_scale, row_scales + i, sizeof(value_scale));
        weight = v * value_scale;
      }
      const __m512i bits = _mm512_castps_si512((__m512)weight);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i), _mm512_cvtepi32_epi16(rounded));
      total += kScaled ? v : (f32x16)_mm512_castsi512_ps(_mm512_slli_epi32(rounded, 16));
    }
    float tail = hsum(total);
    for (; i < length; ++i) {
      const float prob = fast_exp(row[i] - peak);
      p[i] = bf16_bits(kScaled ? prob * row_scales[i] : prob);
      uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
      float value;
      std::memcpy(&value, &bits, sizeof(value));
      tail += kScaled ? prob : value;
    }
    inv_sum[r] = 1.f / tail;
    if (lse) lse[r] = peak + std::log(tail);
  }
}

// acc [rows][chunks][2][16] in unpack order -> out_rows [rows][chunks * 32] in dim order, times inv_sum
inline void write_unpacked(float* out_rows, const float* acc, int count, int chunks, const float* inv_sum) {
  const int head_dim = chunks * 32;
  // natural dim order: lo holds dims {0-3, 8-11, 16-19, 24-27}, hi {4-7, 12-15, 20-23, 28-31}
  const __m512i first_half = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second_half = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int r = 0; r < count; ++r) {
    const __m512 norm = _mm512_set1_ps(inv_sum[r]);
    for (int c = 0; c < chunks; ++c) {
      const __m512 l = _mm512_loadu_ps(acc + (r * chunks + c) * 32);
      const __m512 h = _mm512_loadu_ps(acc + (r * chunks + c) * 32 + 16);
      _mm512_storeu_ps(out_rows + r * head_dim + c * 32, _mm512_mul_ps(_mm512_permutex2var_ps(l, first_half, h), norm));
      _mm512_storeu_ps(out_rows + r * head_dim + c * 32 + 16, _mm512_mul_ps(_mm512_permutex2var_ps(l, second_half, h), norm));
    }
  }
}

template <int DT>
void attend_tile_bf16(float* out_rows, float* lse, const uint16_t* queries, const TileRows& rows, const KVView& kv, const int64_t* table,
                      int kv_head, float scale, TileScratch& scratch) {
  // int8 / fp8 records: each row's fp16 scale multiplies its scores (keys) or probabilities (values)
  constexpr bool kScaled = DT != kBFloat16;
  constexpr int kElemBytes = kScaled ? 1 : 2;
  const uint8_t* key_cache = static_cast<const uint8_t*>(kv.key);
  const uint8_t* value_cache = static_cast<const uint8_t*>(kv.value);
  auto scale_at = [&](const uint8_t* cache, int64_t offset, int64_t within) {
    return RunScales(kv, cache, offset + within * kv.token_stride, within, kv_head)[0] * kCodeUnit<DT>;
  };
  const int head_dim = kv.head_dim, chunks = head_dim / 32, count = rows.count;
  const int64_t row_stride = kv.token_stride;
  const int row_bytes = head_dim * kElemBytes;
  const int64_t lo = rows.lo(), hi = rows.hi();
  const int64_t base = lo - lo % kv.block_size, span = hi - base;
  scratch.scores.resize(static_cast<size_t>(count) * span);  // every row's range is written before it is read
  float* s = scratch.scores.data();

  // scores, 16 keys at a time from each block's start
  __m512* partial = scratch.aligned<__m512>(static_cast<size_t>(count) * 16);
  for_each_block(kv, table, lo, hi, kv_head, [&](int64_t start, int64_t begin, int64_t end, int64_t offset, int64_t next) {
    for (int64_t j0 = 0; start + j0 < end; j0 += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, end - start - j0));
      if (start + j0 + n <= begin) continue;
      alignas(64) float factor[16];
      for (int j = 0; j < 16; ++j) {
        const int64_t slot = start + j0 + j;
        factor[j] = scale;
        if (j >= n || slot < begin) {
          for (int r = 0; r < count; ++r) partial[r * 16 + j] = _mm512_setzero_ps();
          continue;
        }
        if (next >= 0) prefetch_row(key_cache, next + (j0 + j) * row_stride, kElemBytes, row_bytes);
        if constexpr (kScaled) factor[j] = scale * scale_at(key_cache, offset, j0 + j);
        const uint8_t* key = key_cache + (offset + (j0 + j) * row_stride) * kElemBytes;
        for_each_row_block(count, [&](auto size, int r0) {
          bf16_partials_block<decltype(size)::value, DT>(partial + r0 * 16, queries + static_cast<size_t>(r0) * head_dim, head_dim, key, j);
        });
      }
      const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
      const __m512 by = _mm512_load_ps(factor);
      for (int r = 0; r < count; ++r) _mm512_mask_storeu_ps(s + r * span + start + j0 - base, keep, _mm512_mul_ps(reduce16(partial + r * 16), by));
    }
  });

  // softmax in float over each row's range; probabilities rounded to bf16 (after the value rows'
  // scales, which the normalization leaves out); 0 outside the range and in the pad slot
  std::vector<float>& value_scales = scratch.value_scales;
  if constexpr (kScaled) {
    value_scales.assign(span + 16, 0.f);
    for_each_block(kv, table, lo, hi, kv_head, [&](int64_t start, int64_t begin, int64_t end, int64_t offset, int64_t) {
      for (int64_t j = begin - start; j < end - start; ++j) value_scales[start + j - base] = scale_at(value_cache, offset, j);
    });
  }
  const int64_t pitch = span + 2;
  scratch.probs.resize(static_cast<size_t>(count) * pitch);
  std::vector<float> inv_sum(count);
  bf16_probabilities<kScaled>(s, span, base, rows, value_scales.data(), scratch.probs.data(), pitch, inv_sum.data(), lse);

  // values: acc [rows][chunks][2][16] float, dims in unpack order; slots paired at even offsets of
  // a block, a slot outside [lo, hi) read as zeros
  scratch.acc.assign(static_cast<size_t>(count) * chunks * 32, 0.f);
  float* acc = scratch.acc.data();
  const __m512i zero = _mm512_setzero_si512();
  const int max_pairs = (kv.block_size + 1) / 2;
  __m512bh* pairs_lo = scratch.aligned<__m512bh>(2 * static_cast<size_t>(max_pairs));
  __m512bh* pairs_hi = pairs_lo + max_pairs;
  for_each_block(kv, table, lo, hi, kv_head, [&](int64_t start, int64_t begin, int64_t end, int64_t offset, int64_t next) {
    const int64_t from = (begin - start) - (begin - start) % 2, to = end - start;
    const int pair_count = static_cast<int>((to - from + 1) / 2);
    for (int c = 0; c < chunks; ++c) {
      if (next >= 0)
        for (int64_t j = 0; j < kv.block_size; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(value_cache + (next + j * row_stride + c * 32) * kElemBytes), _MM_HINT_T1);
      for (int i = 0; i < pair_count; ++i) {
        const int64_t j = from + 2 * i;
        const __m512i v0 = start + j >= begin ? (__m512i)load_row_bh<DT>(value_cache + (offset + j * row_stride) * kElemBytes, c) : zero;
        const __m512i v1 = j + 1 < to ? (__m512i)load_row_bh<DT>(value_cache + (offset + (j + 1) * row_stride) * kElemBytes, c) : zero;
        pairs_lo[i] = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
        pairs_hi[i] = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
      }
      for_each_row_block(count, [&](auto size, int r0) {
        bf16_values_block<decltype(size)::value>(acc + static_cast<size_t>(r0) * chunks * 32, scratch.probs.data() + r0 * pitch, pitch, chunks,
                                                 c, pairs_lo, pairs_hi, pair_count, start + from - base);
      });
    }
  });
  write_unpacked(out_rows, acc, count, chunks, inv_sum.data());
}

#if KVSERVE_ATTENTION_AMX
// ---- bf16 K/V and queries on AMX tiles ----------------------------------------------------------
// The per-row contract of the tile paths above, on TDPBF16PS. Scores: C[key][row] = K x Q^T, the
// A tile 16 consecutive slots of one block straight from the pool (32 dims), the B tile 32 dims of
// 16 query rows as VNNI pairs, accumulated over head_dim in increasing order; a score depends on
// its key row and query row alone, whatever else shares the tiles. Softmax as the AVX512-BF16 path
// (bf16_probabilities). Values: C[row][dim] += P x V over steps of 32 slots that begin at
// multiples of 32 of the position, the A tile 16 rows' bf16 probabilities, the B tile the step's
// value rows paired (unpack order, as the AVX512-BF16 path's accumulator). A step before a row's
// range adds exact zeros to a zero accumulator, and one after it exact zeros, so where a tile
// starts (a decode row's own range, a prefill tile's first row's) never changes a row's bits.
// Needs head_dim a multiple of 32, block_size a multiple of 16 and at most 64 rows per tile.

constexpr int kAmxTileRowsMax = 64;

// a 16 x 16 matrix of 32-bit elements, rows 64 bytes apart: out[j] = column j of in
inline void transpose16x16(const __m512* in, __m512i* out) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(_mm512_castps_si512(in[2 * i]), _mm512_castps_si512(in[2 * i + 1]));
    t[2 * i + 1] = _mm512_unpackhi_epi32(_mm512_castps_si512(in[2 * i]), _mm512_castps_si512(in[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i)
    for (int h = 0; h < 2; ++h) {
      u[4 * i + h] = _mm512_unpacklo_epi64(t[4 * i + h], t[4 * i + 2 + h]);
      u[4 * i + 2 + h] = _mm512_unpackhi_epi64(t[4 * i + h], t[4 * i + 2 + h]);
    }
  // u[4i + m] holds, per 128-bit lane l, the 4 elements of column 4l + kColumn[m] from rows 4i .. 4i + 3
  constexpr int kColumn[4] = {0, 2, 1, 3};
  const __m512i lo_pairs = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), hi_pairs = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  const __m512i lo_halves = _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0), hi_halves = _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
  for (int m = 0; m < 4; ++m) {
    // rows 0-7 (a) and 8-15 (b) of the columns in lanes 0, 1 (a0, b0) and 2, 3 (a1, b1)
    const __m512i a0 = _mm512_permutex2var_epi64(u[m], lo_pairs, u[4 + m]), a1 = _mm512_permutex2var_epi64(u[m], hi_pairs, u[4 + m]);
    const __m512i b0 = _mm512_permutex2var_epi64(u[8 + m], lo_pairs, u[12 + m]), b1 = _mm512_permutex2var_epi64(u[8 + m], hi_pairs, u[12 + m]);
    out[kColumn[m]] = _mm512_permutex2var_epi64(a0, lo_halves, b0);
    out[4 + kColumn[m]] = _mm512_permutex2var_epi64(a0, hi_halves, b0);
    out[8 + kColumn[m]] = _mm512_permutex2var_epi64(a1, lo_halves, b1);
    out[12 + kColumn[m]] = _mm512_permutex2var_epi64(a1, hi_halves, b1);
  }
}

// scores of one 16-key A tile against QB query blocks: C tiles 0..QB-1, A in 4, B in 5..7
template <int QB>
KVSERVE_AMX_TARGET inline void amx_key_scores(const uint16_t* keys, int64_t key_stride_bytes, const uint16_t* staged_queries, int steps,
                                              float (*c)[16][16]) {
  KVSERVE_TILE_ZERO(0);
  if constexpr (QB > 1) KVSERVE_TILE_ZERO(1);
  if constexpr (QB > 2) KVSERVE_TILE_ZERO(2);
  if constexpr (QB > 3) KVSERVE_TILE_ZERO(3);
  const int64_t block_elems = static_cast<int64_t>(steps) * 512;
  for (int s = 0; s < steps; ++s) {
    KVSERVE_TILE_LOADD(4, keys + s * 32, key_stride_bytes);
    KVSERVE_TILE_LOADD(5, staged_queries + s * 512, 64);
    KVSERVE_TILE_DPBF16PS(0, 4, 5);
    if constexpr (QB > 1) {
      KVSERVE_TILE_LOADD(6, staged_queries + block_elems + s * 512, 64);
      KVSERVE_TILE_DPBF16PS(1, 4, 6);
    }
    if constexpr (QB > 2) {
      KVSERVE_TILE_LOADD(7, staged_queries + 2 * block_elems + s * 512, 64);
      KVSERVE_TILE_DPBF16PS(2, 4, 7);
    }
    if constexpr (QB > 3) {
      KVSERVE_TILE_LOADD(5, staged_queries + 3 * block_elems + s * 512, 64);
      KVSERVE_TILE_DPBF16PS(3, 4, 5);
    }
  }
  KVSERVE_TILE_STORED(0, c[0], 64);
  if constexpr (QB > 1) KVSERVE_TILE_STORED(1, c[1], 64);
  if constexpr (QB > 2) KVSERVE_TILE_STORED(2, c[2], 64);
  if constexpr (QB > 3) KVSERVE_TILE_STORED(3, c[3], 64);
}

// P x V for query blocks (q0, q0 + 1 if MT == 2) and the value column blocks (lo, hi) of one
// 32-dim chunk: C tiles 0..3, A in 4-5, B in 6-7
template <int MT>
KVSERVE_AMX_TARGET inline void amx_values(const uint16_t* probs, int64_t pitch, const uint16_t* staged_values, int64_t value_row_elems,
                                          int key_steps, float (*c)[16][16]) {
  KVSERVE_TILE_ZERO(0);
  KVSERVE_TILE_ZERO(1);
  if constexpr (MT == 2) {
    KVSERVE_TILE_ZERO(2);
    KVSERVE_TILE_ZERO(3);
  }
  for (int s = 0; s < key_steps; ++s) {
    const uint16_t* b = staged_values + static_cast<int64_t>(s) * 16 * value_row_elems;
    KVSERVE_TILE_LOADD(4, probs + s * 32, pitch * 2);
    KVSERVE_TILE_LOADD(6, b, value_row_elems * 2);
    KVSERVE_TILE_DPBF16PS(0, 4, 6);
    KVSERVE_TILE_LOADD(7, b + 32, value_row_elems * 2);
    KVSERVE_TILE_DPBF16PS(1, 4, 7);
    if constexpr (MT == 2) {
      KVSERVE_TILE_LOADD(5, probs + 16 * pitch + s * 32, pitch * 2);
      KVSERVE_TILE_DPBF16PS(2, 5, 6);
      KVSERVE_TILE_DPBF16PS(3, 5, 7);
    }
  }
  KVSERVE_TILE_STORED(0, c[0], 64);
  KVSERVE_TILE_STORED(1, c[1], 64);
  if constexpr (MT == 2) {
    KVSERVE_TILE_STORED(2, c[2], 64);
    KVSERVE_TILE_STORED(3, c[3], 64);
  }
}

KVSERVE_AMX_TARGET void attend_tile_amx(float* out_rows, float* lse, const uint16_t* queries, const TileRows& rows, const KVView& kv,
                                        const int64_t* table, int kv_head, float scale, TileScratch& scratch) {
  const int head_dim = kv.head_dim, steps = head_dim / 32, chunks = head_dim / 32, count = rows.count;
  const int qblocks = (count + 15) / 16;
  const int64_t row_stride = kv.token_stride;
  const uint16_t* key_cache = static_cast<const uint16_t*>(kv.key);
  const uint16_t* value_cache = static_cast<const uint16_t*>(kv.value);
  const int64_t lo = rows.lo(), hi = rows.hi();
  const int64_t base = lo - lo % 32, span = (hi - base + 31) / 32 * 32;
  auto slot_row = [&](const uint16_t* cache, int64_t slot) {
    return cache + block_offset(kv, table, slot, kv_head) + (slot % kv.block_size) * row_stride;
  };
  const amx::TileConfig config = amx::full_tiles();
  KVSERVE_TILE_LOADCONFIG(&config);

  // queries as B tiles [query block][step][16 dim pairs][16 rows][2]; rows past count are zeros
  std::vector<uint16_t>& staged_queries = scratch.staged_queries;
  staged_queries.resize(static_cast<size_t>(qblocks) * steps * 512);
  // per query block and step: the 16 rows' 16 dim pairs (32-bit elements), transposed
  for (int qb = 0; qb < qblocks; ++qb)
    for (int st = 0; st < steps; ++st) {
      __m512 pair_rows[16];
      __m512i pair_columns[16];
      for (int n = 0; n < 16; ++n)
        pair_rows[n] = qb * 16 + n < count ? _mm512_castsi512_ps(_mm512_loadu_si512(queries + (qb * 16 + n) * head_dim + st * 32))
                                           : _mm512_setzero_ps();
      transpose16x16(pair_rows, pair_columns);
      for (int p = 0; p < 16; ++p)
        _mm512_storeu_si512(staged_queries.data() + ((static_cast<size_t>(qb) * steps + st) * 16 + p) * 32, pair_columns[p]);
    }

  // scores [rows][span] from slot base, 16 keys of a block at a time
  scratch.scores.resize(static_cast<size_t>(count) * span);
  float* s = scratch.scores.data();
  alignas(64) float c[4][16][16];
  for (int64_t k0 = lo - lo % 16; k0 < hi; k0 += 16) {
    const uint16_t* keys = slot_row(key_cache, k0);
    switch (qblocks) {
      case 1: amx_key_scores<1>(keys, row_stride * 2, staged_queries.data(), steps, c); break;
      case 2: amx_key_scores<2>(keys, row_stride * 2, staged_queries.data(), steps, c); break;
      case 3: amx_key_scores<3>(keys, row_stride * 2, staged_queries.data(), steps, c); break;
      default: amx_key_scores<4>(keys, row_stride * 2, staged_queries.data(), steps, c); break;
    }
    const __m512 by = _mm512_set1_ps(scale);
    for (int qb = 0; qb < qblocks; ++qb) {
      __m512 keys_rows[16];
      __m512i query_rows[16];
      for (int j = 0; j < 16; ++j) keys_rows[j] = _mm512_load_ps(c[qb][j]);
      transpose16x16(keys_rows, query_rows);
      for (int n = 0; n < 16 && qb * 16 + n < count; ++n)
        _mm512_storeu_ps(s + (qb * 16 + n) * span + (k0 - base), _mm512_mul_ps(_mm512_castsi512_ps(query_rows[n]), by));
    }
  }

  // probabilities [qblocks * 16][pitch] bf16 (rows past count zero)
  const int64_t pitch = span;
  scratch.probs.assign(static_cast<size_t>(qblocks) * 16 * pitch, 0);
  std::vector<float> inv_sum(count);
  bf16_probabilities<false>(s, span, base, rows, nullptr, scratch.probs.data(), pitch, inv_sum.data(), lse);

  // value pairs as B tiles: row i (slots base + 2i, base + 2i + 1) holds per 32-dim chunk its
  // unpacklo then unpackhi (16 pairs each); slots outside [lo, hi) are zeros
  const int64_t value_row_elems = 2 * static_cast<int64_t>(head_dim);
  std::vector<uint16_t>& staged_values = scratch.staged_values;
  staged_values.resize(static_cast<size_t>(span / 2) * value_row_elems);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t i = 0; i < span / 2; ++i) {
    const int64_t a = base + 2 * i, b = a + 1;
    const uint16_t* va = a >= lo && a < hi ? slot_row(value_cache, a) : nullptr;
    const uint16_t* vb = b >= lo && b < hi ? slot_row(value_cache, b) : nullptr;
    uint16_t* dst = staged_values.data() + i * value_row_elems;
    for (int ch = 0; ch < chunks; ++ch) {
      const __m512i v0 = va ? _mm512_loadu_si512(va + ch * 32) : zero;
      const __m512i v1 = vb ? _mm512_loadu_si512(vb + ch * 32) : zero;
      _mm512_storeu_si512(dst + ch * 64, _mm512_unpacklo_epi16(v0, v1));
      _mm512_storeu_si512(dst + ch * 64 + 32, _mm512_unpackhi_epi16(v0, v1));
    }
  }

  // acc [rows][chunks][2][16] in unpack order, as the AVX512-BF16 path's
  scratch.acc.resize(static_cast<size_t>(count) * chunks * 32);
  float* acc = scratch.acc.data();
  const int key_steps = static_cast<int>(span / 32);
  for (int ch = 0; ch < chunks; ++ch)
    for (int qb = 0; qb < qblocks; qb += 2) {
      const int mt = std::min(2, qblocks - qb);
      const uint16_t* probs = scratch.probs.data() + static_cast<int64_t>(qb) * 16 * pitch;
      if (mt == 2) amx_values<2>(probs, pitch, staged_values.data() + ch * 64, value_row_elems, key_steps, c);
      else amx_values<1>(probs, pitch, staged_values.data() + ch * 64, value_row_elems, key_steps, c);
      for (int m = 0; m < mt; ++m)
        for (int i = 0; i < 16; ++i) {
          const int r = (qb + m) * 16 + i;
          if (r >= count) break;
          std::memcpy(acc + (static_cast<size_t>(r) * chunks + ch) * 32, c[2 * m][i], 64);
          std::memcpy(acc + (static_cast<size_t>(r) * chunks + ch) * 32 + 16, c[2 * m + 1][i], 64);
        }
    }
  KVSERVE_TILE_RELEASE();
  write_unpacked(out_rows, acc, count, chunks, inv_sum.data());
}

// AMX attention for bf16 K/V and queries: where the CPU's tiles can run and KVSERVE_DISABLE_AMX is
// not "1" (decided once), unless the engine turned it off (its AMX self-check failed)
int g_attention_amx = -1;

bool attention_amx_enabled() {
  if (g_attention_amx < 0) {
    const char* off = std::getenv("KVSERVE_DISABLE_AMX");
    g_attention_amx = kvserve_amx_available() && !(off && std::strcmp(off, "1") == 0) ? 1 : 0;
  }
  return g_attention_amx == 1;
}
#endif  // KVSERVE_ATTENTION_AMX

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
  auto prefetch_block = [&](bool value, int64_t position) {  // this head's rows of the block holding `position`
    if (position >= first + count) return;
    const int64_t id = table[position / bs];
    if (id >= kv.first_residual) return;
    const uint8_t* record = quantized_record(kv, value, id) + kv_head * row_bytes;
    for (int t = 0; t < bs; ++t)
      for (int64_t byte = 0; byte < row_bytes; byte += 64) _mm_prefetch(reinterpret_cast<const char*>(record + t * kv.token_stride + byte), _MM_HINT_T1);
  };
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
    prefetch_block(false, position + run);
    const bool residual = id >= kv.first_residual;
    const uint8_t* record = residual ? nullptr : quantized_record(kv, false, id);
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
    prefetch_block(true, position + run);
    const bool residual = id >= kv.first_residual;
    const uint8_t* record = residual ? nullptr : quantized_record(kv, true, id);
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


// Which context each query row attends to. A decode batch's rows are sequences, each with its own
// block table and length; a prefill chunk's rows are consecutive tokens of one sequence, sharing
// its table, the row r seeing first_len + r slots. Both run the same code per row below, so a
// token's attention has the same bits whether it was decoded, prefilled in any chunk, or recomputed
// after a prefix hit or a preemption.
struct QueryRows {
  int64_t count;
  const int64_t* tables;  // count tables of max_blocks entries, or one shared table (table_stride 0)
  int64_t table_stride;
  int64_t max_blocks;
  const int64_t* kv_lens;  // per row, or null: row r's context is first_len + r
  int64_t first_len;
  int64_t context(int64_t r) const { return kv_lens ? kv_lens[r] : first_len + r; }
  const int64_t* table(int64_t r) const { return tables + r * table_stride; }
};

// Each query row attends to slots max(0, len - window) .. len - 1 of its context. A task is one
// row's KV head (its group of query heads). A context of at least 2 * kSplitTokens slots is split
// at the multiples of kSplitTokens into parts that threads compute apart (flash-decoding: one long
// sequence, a model with one KV head, keep every thread busy); each part's output and log-sum-exp
// are merged after. The parts depend on the row's own context alone, never on the other rows or
// the thread count.
int attend_rows(const QueryRows& rows, const KVView& kv, void* out, const void* query, int query_dtype, int num_heads, int window,
                float scale, int max_tile_tokens) {
  constexpr int64_t kSplitTokens = 512;
  const int num_kv_heads = kv.num_kv_heads, head_dim = kv.head_dim;
  const int kv_dtype = kv.dtype;
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || kv.block_size <= 0 || kv_dtype < 0 || kv_dtype > 7 ||
      head_dim > 512) return 1;
  const int group = num_heads / num_kv_heads;
  const bool plain = plain_float_view(kv);
  bool bf16_tiles = false;
#if KVSERVE_DECODE_BF16_DOT
  bf16_tiles = query_dtype == kBFloat16 && ((kv_dtype == kBFloat16 && plain) || is_scaled_format(kv_dtype)) && head_dim % 32 == 0;
#endif
  const bool float_tiles = !bf16_tiles && (plain || is_scaled_format(kv_dtype)) && head_dim % 16 == 0;
  int tile_tokens = bf16_tiles || float_tiles ? std::max(1, max_tile_tokens) : 1;
  bool amx_tiles = false;
#if KVSERVE_ATTENTION_AMX
  amx_tiles = bf16_tiles && kv_dtype == kBFloat16 && kv.block_size % 16 == 0 && group <= kAmxTileRowsMax && attention_amx_enabled();
  if (amx_tiles) tile_tokens = std::min(tile_tokens, kAmxTileRowsMax / group);
#endif

  // each token's visible slots [first, context); one of at least 2 * kSplitTokens is split at the
  // multiples of kSplitTokens into parts (q0 .. q1), merged after by log-sum-exp
  struct Span {
    int64_t first, context;
    bool split() const { return context - first >= 2 * kSplitTokens; }
    int64_t q0() const { return split() ? first / kSplitTokens : -1; }
    int64_t q1() const { return split() ? (context - 1) / kSplitTokens : -1; }
    int parts() const { return split() ? static_cast<int>(q1() - q0() + 1) : 1; }
    int64_t part_first(int p) const { return split() ? std::max(first, (q0() + p) * kSplitTokens) : first; }
    int64_t part_end(int p) const { return split() ? std::min(context, (q0() + p + 1) * kSplitTokens) : context; }
  };
  std::vector<Span> spans(static_cast<size_t>(rows.count));
  for (int64_t t = 0; t < rows.count; ++t) {
    const int64_t context = rows.context(t);
    spans[t] = {window > 0 ? std::max<int64_t>(0, context - window) : 0, context};
    if (context <= 0 || (context + kv.block_size - 1) / kv.block_size > rows.max_blocks) return 2;
  }
  // tiles: runs of up to tile_tokens consecutive tokens whose contexts split alike
  struct Work {
    int64_t token;
    int tokens, kv_head, part;
  };
  std::vector<Work> work;
  std::vector<int64_t> part_base(static_cast<size_t>(rows.count), -1);
  int64_t split_parts = 0;
  for (int64_t t = 0; t < rows.count;) {
    int tokens = 1;
    while (tokens < tile_tokens && t + tokens < rows.count && spans[t + tokens].split() == spans[t].split() &&
           spans[t + tokens].q0() == spans[t].q0() && spans[t + tokens].q1() == spans[t].q1())
      ++tokens;
    const int parts = spans[t].parts();
    if (parts > 1)
      for (int i = 0; i < tokens; ++i, split_parts += parts) part_base[t + i] = split_parts;
    for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head)
      for (int p = 0; p < parts; ++p) work.push_back({t, tokens, kv_head, p});
    t += tokens;
  }
  // split tokens' parts: outputs [part][kv head][group][head_dim], log-sum-exps [part][kv head][group]
  const int64_t part_rows = static_cast<int64_t>(num_kv_heads) * group;
  std::vector<float> part_out(static_cast<size_t>(split_parts * part_rows * head_dim)), part_lse(static_cast<size_t>(split_parts * part_rows));
  auto query_offset = [&](int64_t token, int kv_head) { return (token * num_heads + kv_head * group) * head_dim; };
  auto store_rows = [&](int64_t token, int kv_head, const float* values) {
    for (int g = 0; g < group; ++g)
      store_row(out, query_dtype, query_offset(token, kv_head) + g * head_dim, head_dim, values + static_cast<size_t>(g) * head_dim, 1.f);
  };

#pragma omp parallel
  {
    TileScratch scratch;
    std::vector<float> queries, result, lse, row(head_dim);
    std::vector<uint16_t> queries_bf16;
    std::vector<int64_t> firsts, ends;

    // one tile's rows (tokens x group), for the part p of each token: result and lse [rows]
    auto attend = [&](const Work& w) {
      const int count = w.tokens * group;
      const int64_t* table = rows.table(w.token);
      firsts.resize(count);
      ends.resize(count);
      for (int i = 0; i < w.tokens; ++i)
        for (int g = 0; g < group; ++g) {
          firsts[i * group + g] = spans[w.token + i].part_first(w.part);
          ends[i * group + g] = spans[w.token + i].part_end(w.part);
        }
      const TileRows tile{count, firsts.data(), ends.data()};
      result.resize(static_cast<size_t>(count) * head_dim);
      lse.resize(count);
#if KVSERVE_DECODE_BF16_DOT
      if (bf16_tiles) {
        queries_bf16.resize(static_cast<size_t>(count) * head_dim);
        for (int i = 0; i < w.tokens; ++i)
          std::memcpy(queries_bf16.data() + static_cast<size_t>(i) * group * head_dim,
                      static_cast<const uint16_t*>(query) + query_offset(w.token + i, w.kv_head), sizeof(uint16_t) * group * head_dim);
#if KVSERVE_ATTENTION_AMX
        if (amx_tiles) {
          attend_tile_amx(result.data(), lse.data(), queries_bf16.data(), tile, kv, table, w.kv_head, scale, scratch);
          return;
        }
#endif
        with_kv_dtype(kv_dtype, [&](auto dtype) {
          constexpr int DT = decltype(dtype)::value;
          if constexpr (DT == kBFloat16 || DT == kInt8 || DT == kFp8E4m3 || DT == kFp8E5m2)
            attend_tile_bf16<DT>(result.data(), lse.data(), queries_bf16.data(), tile, kv, table, w.kv_head, scale, scratch);
          return true;
        });
        return;
      }
#endif
      queries.resize(static_cast<size_t>(count) * head_dim);
      for (int i = 0; i < w.tokens; ++i)
        load_row(query, query_dtype, query_offset(w.token + i, w.kv_head), group * head_dim, queries.data() + static_cast<size_t>(i) * group * head_dim);
      if (float_tiles) {
        with_kv_dtype(kv_dtype, [&](auto dtype) {
          attend_tile_float<decltype(dtype)::value>(result.data(), lse.data(), queries.data(), tile, kv, table, w.kv_head, scale, scratch);
          return true;
        });
        return;
      }
      // one token (tile_tokens is 1 here): KIVI records take their own loops, any other shape a row at a time
      const int64_t first = firsts[0], count_slots = ends[0] - firsts[0];
#if KVSERVE_DECODE_BF16_DOT
      if (query_dtype == kBFloat16 && (kv_dtype == kInt4 || kv_dtype == kInt2)) {
        const uint16_t* group_queries = static_cast<const uint16_t*>(query) + query_offset(w.token, w.kv_head);
        if (decode_task_kivi_bf16_dispatch(group, group_queries, result.data(), kv, table, first, count_slots, w.kv_head, scale,
                                           scratch.scores, scratch.probs, scratch.acc, lse.data()))
          return;
      }
#endif
      if (decode_task_kivi_dispatch(group, result.data(), queries.data(), kv, table, first, count_slots, w.kv_head, scale, scratch.scores,
                                    scratch.acc, lse.data()))
        return;
      decode_task_rows(result.data(), queries.data(), group, kv, table, first, count_slots, w.kv_head, scale, scratch.scores, scratch.acc,
                       row, lse.data());
    };

#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < static_cast<int64_t>(work.size()); ++i) {
      const Work& w = work[i];
      attend(w);
      for (int t = 0; t < w.tokens; ++t) {
        const float* values = result.data() + static_cast<size_t>(t) * group * head_dim;
        if (part_base[w.token + t] < 0) {
          store_rows(w.token + t, w.kv_head, values);
          continue;
        }
        const int64_t at = (part_base[w.token + t] + w.part) * part_rows + static_cast<int64_t>(w.kv_head) * group;
        std::memcpy(part_out.data() + at * head_dim, values, sizeof(float) * group * head_dim);
        std::memcpy(part_lse.data() + at, lse.data() + t * group, sizeof(float) * group);
      }
    }

    // merge: out = sum over parts of exp(lse_p - total) * out_p, total the log of the whole sum
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < rows.count * num_kv_heads; ++task) {
      const int64_t token = task / num_kv_heads;
      const int kv_head = static_cast<int>(task % num_kv_heads);
      if (part_base[token] < 0) continue;
      const int parts = spans[token].parts();
      auto at = [&](int p, int g) { return (part_base[token] + p) * part_rows + static_cast<int64_t>(kv_head) * group + g; };
      result.resize(static_cast<size_t>(group) * head_dim);
      for (int g = 0; g < group; ++g) {
        float peak = -INFINITY;
        for (int p = 0; p < parts; ++p) peak = std::max(peak, part_lse[at(p, g)]);
        float total = 0.f;
        for (int p = 0; p < parts; ++p) total += std::exp(part_lse[at(p, g)] - peak);
        float* merged = result.data() + static_cast<size_t>(g) * head_dim;
        std::fill(merged, merged + head_dim, 0.f);
        for (int p = 0; p < parts; ++p) {
          const float weight = std::exp(part_lse[at(p, g)] - peak) / total;
          const float* values = part_out.data() + at(p, g) * head_dim;
          for (int d = 0; d < head_dim; ++d) merged[d] += weight * values[d];
        }
      }
      store_rows(token, kv_head, result.data());
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// 0: bf16 attention leaves AMX tiles for the AVX512-BF16 path (the engine's AMX self-check failed);
// 1: back to the default. Returns whether AMX attention is on now.
int kvserve_set_attention_amx(int on) {
#if KVSERVE_ATTENTION_AMX
  g_attention_amx = -1;
  if (!on) g_attention_amx = 0;
  return attention_amx_enabled() ? 1 : 0;
#else
  (void)on;
  return 0;
#endif
}

// Decode: see DecodeAttentionArgs.
int kvserve_paged_decode_attention(const DecodeAttentionArgs* args) {
  const DecodeAttentionArgs& a = *args;
  const QueryRows rows{a.num_seqs, a.block_tables, a.max_blocks, a.max_blocks, a.kv_lens, 0};
  return attend_rows(rows, *a.kv, a.out, a.query, a.query_dtype, a.num_heads, a.window, a.scale, 1);
}

// One prefill chunk of one sequence (see PrefillAttentionArgs): each token attends exactly as it
// would decode, in batches of kPrefillRows tokens (which bounds the split contexts' part buffers).
int kvserve_paged_prefill_attention(const PrefillAttentionArgs* args) {
  constexpr int64_t kPrefillRows = 256;
  constexpr int kTileRows = 64;  // query rows (tokens x group) that share each key and value load
  const PrefillAttentionArgs& a = *args;
  const KVView& kv = *a.kv;
  if (a.num_tokens <= 0 || a.kv_start < 0 || a.num_heads <= 0 || kv.num_kv_heads <= 0 || a.query_dtype < 0 || a.query_dtype > 2 || kv.block_size <= 0) return 1;
  if ((a.kv_start + a.num_tokens + kv.block_size - 1) / kv.block_size > a.num_blocks) return 2;
  const int64_t row_bytes = static_cast<int64_t>(a.num_heads) * kv.head_dim * (a.query_dtype == kFloat32 ? 4 : 2);
  for (int64_t start = 0; start < a.num_tokens; start += kPrefillRows) {
    const QueryRows rows{std::min(kPrefillRows, a.num_tokens - start), a.block_table, 0, a.num_blocks, nullptr, a.kv_start + start + 1};
    const int status = attend_rows(rows, kv, static_cast<char*>(a.out) + start * row_bytes,
                                   static_cast<const char*>(a.query) + start * row_bytes, a.query_dtype, a.num_heads, a.window, a.scale, kTileRows * kv.num_kv_heads / a.num_heads);
    if (status) return status;
  }
  return 0;
}

}  // extern "C"
