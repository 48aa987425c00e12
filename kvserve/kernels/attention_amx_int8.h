// Tiles of bf16 queries over int8 K/V on AMX (paged_attention.cpp includes this inside its
// anonymous namespace, after attention_amx.h), with the bits of attention_int8.h's vectors.

#pragma once

#if KVSERVE_ATTENTION_AMX && KVSERVE_INT8_ATTENTION
#define KVSERVE_ATTENTION_AMX_INT8 1
// ---- int8 K/V on AMX tiles ----------------------------------------------------------------------
// attention_int8.h's integers on TDPB*D, whose byte products are summed exactly in int32 as
// vpdpwssd's are: a 16-bit code is split into a signed high byte and an unsigned low one
// (c = 256 * hi + lo), two tile products per int16 operand, and 256 * hi_sum + lo_sum is the exact
// sum attention_int8.h takes (its bounds keep both under 2^31).
// Scores: C[key][row] = K x Q^T over 64 dims a product, the A tile 16 slots of one block straight
// from the pool, the B tiles the query codes' bytes in groups of 4 dims; each key's total converted
// to float once and scaled as attention_int8.h does. Softmax: int16_probabilities. Values:
// C[row][dim] += W x V over 64 slots a product (steps from a multiple of 64 of the position), A the
// weight codes' bytes, B the value codes of 4 slots interleaved per dim (unpack order: column n of
// family f is dim 16 (n / 4) + 4 f + n % 4 of a 64-dim chunk); the sums added to the output at the
// end of every kInt8ValueWindow positions, as attention_int8.h adds them. Needs head_dim a multiple
// of 64, block_size a multiple of 16 that divides kInt8ValueWindow, at most 64 rows per tile.

constexpr int kAmxInt8Step = 64;  // dims (scores) or slots (values) per tile product

inline bool amx_int8_layout(const KVView& kv) {
  return kv.head_dim % kAmxInt8Step == 0 && kv.block_size % 16 == 0 && kInt8ValueWindow % kv.block_size == 0;
}

// int16 codes [n] (n a multiple of 32) -> their high bytes (signed) and low bytes (unsigned)
inline void split_int16_codes(const int16_t* codes, int64_t n, uint8_t* high, uint8_t* low) {
  const __m512i byte = _mm512_set1_epi16(0xff);
  for (int64_t i = 0; i < n; i += 32) {
    const __m512i c = _mm512_loadu_si512(codes + i);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(high + i), _mm512_cvtepi16_epi8(_mm512_srai_epi16(c, 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(low + i), _mm512_cvtepi16_epi8(_mm512_and_si512(c, byte)));
  }
}

// bytes [16 rows][row_bytes] from `rows` (row r at rows + r * stride), 64 of them from `at`: as a B
// tile of 16 columns (the rows) by 16 groups of 4 bytes
inline void stage_b_tile(const uint8_t* rows, int64_t stride, int64_t at, uint8_t* tile) {
  __m512 in[16];
  __m512i out[16];
  for (int r = 0; r < 16; ++r) in[r] = _mm512_castsi512_ps(_mm512_loadu_si512(rows + r * stride + at));
  transpose16x16(in, out);
  for (int g = 0; g < 16; ++g) _mm512_storeu_si512(tile + g * 64, out[g]);
}

// the exact int32 totals 256 * high + low of two C tiles' row
inline __m512i join_high_low(const int32_t* high, const int32_t* low) {
  return _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(high), 8), _mm512_load_si512(low));
}

// a 64-dim chunk of 4 value rows (slots 4q .. 4q + 3) as the 4 families' 64-byte B tile rows:
// family f's dword n holds dim 16 (n / 4) + 4 f + n % 4 of the 4 rows
inline void stage_value_quad(const __m512i rows[4], __m512i family[4]) {
  const __m512i low01 = _mm512_unpacklo_epi8(rows[0], rows[1]), high01 = _mm512_unpackhi_epi8(rows[0], rows[1]);
  const __m512i low23 = _mm512_unpacklo_epi8(rows[2], rows[3]), high23 = _mm512_unpackhi_epi8(rows[2], rows[3]);
  family[0] = _mm512_unpacklo_epi16(low01, low23);
  family[1] = _mm512_unpackhi_epi16(low01, low23);
  family[2] = _mm512_unpacklo_epi16(high01, high23);
  family[3] = _mm512_unpackhi_epi16(high01, high23);
}

KVSERVE_AMX_TARGET void attend_tile_amx_int8(float* out_rows, float* lse, const uint16_t* queries, const TileRows& rows, const KVView& kv,
                                             const int64_t* table, int kv_head, float scale, TileScratch& scratch) {
  const int head_dim = kv.head_dim, steps = head_dim / kAmxInt8Step, count = rows.count;
  const int qblocks = (count + 15) / 16, padded = qblocks * 16;
  const int64_t row_stride = kv.token_stride;
  const uint8_t* key_cache = static_cast<const uint8_t*>(kv.key);
  const uint8_t* value_cache = static_cast<const uint8_t*>(kv.value);
  const int64_t lo = rows.lo(), hi = rows.hi();
  const int64_t base = lo - lo % kAmxInt8Step, span = (hi - base + kAmxInt8Step - 1) / kAmxInt8Step * kAmxInt8Step;
  auto row_offset = [&](int64_t slot) { return block_offset(kv, table, slot, kv_head) + (slot % kv.block_size) * row_stride; };

  // the byte buffers: query code bytes [padded][head_dim] x 2, their B tiles [qblock][step][high, low][1,024],
  // weight code bytes [padded][span] x 2, value B tiles [chunk][family][span / 4][64]
  const size_t query_bytes = static_cast<size_t>(padded) * head_dim, weight_bytes = static_cast<size_t>(padded) * span;
  // rows past count (A rows, B columns) only reach C rows and columns nobody reads: left as they are
  scratch.amx_bytes.resize(2 * query_bytes + 2 * query_bytes + 2 * weight_bytes + static_cast<size_t>(span) * head_dim + 64);
  uint8_t* area = scratch.amx_bytes.data();
  area += (64 - reinterpret_cast<uintptr_t>(area) % 64) % 64;
  uint8_t *query_high = area, *query_low = query_high + query_bytes, *query_tiles = query_low + query_bytes;
  uint8_t *weight_high = query_tiles + 2 * query_bytes, *weight_low = weight_high + weight_bytes;
  uint8_t* value_tiles = weight_low + weight_bytes;

  scratch.int16_queries.resize(static_cast<size_t>(padded) * head_dim);
  scratch.query_scales.resize(count);
  int16_query_rows(scratch.int16_queries.data(), scratch.query_scales.data(), queries, count, head_dim);
  split_int16_codes(scratch.int16_queries.data(), static_cast<int64_t>(padded) * head_dim, query_high, query_low);
  auto query_tile = [&](int qb, int st, int part) { return query_tiles + ((static_cast<size_t>(qb) * steps + st) * 2 + part) * 1024; };
  for (int qb = 0; qb < qblocks; ++qb)
    for (int st = 0; st < steps; ++st) {
      stage_b_tile(query_high + static_cast<size_t>(qb) * 16 * head_dim, head_dim, st * kAmxInt8Step, query_tile(qb, st, 0));
      stage_b_tile(query_low + static_cast<size_t>(qb) * 16 * head_dim, head_dim, st * kAmxInt8Step, query_tile(qb, st, 1));
    }

  const amx::TileConfig config = amx::full_tiles();
  KVSERVE_TILE_LOADCONFIG(&config);
  alignas(64) int32_t c[4][16][16];

  // scores [rows][span] from slot base, 16 keys of a block at a time; C tiles 0-1 (high, low) of a
  // query block, 2-3 of the next; A (keys) in 4, B in 5-7
  scratch.scores.resize(static_cast<size_t>(count) * span);
  float* s = scratch.scores.data();
  const float* query_scales = scratch.query_scales.data();
  for (int64_t k0 = lo - lo % 16; k0 < hi; k0 += 16) {
    const uint8_t* keys = key_cache + row_offset(k0);
    alignas(64) float factor[16];
    const RunScales key_scales(kv, key_cache, row_offset(k0), k0 % kv.block_size, kv_head);
    for (int j = 0; j < 16; ++j) factor[j] = k0 + j >= lo && k0 + j < hi ? scale * key_scales[j] : 0.f;
    const __m512 by = _mm512_load_ps(factor);
    for (int qb = 0; qb < qblocks; qb += 2) {
      const bool pair = qb + 1 < qblocks;
      KVSERVE_TILE_ZERO(0);
      KVSERVE_TILE_ZERO(1);
      KVSERVE_TILE_ZERO(2);
      KVSERVE_TILE_ZERO(3);
      for (int st = 0; st < steps; ++st) {
        KVSERVE_TILE_LOADD(4, keys + st * kAmxInt8Step, row_stride);
        KVSERVE_TILE_LOADD(5, query_tile(qb, st, 0), 64);
        KVSERVE_TILE_DPBSSD(0, 4, 5);
        KVSERVE_TILE_LOADD(6, query_tile(qb, st, 1), 64);
        KVSERVE_TILE_DPBSUD(1, 4, 6);
        if (pair) {
          KVSERVE_TILE_LOADD(7, query_tile(qb + 1, st, 0), 64);
          KVSERVE_TILE_DPBSSD(2, 4, 7);
          KVSERVE_TILE_LOADD(5, query_tile(qb + 1, st, 1), 64);
          KVSERVE_TILE_DPBSUD(3, 4, 5);
        }
      }
      KVSERVE_TILE_STORED(0, c[0], 64);
      KVSERVE_TILE_STORED(1, c[1], 64);
      if (pair) {
        KVSERVE_TILE_STORED(2, c[2], 64);
        KVSERVE_TILE_STORED(3, c[3], 64);
      }
      for (int m = 0; m < (pair ? 2 : 1); ++m) {
        __m512 totals[16];
        __m512i by_row[16];
        for (int j = 0; j < 16; ++j) totals[j] = _mm512_castsi512_ps(join_high_low(c[2 * m][j], c[2 * m + 1][j]));
        transpose16x16(totals, by_row);
        for (int n = 0; n < 16; ++n) {
          const int r = (qb + m) * 16 + n;
          if (r >= count) break;
          const __m512 scores = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(by_row[n]), by), _mm512_set1_ps(query_scales[r]));
          _mm512_storeu_ps(s + r * span + (k0 - base), scores);
        }
      }
    }
  }

  // softmax: the weights' int16 codes [rows][span] (0 outside each row's range), split in bytes
  std::vector<float>& value_scales = scratch.value_scales;
  value_scales.assign(span + 16, 0.f);
  for_each_block(kv, table, lo, hi, kv_head, [&](int64_t start, int64_t begin, int64_t end, int64_t offset, int64_t) {
    const RunScales block_scales(kv, value_cache, offset, 0, kv_head);
    for (int64_t slot = begin; slot < end; ++slot) value_scales[slot - base] = block_scales[slot - start];
  });
  std::vector<int16_t>& codes = scratch.int16_queries;  // the query codes are staged: reused for the weights'
  codes.resize(static_cast<size_t>(padded) * span);
  std::vector<float> inv_sum(count), weight_scales(count);
  int16_probabilities(s, span, base, rows, value_scales.data(), codes.data(), span, inv_sum.data(), lse, weight_scales.data());
  split_int16_codes(codes.data(), static_cast<int64_t>(padded) * span, weight_high, weight_low);

  // value B tiles: per 64-dim chunk and family, one 64-byte row per 4 slots from base; slots
  // outside [lo, hi) are zeros
  const int chunks = head_dim / kAmxInt8Step;
  const int64_t quads = span / 4;
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t q = 0; q < quads; ++q) {
    const int64_t first = base + 4 * q;  // the 4 slots are in one block (block_size a multiple of 16)
    const uint8_t* quad = first + 3 >= lo && first < hi ? value_cache + row_offset(first) : nullptr;
    const uint8_t* slot_rows[4];
    for (int i = 0; i < 4; ++i) slot_rows[i] = quad && first + i >= lo && first + i < hi ? quad + i * row_stride : nullptr;
    for (int ch = 0; ch < chunks; ++ch) {
      __m512i four[4], family[4];
      for (int i = 0; i < 4; ++i) four[i] = slot_rows[i] ? _mm512_loadu_si512(slot_rows[i] + ch * 64) : zero;
      stage_value_quad(four, family);
      for (int f = 0; f < 4; ++f) _mm512_storeu_si512(value_tiles + ((static_cast<size_t>(ch) * 4 + f) * quads + q) * 64, family[f]);
    }
  }

  // values: acc [rows][chunk][family][16] float; C tiles 0-1 (high, low weights) of family f, 2-3
  // of family f + 1; A (weights' high, low bytes) in 4-5, B (the families) in 6-7
  scratch.acc.assign(static_cast<size_t>(count) * head_dim, 0.f);
  float* acc = scratch.acc.data();
  const int value_steps = static_cast<int>(span / kAmxInt8Step);
  for (int ch = 0; ch < chunks; ++ch)
    for (int f = 0; f < 4; f += 2)
      for (int qb = 0; qb < qblocks; ++qb) {
        KVSERVE_TILE_ZERO(0);
        KVSERVE_TILE_ZERO(1);
        KVSERVE_TILE_ZERO(2);
        KVSERVE_TILE_ZERO(3);
        for (int st = 0; st < value_steps; ++st) {
          const size_t at = static_cast<size_t>(qb) * 16 * span + static_cast<size_t>(st) * kAmxInt8Step;
          KVSERVE_TILE_LOADD(4, weight_high + at, span);
          KVSERVE_TILE_LOADD(5, weight_low + at, span);
          KVSERVE_TILE_LOADD(6, value_tiles + ((static_cast<size_t>(ch) * 4 + f) * quads + st * 16) * 64, 64);
          KVSERVE_TILE_LOADD(7, value_tiles + ((static_cast<size_t>(ch) * 4 + f + 1) * quads + st * 16) * 64, 64);
          KVSERVE_TILE_DPBSSD(0, 4, 6);
          KVSERVE_TILE_DPBUSD(1, 5, 6);
          KVSERVE_TILE_DPBSSD(2, 4, 7);
          KVSERVE_TILE_DPBUSD(3, 5, 7);
          const int64_t reached = base + static_cast<int64_t>(st + 1) * kAmxInt8Step;
          if (reached % kInt8ValueWindow != 0 && st + 1 < value_steps) continue;
          // a window's end: its sums into acc, as add_window_sums does
          KVSERVE_TILE_STORED(0, c[0], 64);
          KVSERVE_TILE_STORED(1, c[1], 64);
          KVSERVE_TILE_STORED(2, c[2], 64);
          KVSERVE_TILE_STORED(3, c[3], 64);
          for (int n = 0; n < 16; ++n) {
            const int r = qb * 16 + n;
            if (r >= count) break;
            const __m512 by = _mm512_set1_ps(weight_scales[r]);
            for (int m = 0; m < 2; ++m) {
              float* out = acc + static_cast<size_t>(r) * head_dim + (ch * 4 + f + m) * 16;
              _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(join_high_low(c[2 * m][n], c[2 * m + 1][n])), by, _mm512_loadu_ps(out)));
            }
          }
          KVSERVE_TILE_ZERO(0);
          KVSERVE_TILE_ZERO(1);
          KVSERVE_TILE_ZERO(2);
          KVSERVE_TILE_ZERO(3);
        }
      }
  KVSERVE_TILE_RELEASE();

  // acc's families back in dim order, times 1 / the sum
  for (int r = 0; r < count; ++r)
    for (int ch = 0; ch < chunks; ++ch)
      for (int f = 0; f < 4; ++f)
        for (int n = 0; n < 16; ++n)
          out_rows[static_cast<size_t>(r) * head_dim + ch * 64 + 16 * (n / 4) + 4 * f + n % 4] =
              acc[static_cast<size_t>(r) * head_dim + (ch * 4 + f) * 16 + n] * inv_sum[r];
}

// AMX's int8 products run here: AMX attention is on (attention_amx_enabled) and the CPU has
// AMX-INT8, CPUID.(7,0):EDX bit 25 (every AMX CPU so far has it with AMX-BF16)
bool attention_amx_int8_enabled() {
  static const bool has_int8 = [] {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 25) & 1);
  }();
  return has_int8 && attention_amx_enabled();
}
#else
#define KVSERVE_ATTENTION_AMX_INT8 0
#endif  // KVSERVE_ATTENTION_AMX && KVSERVE_INT8_ATTENTION
