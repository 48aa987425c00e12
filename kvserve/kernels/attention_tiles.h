// A tile of query rows over one KV head (paged_attention.cpp includes this inside its anonymous
// namespace, after attention_common.h): what fixes a row's bits, the walk over the tile's blocks,
// and the float path (float queries over fp32 / bf16 / fp16 or int8 / fp8 K/V).

#pragma once

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
  std::vector<int16_t> int16_queries;    // [rows][head_dim]: the int8 keys' path (attention_bf16.h)
  std::vector<float> query_scales;       // [rows]
  std::vector<int32_t> window_sums;      // [rows][head_dim]: the int8 values' int32 sums of a window (attention_int8.h)
  std::vector<uint8_t> amx_bytes;        // attention_amx_int8.h's codes split in bytes and its B tiles

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
