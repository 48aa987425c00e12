// Tiles of bf16 queries over bf16 K/V on AMX (paged_attention.cpp includes this inside its
// anonymous namespace, after attention_bf16.h), and whether they run here.

#pragma once

#if KVSERVE_ATTENTION_AMX
// ---- bf16 K/V and queries on AMX tiles ----------------------------------------------------------
// The per-row contract of attention_tiles.h, on TDPBF16PS. Scores: C[key][row] = K x Q^T, the
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
