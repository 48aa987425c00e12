// One query row at a time in float, for what the tiles do not read (paged_attention.cpp includes
// this inside its anonymous namespace, after attention_common.h): any layout read a row at a time
// through kv_formats.h (quantized records, KIVI's residual blocks, head dims the tiles do not
// take), and KIVI's int4 / int2 records in their own loop.

#pragma once

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
