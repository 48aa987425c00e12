// KIVI's int4 / int2 records with bf16 queries on a CPU with AVX512-BF16: attention_rows.h's KIVI
// loop in bf16 dot products (paged_attention.cpp includes this inside its anonymous namespace,
// after attention_bf16.h, whose reduce16 and load_row_bh it uses).

#pragma once

#if KVSERVE_DECODE_BF16_DOT

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
