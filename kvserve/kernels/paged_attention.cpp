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
#include <vector>

#include "simd.h"

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


// ---- vectorized path: head_dim a multiple of 16, group size known at compile time -------------

// Calls fn(i, offset, run) for each run of consecutive positions inside one block: i is the index of
// the run's first position relative to `first`, offset the element offset of its first K/V row.
template <typename Fn>
inline void for_each_block_run(const int64_t* table, int64_t first, int64_t count, int kv_head, int num_kv_heads,
                               int head_dim, int block_size, Fn fn) {
  int64_t i = 0;
  while (i < count) {
    const int64_t position = first + i;
    const int64_t block = position / block_size;
    const int64_t within = position - block * block_size;
    const int64_t run = std::min<int64_t>(block_size - within, count - i);
    const int64_t slot = table[block] * block_size + within;
    fn(i, (slot * num_kv_heads + kv_head) * head_dim, run);
    i += run;
  }
}

template <int G, int DT>
void decode_task_fast(float* out_rows, const float* queries, const void* key_cache, const void* value_cache,
                      const int64_t* table, int64_t first, int64_t count, int kv_head, int num_kv_heads, int head_dim,
                      int block_size, float scale, std::vector<float>& scores, std::vector<float>& acc) {
  const int chunks = head_dim / 16;
  const int64_t row_stride = static_cast<int64_t>(num_kv_heads) * head_dim;
  scores.resize(static_cast<size_t>(G) * count);
  float* s = scores.data();

  for_each_block_run(table, first, count, kv_head, num_kv_heads, head_dim, block_size, [&](int64_t i0, int64_t base, int64_t run) {
    for (int64_t j = 0; j < run; ++j) {
      const int64_t offset = base + j * row_stride;
      f32x16 a[G], b[G];
      for (int g = 0; g < G; ++g) a[g] = b[g] = f32x16{};
      int c = 0;
      for (; c + 1 < chunks; c += 2) {
        const f32x16 k0 = load16<DT>(key_cache, offset + c * 16);
        const f32x16 k1 = load16<DT>(key_cache, offset + c * 16 + 16);
        for (int g = 0; g < G; ++g) {
          f32x16 q0, q1;
          std::memcpy(&q0, queries + g * head_dim + c * 16, sizeof(q0));
          std::memcpy(&q1, queries + g * head_dim + c * 16 + 16, sizeof(q1));
          a[g] += q0 * k0;
          b[g] += q1 * k1;
        }
      }
      if (c < chunks) {
        const f32x16 k0 = load16<DT>(key_cache, offset + c * 16);
        for (int g = 0; g < G; ++g) {
          f32x16 q0;
          std::memcpy(&q0, queries + g * head_dim + c * 16, sizeof(q0));
          a[g] += q0 * k0;
        }
      }
      for (int g = 0; g < G; ++g) s[g * count + i0 + j] = hsum(a[g] + b[g]) * scale;
    }
  });

  float inv_sum[G];
  for (int g = 0; g < G; ++g) {
    float* row = s + g * count;
    float peak = -INFINITY;
    for (int64_t i = 0; i < count; ++i) peak = std::max(peak, row[i]);
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
      row[i] = std::exp(row[i] - peak);
      tail += row[i];
    }
    inv_sum[g] = 1.f / tail;
  }

  acc.assign(static_cast<size_t>(G) * head_dim, 0.f);
  for_each_block_run(table, first, count, kv_head, num_kv_heads, head_dim, block_size, [&](int64_t i0, int64_t base, int64_t run) {
    for (int c = 0; c < chunks; ++c) {
      f32x16 a[G], b[G];
      for (int g = 0; g < G; ++g) {
        std::memcpy(&a[g], acc.data() + g * head_dim + c * 16, sizeof(a[g]));
        b[g] = f32x16{};
      }
      int64_t j = 0;
      for (; j + 1 < run; j += 2) {
        const f32x16 v0 = load16<DT>(value_cache, base + j * row_stride + c * 16);
        const f32x16 v1 = load16<DT>(value_cache, base + (j + 1) * row_stride + c * 16);
        for (int g = 0; g < G; ++g) {
          a[g] += s[g * count + i0 + j] * v0;
          b[g] += s[g * count + i0 + j + 1] * v1;
        }
      }
      if (j < run) {
        const f32x16 v0 = load16<DT>(value_cache, base + j * row_stride + c * 16);
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
bool decode_task_dispatch_dtype(int kv_dtype, float* out_rows, const float* queries, const void* key_cache,
                                const void* value_cache, const int64_t* table, int64_t first, int64_t count, int kv_head,
                                int num_kv_heads, int head_dim, int block_size, float scale, std::vector<float>& scores,
                                std::vector<float>& acc) {
  switch (kv_dtype) {
    case kFloat32:
      decode_task_fast<G, kFloat32>(out_rows, queries, key_cache, value_cache, table, first, count, kv_head, num_kv_heads,
                                    head_dim, block_size, scale, scores, acc);
      return true;
    case kBFloat16:
      decode_task_fast<G, kBFloat16>(out_rows, queries, key_cache, value_cache, table, first, count, kv_head, num_kv_heads,
                                     head_dim, block_size, scale, scores, acc);
      return true;
    case kFloat16:
      decode_task_fast<G, kFloat16>(out_rows, queries, key_cache, value_cache, table, first, count, kv_head, num_kv_heads,
                                    head_dim, block_size, scale, scores, acc);
      return true;
  }
  return false;
}

// true when a vectorized specialization handled the task
bool decode_task_fast_dispatch(int group, int kv_dtype, float* out_rows, const float* queries, const void* key_cache,
                               const void* value_cache, const int64_t* table, int64_t first, int64_t count, int kv_head,
                               int num_kv_heads, int head_dim, int block_size, float scale, std::vector<float>& scores,
                               std::vector<float>& acc) {
  if (head_dim % 16 != 0) return false;
#define KVSERVE_GROUP_CASE(G)                                                                                             \
  case G:                                                                                                                 \
    return decode_task_dispatch_dtype<G>(kv_dtype, out_rows, queries, key_cache, value_cache, table, first, count, kv_head, \
                                         num_kv_heads, head_dim, block_size, scale, scores, acc);
  switch (group) {
    KVSERVE_GROUP_CASE(1)
    KVSERVE_GROUP_CASE(2)
    KVSERVE_GROUP_CASE(3)
    KVSERVE_GROUP_CASE(4)
    KVSERVE_GROUP_CASE(5)
    KVSERVE_GROUP_CASE(6)
    KVSERVE_GROUP_CASE(7)
    KVSERVE_GROUP_CASE(8)
  }
#undef KVSERVE_GROUP_CASE
  return false;
}


// ---- prefill: a chunk of queries against its paged context, flash-style -----------------------
// Keys are first unpacked to float, transposed in tiles of 16 positions ([tile][head_dim][16]) so
// a tile of 8 query rows scores 16 keys with broadcast-FMAs; values are unpacked to [pos][head_dim].
// Each task is (kv head, 8 query rows), rows ordered token-major then head within the group.

constexpr int kKeyTile = 16;
constexpr int kRowTile = 8;

struct PrefillBuffers {
  std::vector<float> keys_t;   // [kv_heads][tiles][head_dim][16]
  std::vector<float> values;   // [kv_heads][tiles * 16][head_dim]
};

// head_pad: head_dim rounded up to 16; the padding is zero in keys, values and queries alike.
void unpack_context(PrefillBuffers& buf, const void* key_cache, const void* value_cache, int kv_dtype, const int64_t* table,
                    int64_t key_base, int64_t context_end, int num_kv_heads, int head_dim, int head_pad, int block_size) {
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
        const int64_t slot = table[position / block_size] * block_size + position % block_size;
        const int64_t offset = (slot * num_kv_heads + kv_head) * head_dim;
        load_row(key_cache, kv_dtype, offset, head_dim, key_row.data());
        for (int d = 0; d < head_pad; ++d) kt[d * kKeyTile + j] = key_row[d];
        load_row(value_cache, kv_dtype, offset, head_dim, v_row);
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

}  // namespace

extern "C" {

// out, query: [num_seqs, num_heads, head_dim] in query_dtype (contiguous).
// key_cache, value_cache: [slots, num_kv_heads, head_dim] in kv_dtype (contiguous).
// block_tables: [num_seqs, max_blocks]; context_lens: [num_seqs] (the query is the last token).
// window > 0 keeps only the last `window` keys.
int kvserve_paged_decode_attention(void* out, const void* query, int query_dtype, const void* key_cache,
                                   const void* value_cache, int kv_dtype, const int64_t* block_tables,
                                   const int64_t* context_lens, int num_seqs, int max_blocks, int num_heads,
                                   int num_kv_heads, int head_dim, int block_size, int window, float scale) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 1;
  const int group = num_heads / num_kv_heads;
  const int64_t tasks = static_cast<int64_t>(num_seqs) * num_kv_heads;
  int status = 0;

#pragma omp parallel
  {
    std::vector<float> queries(static_cast<size_t>(group) * head_dim);
    std::vector<float> row(head_dim);
    std::vector<float> acc(static_cast<size_t>(group) * head_dim);
    std::vector<float> result(static_cast<size_t>(group) * head_dim);
    std::vector<float> scores;

#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int seq = static_cast<int>(task / num_kv_heads);
      const int kv_head = static_cast<int>(task % num_kv_heads);
      const int64_t context = context_lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, context - window) : 0;
      const int64_t count = context - first;
      if (count <= 0 || (context + block_size - 1) / block_size > max_blocks) {
#pragma omp atomic write
        status = 2;
        continue;
      }
      for (int g = 0; g < group; ++g) {
        const int64_t q_offset = (static_cast<int64_t>(seq) * num_heads + kv_head * group + g) * head_dim;
        load_row(query, query_dtype, q_offset, head_dim, queries.data() + static_cast<size_t>(g) * head_dim);
      }
      const int64_t* table = block_tables + static_cast<int64_t>(seq) * max_blocks;
      if (decode_task_fast_dispatch(group, kv_dtype, result.data(), queries.data(), key_cache, value_cache, table, first,
                                    count, kv_head, num_kv_heads, head_dim, block_size, scale, scores, acc)) {
        for (int g = 0; g < group; ++g) {
          const int64_t o_offset = (static_cast<int64_t>(seq) * num_heads + kv_head * group + g) * head_dim;
          store_row(out, query_dtype, o_offset, head_dim, result.data() + static_cast<size_t>(g) * head_dim, 1.f);
        }
        continue;
      }
      scores.resize(static_cast<size_t>(group) * count);

      for (int64_t i = 0; i < count; ++i) {
        const int64_t position = first + i;
        const int64_t slot = table[position / block_size] * block_size + position % block_size;
        load_row(key_cache, kv_dtype, (slot * num_kv_heads + kv_head) * head_dim, head_dim, row.data());
        for (int g = 0; g < group; ++g)
          scores[g * count + i] = dot(queries.data() + static_cast<size_t>(g) * head_dim, row.data(), head_dim) * scale;
      }

      std::vector<float> inv_sum(group);
      for (int g = 0; g < group; ++g) {
        float* s = scores.data() + g * count;
        float peak = -INFINITY;
        for (int64_t i = 0; i < count; ++i) peak = std::max(peak, s[i]);
        float total = 0.f;
        for (int64_t i = 0; i < count; ++i) {
          s[i] = std::exp(s[i] - peak);
          total += s[i];
        }
        inv_sum[g] = 1.f / total;
      }

      acc.assign(static_cast<size_t>(group) * head_dim, 0.f);
      for (int64_t i = 0; i < count; ++i) {
        const int64_t position = first + i;
        const int64_t slot = table[position / block_size] * block_size + position % block_size;
        load_row(value_cache, kv_dtype, (slot * num_kv_heads + kv_head) * head_dim, head_dim, row.data());
        for (int g = 0; g < group; ++g) {
          const float weight = scores[g * count + i];
          float* a = acc.data() + static_cast<size_t>(g) * head_dim;
#pragma omp simd
          for (int d = 0; d < head_dim; ++d) a[d] += weight * row[d];
        }
      }
      for (int g = 0; g < group; ++g) {
        const int64_t o_offset = (static_cast<int64_t>(seq) * num_heads + kv_head * group + g) * head_dim;
        store_row(out, query_dtype, o_offset, head_dim, acc.data() + static_cast<size_t>(g) * head_dim, inv_sum[g]);
      }
    }
  }
  return status;
}


// One prefill chunk of one sequence. query/out: [num_tokens, num_heads, head_dim]; the chunk's
// tokens sit at positions context_start .. context_start + num_tokens - 1 and their K/V are
// already stored in the pool. block_table covers every position up to the chunk's end.
int kvserve_paged_prefill_attention(void* out, const void* query, int query_dtype, const void* key_cache,
                                    const void* value_cache, int kv_dtype, const int64_t* block_table,
                                    int64_t context_start, int64_t num_tokens, int num_heads, int num_kv_heads,
                                    int head_dim, int block_size, int window, float scale) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_tokens <= 0 || kv_dtype < 0 || kv_dtype > 2) return 1;
  const int group = num_heads / num_kv_heads;
  const int64_t context_end = context_start + num_tokens;
  const int64_t oldest = window > 0 ? std::max<int64_t>(0, context_start - window + 1) : 0;
  const int64_t key_base = oldest - oldest % kKeyTile;
  const int64_t tiles = (context_end - key_base + kKeyTile - 1) / kKeyTile;
  thread_local PrefillBuffers caller_buffers;  // reused across calls; grown, never shrunk
  PrefillBuffers& buf = caller_buffers;  // a plain reference, so the worker threads share the caller's buffers
  const int head_pad = (head_dim + 15) / 16 * 16;
  unpack_context(buf, key_cache, value_cache, kv_dtype, block_table, key_base, context_end, num_kv_heads, head_dim, head_pad, block_size);
  const int64_t rows_per_head = num_tokens * group;
  const int64_t row_tiles = (rows_per_head + kRowTile - 1) / kRowTile;
  const int64_t tasks = row_tiles * num_kv_heads;
#pragma omp parallel
  {
    std::vector<float> queries(static_cast<size_t>(kRowTile) * head_pad, 0.f);
    std::vector<float> result(static_cast<size_t>(kRowTile) * head_pad);
    // later query tiles see more keys: hand them out first so the threads finish together
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int kv_head = static_cast<int>(task % num_kv_heads);
      const int64_t row_tile = row_tiles - 1 - task / num_kv_heads;
      const int64_t row_base = row_tile * kRowTile;
      const int rows = static_cast<int>(std::min<int64_t>(kRowTile, rows_per_head - row_base));
      for (int r = 0; r < kRowTile; ++r) {
        float* q = queries.data() + static_cast<size_t>(r) * head_pad;
        if (r >= rows) {
          std::fill(q, q + head_pad, 0.f);
          continue;
        }
        const int64_t token = (row_base + r) / group;
        const int head = kv_head * group + static_cast<int>((row_base + r) % group);
        load_row(query, query_dtype, (token * num_heads + head) * head_dim, head_dim, q);
        for (int d = 0; d < head_dim; ++d) q[d] *= scale;
      }
      prefill_rows(buf, result.data(), queries.data(), rows, group, context_start, row_base, key_base, tiles, kv_head,
                   head_pad, window);
      for (int r = 0; r < rows; ++r) {
        const int64_t token = (row_base + r) / group;
        const int head = kv_head * group + static_cast<int>((row_base + r) % group);
        store_row(out, query_dtype, (token * num_heads + head) * head_dim, head_dim, result.data() + static_cast<size_t>(r) * head_pad, 1.f);
      }
    }
  }
  return 0;
}

}  // extern "C"
