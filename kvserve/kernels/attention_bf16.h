// Tiles of bf16 queries on a CPU with AVX512-BF16 (paged_attention.cpp includes this inside its
// anonymous namespace, after attention_tiles.h), over bf16 or int8 / fp8 K/V; with the bf16 pieces
// the AMX tiles and KIVI's bf16 loop use too (reduce16, load_row_bh, bf16_probabilities,
// write_unpacked).

#pragma once

// ---- bf16 K/V and queries on a CPU with AVX512-BF16 ---------------------------------------------
// vdpbf16ps multiplies bf16 pairs straight from the pool (no widening to float). Scores: each key's
// G dot products are 16-lane partial sums, reduced 16 keys at a time by a transposing tree (~3
// instructions per score instead of a horizontal sum each). Values: rows i and i+1 are interleaved
// (unpack lo/hi), so one instruction adds p_i v_i + p_{i+1} v_{i+1} for 16 dims, with the
// probabilities rounded to bf16 as flash attention does for its P @ V; they are normalized by the
// sum of the rounded values, in float.
#if KVSERVE_DECODE_BF16_DOT

// v[0..15], one 16-lane partial-sum vector per key -> one vector of the 16 keys' totals, by a
// transposing tree of permutes; add(a, b) adds two vectors' lanes (float, or int32 in float bits)
template <typename Add>
inline __m512 reduce16_tree(const __m512* v, Add add) {
  const __m512i lo1 = _mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i hi1 = _mm512_set_epi32(31, 30, 29, 28, 27, 26, 25, 24, 15, 14, 13, 12, 11, 10, 9, 8);
  const __m512i lo2 = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
  const __m512i hi2 = _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4);
  const __m512i lo3 = _mm512_set_epi32(29, 28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
  const __m512i hi3 = _mm512_set_epi32(31, 30, 27, 26, 23, 22, 19, 18, 15, 14, 11, 10, 7, 6, 3, 2);
  const __m512i lo4 = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i hi4 = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  auto sum_pairs = [&](__m512 a, __m512 b, const __m512i& lo, const __m512i& hi) {
    return add(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
  };
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) w[i] = sum_pairs(v[2 * i], v[2 * i + 1], lo1, hi1);
  for (int i = 0; i < 4; ++i) x[i] = sum_pairs(w[2 * i], w[2 * i + 1], lo2, hi2);
  for (int i = 0; i < 2; ++i) y[i] = sum_pairs(x[2 * i], x[2 * i + 1], lo3, hi3);
  return sum_pairs(y[0], y[1], lo4, hi4);
}

inline __m512 reduce16(const __m512* v) { return reduce16_tree(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }); }

// the same tree on int32 lanes held as float bits (attention_int8.h's partial sums): exact totals
inline __m512i reduce16_int32(const __m512* v) {
  return _mm512_castps_si512(reduce16_tree(v, [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }));
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
  // int8 K/V on AVX512-VNNI: 16-bit integer products (attention_int8.h)
  constexpr bool kInt8Path = DT == kInt8 && KVSERVE_INT8_ATTENTION;
  const bool int16 = kInt8Path && kv.block_size <= kInt8MaxBlockSlots;
  [[maybe_unused]] const int16_t* int16_queries = nullptr;
  [[maybe_unused]] const float* query_scales = nullptr;
#if KVSERVE_INT8_ATTENTION
  if (int16) {
    scratch.int16_queries.resize(static_cast<size_t>(count) * head_dim);
    scratch.query_scales.resize(count);
    int16_query_rows(scratch.int16_queries.data(), scratch.query_scales.data(), queries, count, head_dim);
    int16_queries = scratch.int16_queries.data();
    query_scales = scratch.query_scales.data();
  }
#endif
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
#if KVSERVE_INT8_ATTENTION
          if (int16) {
            int8_key_partials_block<decltype(size)::value>(partial + r0 * 16, int16_queries + static_cast<size_t>(r0) * head_dim, head_dim, key, j);
            return;
          }
#endif
          bf16_partials_block<decltype(size)::value, DT>(partial + r0 * 16, queries + static_cast<size_t>(r0) * head_dim, head_dim, key, j);
        });
      }
      const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
      const __m512 by = _mm512_load_ps(factor);
      for (int r = 0; r < count; ++r) {
#if KVSERVE_INT8_ATTENTION
        if (int16) {
          const __m512 scores = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(reduce16_int32(partial + r * 16)), by),
                                              _mm512_set1_ps(query_scales[r]));
          _mm512_mask_storeu_ps(s + r * span + start + j0 - base, keep, scores);
          continue;
        }
#endif
        _mm512_mask_storeu_ps(s + r * span + start + j0 - base, keep, _mm512_mul_ps(reduce16(partial + r * 16), by));
      }
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
  std::vector<float> inv_sum(count), weight_scales(count);
#if KVSERVE_INT8_ATTENTION
  if (int16)
    int16_probabilities(s, span, base, rows, value_scales.data(), reinterpret_cast<int16_t*>(scratch.probs.data()), pitch, inv_sum.data(), lse,
                        weight_scales.data());
  else
#endif
    bf16_probabilities<kScaled>(s, span, base, rows, value_scales.data(), scratch.probs.data(), pitch, inv_sum.data(), lse);

  // values: acc [rows][chunks][2][16] float, dims in unpack order; slots paired at even offsets of
  // a block, a slot outside [lo, hi) read as zeros
  scratch.acc.assign(static_cast<size_t>(count) * chunks * 32, 0.f);
  float* acc = scratch.acc.data();
  [[maybe_unused]] int32_t* window_sums = nullptr;
#if KVSERVE_INT8_ATTENTION
  if (int16) {
    scratch.window_sums.assign(static_cast<size_t>(count) * chunks * 32, 0);
    window_sums = scratch.window_sums.data();
  }
#endif
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
      // a value row's 32 dims from c * 32 as 16-bit lanes: bf16, or int16 codes on the int8 path
      auto load_row = [&](int64_t j) {
#if KVSERVE_INT8_ATTENTION
        if (int16) return load_row_int16(value_cache + offset + j * row_stride, c);
#endif
        return (__m512i)load_row_bh<DT>(value_cache + (offset + j * row_stride) * kElemBytes, c);
      };
      for (int i = 0; i < pair_count; ++i) {
        const int64_t j = from + 2 * i;
        const __m512i v0 = start + j >= begin ? load_row(j) : zero;
        const __m512i v1 = j + 1 < to ? load_row(j + 1) : zero;
        pairs_lo[i] = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
        pairs_hi[i] = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
      }
      for_each_row_block(count, [&](auto size, int r0) {
#if KVSERVE_INT8_ATTENTION
        if (int16) {
          int16_values_block<decltype(size)::value>(window_sums + static_cast<size_t>(r0) * chunks * 32,
                                                    reinterpret_cast<const int16_t*>(scratch.probs.data()) + r0 * pitch, pitch, chunks, c,
                                                    reinterpret_cast<const __m512i*>(pairs_lo), reinterpret_cast<const __m512i*>(pairs_hi),
                                                    pair_count, start + from - base);
          return;
        }
#endif
        bf16_values_block<decltype(size)::value>(acc + static_cast<size_t>(r0) * chunks * 32, scratch.probs.data() + r0 * pitch, pitch, chunks,
                                                 c, pairs_lo, pairs_hi, pair_count, start + from - base);
      });
    }
#if KVSERVE_INT8_ATTENTION
    if (int16 && (next < 0 || int8_window_ends(start, kv.block_size))) add_window_sums(acc, window_sums, count, chunks * 32, weight_scales.data());
#endif
  });
  write_unpacked(out_rows, acc, count, chunks, inv_sum.data());
}

#endif  // KVSERVE_DECODE_BF16_DOT
