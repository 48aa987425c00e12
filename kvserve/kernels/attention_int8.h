// Tiles of bf16 queries over int8 K/V on a CPU with AVX512-VNNI (paged_attention.cpp includes this
// inside its anonymous namespace, after attention_tiles.h; attend_tile_bf16<kInt8> calls it): both
// products in 16-bit integers on vpdpwssd, so the codes are widened by one instruction per 32 (to
// bf16 it took five) and the sums are exact. attention_amx_int8.h computes the same integers on AMX
// tiles, so the two paths give the same bits.
//
// Scores: each query row is rounded to int16 codes (scale max|q| / 32767, to nearest); a key's 32
// codes widened to int16; sums in int32 (|q| <= 32767, |k| <= 128 over at most 512 dims stay under
// 2^31), a key's 16 lanes added in int32 too, so the score is its exact integer dot product
// converted to float once. A bf16 query already carries 8 significant bits; its 16-bit codes add an
// error below a bf16 rounding of its largest element.
//
// Values: each row's weights (probability times the value row's scale) rounded to int16 codes
// against the row's largest weight; value rows i and i + 1 interleaved as int16 pairs, so one
// instruction adds w_i v_i + w_{i+1} v_{i+1} for 16 dims. The int32 sums run over a window of
// kInt8ValueWindow positions (at most 511 slots of |w| <= 32767, |v| <= 128: under 2^31; see
// int8_window_ends) and each window's sums are added in float to the output, in position order.
// The codes' error, 2^-16 of the row's largest weight, is below bf16 probabilities' 2^-9 of each
// weight until the weights spread evenly over ~2^14 slots.
//
// Both roundings depend on the row's own query and context alone, and the windows on positions
// alone, so a row's bits are the same alone and batched, on these vectors and on AMX tiles.

#pragma once

#if defined(__AVX512VNNI__) && KVSERVE_DECODE_BF16_DOT
#define KVSERVE_INT8_ATTENTION 1

constexpr int64_t kInt8MaxBlockSlots = 512;
constexpr int64_t kInt8ValueWindow = 256;

// whether the value sums of a window end with the block of block_size slots from `start` (the
// last block of a tile ends one too): it reaches a multiple of kInt8ValueWindow, or is itself
// larger than one, so no window sums more than 2 * kInt8ValueWindow - 1 slots
inline bool int8_window_ends(int64_t start, int64_t block_size) {
  return block_size > kInt8ValueWindow || (start + block_size) / kInt8ValueWindow != start / kInt8ValueWindow;
}

inline __m512 widen_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// 32 floats times `by`, rounded to nearest int16 (saturating), in order
inline void store_int16_codes(int16_t* out, __m512 lo, __m512 hi, __m512 by) {
  const __m512i packed = _mm512_packs_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(lo, by)), _mm512_cvtps_epi32(_mm512_mul_ps(hi, by)));
  // packs interleaves the two inputs per 128-bit lane: put the 64-bit quarters back in order
  _mm512_storeu_si512(out, _mm512_permutexvar_epi64(_mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0), packed));
}

// codes of max|x| = amax; a NaN among them (which max skips) makes it NaN
inline bool rounds_to_codes(float amax) { return amax >= 1e-30f && !std::isinf(amax); }
inline float scale_without_codes(float amax) { return amax >= 0.f && !std::isinf(amax) ? 0.f : NAN; }

// queries [count][head_dim] bf16 -> codes [count][head_dim], scales [count]
inline void int16_query_rows(int16_t* codes, float* scales, const uint16_t* queries, int count, int head_dim) {
  for (int r = 0; r < count; ++r) {
    const uint16_t* q = queries + static_cast<size_t>(r) * head_dim;
    int16_t* out = codes + static_cast<size_t>(r) * head_dim;
    __m512 peak = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int d = 0; d < head_dim; d += 16) {
      const __m512 v = widen_bf16(q + d);
      peak = _mm512_max_ps(peak, _mm512_abs_ps(v));
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    const float amax = nan ? NAN : _mm512_reduce_max_ps(peak);
    if (!rounds_to_codes(amax)) {  // zero or vanishing: every score 0 to float precision; not finite: NaN
      std::memset(out, 0, sizeof(int16_t) * head_dim);
      scales[r] = scale_without_codes(amax);
      continue;
    }
    const __m512 by = _mm512_set1_ps(32767.f / amax);
    for (int d = 0; d < head_dim; d += 32) store_int16_codes(out + d, widen_bf16(q + d), widen_bf16(q + d + 16), by);
    scales[r] = amax / 32767.f;
  }
}

// one key's 16-lane int32 partial sums (as float bits, for attention_bf16.h's reduce16_int32) for RB
// query rows (as bf16_partials_block)
template <int RB>
inline void int8_key_partials_block(__m512* partial, const int16_t* queries, int head_dim, const uint8_t* key, int j) {
  const int chunks = head_dim / 32;
  __m512i a[RB], b[RB];
  for (int r = 0; r < RB; ++r) a[r] = b[r] = _mm512_setzero_si512();
  auto widen = [&](int c) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + c * 32))); };
  int c = 0;
  for (; c + 1 < chunks; c += 2) {
    const __m512i k0 = widen(c), k1 = widen(c + 1);
    for (int r = 0; r < RB; ++r) {
      a[r] = _mm512_dpwssd_epi32(a[r], _mm512_loadu_si512(queries + r * head_dim + c * 32), k0);
      b[r] = _mm512_dpwssd_epi32(b[r], _mm512_loadu_si512(queries + r * head_dim + c * 32 + 32), k1);
    }
  }
  if (c < chunks) {
    const __m512i k0 = widen(c);
    for (int r = 0; r < RB; ++r) a[r] = _mm512_dpwssd_epi32(a[r], _mm512_loadu_si512(queries + r * head_dim + c * 32), k0);
  }
  for (int r = 0; r < RB; ++r) partial[r * 16 + j] = _mm512_castsi512_ps(_mm512_add_epi32(a[r], b[r]));
}

// Softmax in float over each row's range of scores s [rows][span] (slot base + i at column i), as
// bf16_probabilities<true>: the weights p * value_scale as int16 codes into codes [rows][pitch] (0
// outside the range up to pitch) and their scale in weight_scales[r]; inv_sum[r] = 1 / sum(p).
inline void int16_probabilities(float* s, int64_t span, int64_t base, const TileRows& rows, const float* value_scales, int16_t* codes,
                                int64_t pitch, float* inv_sum, float* lse, float* weight_scales) {
  for (int r = 0; r < rows.count; ++r) {
    const int64_t from = rows.first[r] - base, length = rows.end[r] - rows.first[r];
    float* row = s + r * span + from;
    const float* row_scales = value_scales + from;
    int16_t* out = codes + r * pitch;
    std::fill(out, out + pitch, int16_t{0});
    const float peak = row_max(row, length);
    f32x16 total = f32x16{}, top = f32x16{};
    int64_t i = 0;
    for (; i + 16 <= length; i += 16) {  // the weights in place of the scores
      f32x16 v, value_scale;
      std::memcpy(&v, row + i, sizeof(v));
      std::memcpy(&value_scale, row_scales + i, sizeof(value_scale));
      v = exp16(v - peak);
      total += v;
      const f32x16 weight = v * value_scale;
      top = (f32x16)_mm512_max_ps((__m512)top, (__m512)weight);
      std::memcpy(row + i, &weight, sizeof(weight));
    }
    float sum = hsum(total), wmax = _mm512_reduce_max_ps((__m512)top);
    for (; i < length; ++i) {
      const float prob = fast_exp(row[i] - peak);
      sum += prob;
      row[i] = prob * row_scales[i];
      wmax = std::max(wmax, row[i]);
    }
    inv_sum[r] = 1.f / sum;
    if (lse) lse[r] = peak + std::log(sum);
    if (std::isnan(peak) || std::isnan(sum)) wmax = NAN;
    if (!rounds_to_codes(wmax)) {
      weight_scales[r] = scale_without_codes(wmax);
      continue;
    }
    const __m512 by = _mm512_set1_ps(32767.f / wmax);
    i = 0;
    for (; i + 32 <= length; i += 32) store_int16_codes(out + from + i, _mm512_loadu_ps(row + i), _mm512_loadu_ps(row + i + 16), by);
    for (; i < length; ++i) out[from + i] = static_cast<int16_t>(std::nearbyint(row[i] * (32767.f / wmax)));
    weight_scales[r] = wmax / 32767.f;
  }
}

// one block's value pairs [pair_count] (16 dims each, lo and hi) added to the window's int32 sums
// sums [rows][chunks][2][16]
template <int RB>
inline void int16_values_block(int32_t* sums, const int16_t* codes, int64_t pitch, int chunks, int c, const __m512i* pairs_lo,
                               const __m512i* pairs_hi, int pair_count, int64_t at) {
  __m512i lo[RB], hi[RB];
  for (int r = 0; r < RB; ++r) {
    lo[r] = _mm512_loadu_si512(sums + (r * chunks + c) * 32);
    hi[r] = _mm512_loadu_si512(sums + (r * chunks + c) * 32 + 16);
  }
  for (int i = 0; i < pair_count; ++i)
    for (int r = 0; r < RB; ++r) {
      int32_t both;
      std::memcpy(&both, codes + r * pitch + at + 2 * i, sizeof(both));
      const __m512i weight = _mm512_set1_epi32(both);
      lo[r] = _mm512_dpwssd_epi32(lo[r], pairs_lo[i], weight);
      hi[r] = _mm512_dpwssd_epi32(hi[r], pairs_hi[i], weight);
    }
  for (int r = 0; r < RB; ++r) {
    _mm512_storeu_si512(sums + (r * chunks + c) * 32, lo[r]);
    _mm512_storeu_si512(sums + (r * chunks + c) * 32 + 16, hi[r]);
  }
}

// a window's int32 sums [count][width] into acc [count][width] (width a multiple of 16), each row's
// times its weight scale, fused; the sums zeroed for the next window
inline void add_window_sums(float* acc, int32_t* sums, int count, int64_t width, const float* weight_scales) {
  for (int r = 0; r < count; ++r) {
    const __m512 by = _mm512_set1_ps(weight_scales[r]);
    for (int64_t i = r * width; i < (r + 1) * width; i += 16)
      _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(sums + i)), by, _mm512_loadu_ps(acc + i)));
  }
  std::memset(sums, 0, sizeof(int32_t) * count * width);
}

// 32 int8 codes of a K/V row from dim c * 32 on, as int16
inline __m512i load_row_int16(const uint8_t* row, int c) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 32)));
}

#else
#define KVSERVE_INT8_ATTENTION 0
#endif
