// GGUF blocks times rows quantized to int8, with AVX512-VNNI integer dot products (gguf_matmul.cpp
// includes this after its block decoding): the activations path of `--gguf-activations int8`.
//
// Each row is quantized per block of 32 values (llama.cpp's Q8_0 rows): dx = max|x| / 127 and
// q = round(x * 127 / max|x|), so a row's codes and scales depend on that row alone. A weight's
// block value is scale * (u - offset) (+ min), u its unsigned code (Q8_0's signed codes shifted by
// 128), so over one of its sub-blocks s (32 values; 16 for Q6_K):
//
//   y += dx_s * (scale_s * (S_s - offset * Q_s) + min_s * Q_s),   S_s = sum u_l * q_l (vpdpbusd),
//                                                                 Q_s = sum q_l
//
// S_s - offset * Q_s is exact in int32; the float operations per sub-block are the same, in the same
// order, in the few-row (fused) and the many-row (tiled) walks, so a row's result does not depend
// on its batch. The weights keep the file's exact values: the only loss is the rows' quantization.
//
// A decoded tile is 16 rows' codes as quads [k/4][16][4] (vpdpbusd's operand: four consecutive
// values of each row in one 32-bit lane), then each sub-block's 16 scales and, for the types with
// a min, 16 mins. The interleaved tile layout holds byte j of the 16 rows' blocks together, so four
// consecutive bytes of the 16 rows are one 64-byte load and one byte permutation from quads.

#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define KVSERVE_HAS_GGUF_INT8 1
#else
#define KVSERVE_HAS_GGUF_INT8 0
#endif

#if KVSERVE_HAS_GGUF_INT8

namespace q8 {

// values per scale: 16 for Q6_K, 32 for the others
constexpr int sub_values(int type) { return type == kQ6_K ? 16 : 32; }
constexpr bool has_min(int type) { return type == kQ4_1 || type == kQ5_1 || type == kQ4_K || type == kQ5_K; }
constexpr int code_offset(int type) { return type == kQ8_0 ? 128 : type == kQ4_0 ? 8 : type == kQ5_0 ? 16 : type == kQ6_K ? 32 : 0; }

// Rows quantized per block of 32: codes [rows][k], scales [rows][k/32], code sums per 16 values
struct Rows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum16;
  int k = 0;
};

// A block of 32 floats' codes and scale; a NaN or an infinity gives a NaN scale (the outputs are
// NaN, as the float path's would be). 127 / max|x| overflows below max|x| ~ 3.7e-37: such a block
// is quantized in double, to the same codes an exact 127 / max|x| would give.
inline void quantize_block(__m512 lo, __m512 hi, int8_t* q, float* d, int32_t* sum16) {
  const __mmask16 nan = _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  if (nan || !std::isfinite(amax)) {
    std::memset(q, 0, 32);
    *d = std::numeric_limits<float>::quiet_NaN();
    sum16[0] = sum16[1] = 0;
    return;
  }
  *d = amax / 127.0f;
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  if (!std::isfinite(inverse)) {
    alignas(64) float v[32];
    _mm512_store_ps(v, lo);
    _mm512_store_ps(v + 16, hi);
    sum16[0] = sum16[1] = 0;
    for (int j = 0; j < 32; ++j) {
      q[j] = static_cast<int8_t>(std::nearbyint(static_cast<double>(v[j]) * 127.0 / static_cast<double>(amax)));
      sum16[j / 16] += q[j];
    }
    return;
  }
  const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inverse)));  // round to nearest even
  const __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inverse)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(a));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(b));
  sum16[0] = _mm512_reduce_add_epi32(a);
  sum16[1] = _mm512_reduce_add_epi32(b);
}

inline const Rows& quantize(const void* x, bool bf16, int64_t ldx, int rows, int k) {
  thread_local Rows buffer;
  Rows& r = buffer;  // the caller's: inside the parallel loop below, `buffer` would name each worker's own
  r.k = k;
  r.q.resize(static_cast<size_t>(rows) * k);
  r.d.resize(static_cast<size_t>(rows) * (k / 32));
  r.sum16.resize(static_cast<size_t>(rows) * (k / 16));
#pragma omp parallel for schedule(static) if (rows >= 16)
  for (int m = 0; m < rows; ++m)
    for (int b = 0; b < k / 32; ++b) {
      __m512 lo, hi;
      if (bf16) {
        const uint16_t* v = static_cast<const uint16_t*>(x) + m * ldx + b * 32;
        lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v))), 16));
        hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16))), 16));
      } else {
        const float* v = static_cast<const float*>(x) + m * ldx + b * 32;
        lo = _mm512_loadu_ps(v);
        hi = _mm512_loadu_ps(v + 16);
      }
      const size_t at = static_cast<size_t>(m) * k + b * 32;
      quantize_block(lo, hi, r.q.data() + at, r.d.data() + static_cast<size_t>(m) * (k / 32) + b, r.sum16.data() + at / 16);
    }
  return r;
}

// What a type's sub-blocks need of each row: the row's scale, offset * its code sum (int), and its
// code sum as a float (the types with a min), [rows][subs]
struct SubTerms {
  std::vector<float> dx;
  std::vector<int32_t> corr;
  std::vector<float> sum;
  int subs = 0;
};

inline void sub_terms(const Rows& x, int type, int rows, SubTerms& t) {
  const int sv = sub_values(type), subs = x.k / sv, off = code_offset(type);
  t.subs = subs;
  t.dx.resize(static_cast<size_t>(rows) * subs);
  t.corr.resize(t.dx.size());
  t.sum.resize(t.dx.size());
  for (int m = 0; m < rows; ++m)
    for (int s = 0; s < subs; ++s) {
      const size_t i = static_cast<size_t>(m) * subs + s;
      const int32_t* sums = x.sum16.data() + static_cast<size_t>(m) * (x.k / 16);
      const int32_t q = sv == 16 ? sums[s] : sums[2 * s] + sums[2 * s + 1];
      t.dx[i] = x.d[static_cast<size_t>(m) * (x.k / 32) + s * sv / 32];
      t.corr[i] = off * q;
      t.sum[i] = static_cast<float>(q);
    }
}

// bytes j..j+3 of the tile's 16 blocks ([4][16] in the interleaved layout) as quads [16][4]
inline __m512i quads_at(const uint8_t* blk, int j) {
  alignas(64) static const uint8_t index[64] = {
      0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53, 6, 22, 38, 54, 7, 23, 39, 55,
      8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59, 12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
  return _mm512_permutexvar_epi8(_mm512_load_si512(index), _mm512_loadu_si512(blk + j * kTile));
}

// byte j of the tile's 16 blocks, each row's byte repeated in its four lanes of a quad
inline __m512i bytes_to_quads(const uint8_t* blk, int j) {
  alignas(64) static const uint8_t index[64] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7,
                                                8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11, 12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15};
  return _mm512_permutexvar_epi8(_mm512_load_si512(index), _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + j * kTile))));
}

// 0x10 added to each code whose bit (first + lane in quad) of its row's byte `bits` is set (Q5_0/Q5_1's fifth bits)
inline __m512i with_fifth_bits(__m512i codes, __m512i bits, int first) {
  const __m512i pattern = _mm512_set1_epi32(static_cast<int32_t>((1u << first) | (1u << (first + 1)) << 8 | (1u << (first + 2)) << 16 | (1u << (first + 3)) << 24));
  return _mm512_mask_add_epi8(codes, _mm512_test_epi8_mask(bits, pattern), codes, _mm512_set1_epi8(0x10));
}

inline __m512i nibbles(__m512i v, bool high) { return _mm512_and_si512(high ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0F)); }

// Decodes one block of a 16-row tile into sink: its quads in increasing value order (sink.quad),
// each sub-block's scale after its quads (sink.scale), then for the types with one its min (sink.min)
template <int T, typename Sink>
inline void decode_block(const uint8_t* blk, Sink& sink) {
  if constexpr (T == kQ8_0) {
    for (int l = 0; l < 32; l += 4) sink.quad(_mm512_xor_si512(quads_at(blk, 2 + l), _mm512_set1_epi8(static_cast<char>(0x80))));
    sink.scale(lanes_half(blk, 0).v);
  } else if constexpr (T == kQ4_0 || T == kQ4_1) {
    constexpr int qs_at = T == kQ4_1 ? 4 : 2;
    for (int high = 0; high < 2; ++high)
      for (int l = 0; l < 16; l += 4) sink.quad(nibbles(quads_at(blk, qs_at + l), high));
    sink.scale(lanes_half(blk, 0).v);
    if constexpr (T == kQ4_1) sink.min(lanes_half(blk, 2).v);
  } else if constexpr (T == kQ5_0 || T == kQ5_1) {
    constexpr int qh_at = T == kQ5_1 ? 4 : 2, qs_at = T == kQ5_1 ? 8 : 6;
    for (int high = 0; high < 2; ++high)  // values 0-15 (low nibbles, bits 0-15 of qh), then 16-31
      for (int l = 0; l < 16; l += 4) {
        const int bit = high * 16 + l;
        sink.quad(with_fifth_bits(nibbles(quads_at(blk, qs_at + l), high), bytes_to_quads(blk, qh_at + bit / 8), bit % 8));
      }
    sink.scale(lanes_half(blk, 0).v);
    if constexpr (T == kQ5_1) sink.min(lanes_half(blk, 2).v);
  } else if constexpr (T == kQ4_K || T == kQ5_K) {
    const V16 d = lanes_half(blk, 0), dmin = lanes_half(blk, 2);
    constexpr int qs_at = T == kQ5_K ? 48 : 16;
    for (int s = 0; s < 8; ++s) {
      u8x16 sc, mn;
      k4_scale_min(blk, s, sc, mn);
      for (int l = 0; l < 32; l += 4) {
        __m512i codes = nibbles(quads_at(blk, qs_at + (s / 2) * 32 + l), s & 1);
        if constexpr (T == kQ5_K)
          codes = _mm512_mask_add_epi8(codes, _mm512_test_epi8_mask(quads_at(blk, 16 + l), _mm512_set1_epi8(static_cast<char>(1 << s))), codes,
                                       _mm512_set1_epi8(0x10));
        sink.quad(codes);
      }
      sink.scale((d * to_float(sc)).v);
      sink.min(_mm512_sub_ps(_mm512_setzero_ps(), (dmin * to_float(mn)).v));  // the value is ds * q - dmin * mn
    }
  } else {  // Q6_K: sub-blocks of 16 values
    const V16 d = lanes_half(blk, 208);
    for (int half = 0; half < 2; ++half)
      for (int j = 0; j < 4; ++j) {  // 32 values: low nibbles from ql (shift (j / 2) * 4), high bits from qh (shift j * 2)
        const int p0 = half * 128 + j * 32;
        for (int l = 0; l < 32; l += 4) {
          const __m512i low = nibbles(quads_at(blk, half * 64 + (j % 2) * 32 + l), j / 2);
          const __m512i high = _mm512_and_si512(_mm512_srli_epi16(quads_at(blk, 128 + half * 32 + l), j * 2), _mm512_set1_epi8(3));
          sink.quad(_mm512_or_si512(low, _mm512_slli_epi16(high, 4)));
          if (l == 12 || l == 28) sink.scale((d * to_float(reinterpret_cast<i8x16>(lanes(blk, 192 + (p0 + l) / 16)))).v);
        }
      }
  }
}

// a decoded tile: quads [k/4][64 bytes], then per sub-block 16 scales, then (min types) 16 mins
struct TileShape {
  int quads;
  int subs;
  bool mins;
  int64_t bytes() const { return static_cast<int64_t>(quads) * 64 + static_cast<int64_t>(subs) * 64 * (mins ? 2 : 1); }
};

inline TileShape tile_shape(int type, int k) { return {k / 4, k / sub_values(type), has_min(type)}; }

struct TileWriter {
  __m512i* quads;
  __m512* scales;
  __m512* mins;
  void quad(__m512i w) { _mm512_store_si512(quads++, w); }
  void scale(__m512 s) { _mm512_store_ps(scales++, s); }
  void min(__m512 m) { _mm512_store_ps(mins++, m); }
};

template <int T>
void decode_tile(const uint8_t* tile, int k, uint8_t* out) {
  constexpr BlockShape shape = block_shape(T);
  const TileShape ts = tile_shape(T, k);
  __m512* scales = reinterpret_cast<__m512*>(out + static_cast<int64_t>(ts.quads) * 64);
  TileWriter writer{reinterpret_cast<__m512i*>(out), scales, scales + ts.subs};
  for (int b = 0; b < k / shape.values; ++b) decode_block<T>(tile + static_cast<int64_t>(b) * shape.bytes * kTile, writer);
}

using TileDecoder = void (*)(const uint8_t*, int, uint8_t*);

inline TileDecoder tile_decoder(int type) {
  return for_type(type, TileDecoder{}, [](auto t) -> TileDecoder { return decode_tile<decltype(t)::value>; });
}

// the rows as a kernel reads them: codes (row stride ldq) and their per-sub-block terms
struct RowsView {
  const int8_t* q;
  int64_t ldq;
  const float* dx;
  const int32_t* corr;
  const float* sum;
  int subs;
  RowsView from(int row) const {
    const int64_t at = static_cast<int64_t>(row) * subs;
    return {q + row * ldq, ldq, dx + at, corr + at, sum + at, subs};
  }
};

// One sub-block's integer sums into a row's float accumulator: the same operations, in the same
// order, on both walks
template <bool MINS>
inline __m512 fold(__m512 acc, __m512i sums, __m512 scale, __m512 min, const RowsView& x, int m, int s) {
  const int64_t i = static_cast<int64_t>(m) * x.subs + s;
  __m512 v = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_sub_epi32(sums, _mm512_set1_epi32(x.corr[i]))));
  if constexpr (MINS) v = _mm512_fmadd_ps(min, _mm512_set1_ps(x.sum[i]), v);
  return _mm512_fmadd_ps(_mm512_set1_ps(x.dx[i]), v, acc);
}

inline __m512i row_quad(const RowsView& x, int m, int p) {
  int32_t quad;
  std::memcpy(&quad, x.q + m * x.ldq + 4 * p, sizeof(quad));
  return _mm512_set1_epi32(quad);
}

// MR rows against NT decoded tiles (tile_bytes apart): a sub-block's integer sums and the running
// float sums all in registers (MR x NT of each)
template <int SUBQ, bool MINS, int MR, int NT>
inline void micro_kernel(const uint8_t* tiles, int64_t tile_bytes, const TileShape& ts, const RowsView& x, __m512 (&acc)[MR][NT]) {
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  for (int s = 0; s < ts.subs; ++s) {
    __m512i sub[MR][NT];
    for (int m = 0; m < MR; ++m)
      for (int t = 0; t < NT; ++t) sub[m][t] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int p = s * SUBQ; p < (s + 1) * SUBQ; ++p) {
      __m512i w[NT];
      for (int t = 0; t < NT; ++t) w[t] = _mm512_load_si512(tiles + t * tile_bytes + static_cast<int64_t>(p) * 64);
      for (int m = 0; m < MR; ++m) {
        const __m512i a = row_quad(x, m, p);
        for (int t = 0; t < NT; ++t) sub[m][t] = _mm512_dpbusd_epi32(sub[m][t], w[t], a);
      }
    }
    for (int t = 0; t < NT; ++t) {
      const float* scales = reinterpret_cast<const float*>(tiles + t * tile_bytes + static_cast<int64_t>(ts.quads) * 64);
      const __m512 scale = _mm512_load_ps(scales + s * kTile);
      const __m512 min = MINS ? _mm512_load_ps(scales + (ts.subs + s) * kTile) : _mm512_setzero_ps();
      for (int m = 0; m < MR; ++m) acc[m][t] = fold<MINS>(acc[m][t], sub[m][t], scale, min, x, m, s);
    }
  }
}

constexpr int kRows = 4;  // rows per register block (x 3 tiles: 12 integer and 12 float accumulators)
constexpr int kTilesPerBlock = 3;

template <int SUBQ, bool MINS, int MR, int NT>
void block(const Problem& p, const uint8_t* tiles, int64_t tile_bytes, const TileShape& ts, int64_t first, const RowsView& x, int row, void* out,
           RowBest* best) {
  __m512 acc[MR][NT];
  micro_kernel<SUBQ, MINS, MR, NT>(tiles, tile_bytes, ts, x.from(row), acc);
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MR; ++m) emit(p, first + t, row + m, (f32x16)acc[m][t], out, best);
}

template <int SUBQ, bool MINS, int MR, int NT>
void remainder(const Problem& p, const uint8_t* tiles, int64_t tile_bytes, const TileShape& ts, int64_t first, const RowsView& x, int row, int rows,
               void* out, RowBest* best) {
  if constexpr (MR > 0) {
    if (rows - row >= MR) {
      block<SUBQ, MINS, MR, NT>(p, tiles, tile_bytes, ts, first, x, row, out, best);
      row += MR;
    }
    remainder<SUBQ, MINS, MR - 1, NT>(p, tiles, tile_bytes, ts, first, x, row, rows, out, best);
  }
}

template <int SUBQ, bool MINS, int NT>
void rows_block(const Problem& p, const uint8_t* tiles, int64_t tile_bytes, const TileShape& ts, int64_t first, const RowsView& x, int rows, void* out,
                RowBest* best) {
  int row = 0;
  for (; row + kRows <= rows; row += kRows) block<SUBQ, MINS, kRows, NT>(p, tiles, tile_bytes, ts, first, x, row, out, best);
  remainder<SUBQ, MINS, kRows - 1, NT>(p, tiles, tile_bytes, ts, first, x, row, rows, out, best);
}

template <int SUBQ, bool MINS>
void tiles_block(const Problem& p, const uint8_t* tiles, int64_t tile_bytes, const TileShape& ts, int64_t first, int64_t count, const RowsView& x, int rows,
                 void* out, RowBest* best) {
  if (count == 3) rows_block<SUBQ, MINS, 3>(p, tiles, tile_bytes, ts, first, x, rows, out, best);
  else if (count == 2) rows_block<SUBQ, MINS, 2>(p, tiles, tile_bytes, ts, first, x, rows, out, best);
  else rows_block<SUBQ, MINS, 1>(p, tiles, tile_bytes, ts, first, x, rows, out, best);
}

using TilesBlock = void (*)(const Problem&, const uint8_t*, int64_t, const TileShape&, int64_t, int64_t, const RowsView&, int, void*, RowBest*);

inline TilesBlock tiles_block_for(int type) {
  if (type == kQ6_K) return tiles_block<4, false>;
  return has_min(type) ? tiles_block<8, true> : tiles_block<8, false>;
}

// Few rows (a decode step): each tile's quads go straight into the rows' sums as they are decoded
template <int MR, bool MINS>
struct FusedRows {
  __m512i sub[MR];
  __m512 acc[MR], pending;  // pending: a min type's sub-block scale, until its min
  RowsView x;
  int p = 0, s = 0;
  explicit FusedRows(const RowsView& x_) : x(x_) {
    for (int m = 0; m < MR; ++m) {
      sub[m] = _mm512_setzero_si512();
      acc[m] = _mm512_setzero_ps();
    }
  }
  void quad(__m512i w) {
    for (int m = 0; m < MR; ++m) sub[m] = _mm512_dpbusd_epi32(sub[m], w, row_quad(x, m, p));
    ++p;
  }
  void scale(__m512 sc) {
    if constexpr (MINS) {
      pending = sc;
    } else {
      for (int m = 0; m < MR; ++m) {
        acc[m] = fold<false>(acc[m], sub[m], sc, sc, x, m, s);
        sub[m] = _mm512_setzero_si512();
      }
      ++s;
    }
  }
  void min(__m512 mn) {
    for (int m = 0; m < MR; ++m) {
      acc[m] = fold<true>(acc[m], sub[m], pending, mn, x, m, s);
      sub[m] = _mm512_setzero_si512();
    }
    ++s;
  }
};

template <int T, int MR>
void fused_tile(const Weight& w, int64_t t, const Problem& p, const RowsView& x, RowBest* best) {
  constexpr BlockShape shape = block_shape(T);
  FusedRows<MR, has_min(T)> rows(x);
  const uint8_t* tile = w.tiles + t * w.tile_bytes;
  const uint8_t* ahead = (t + kPrefetchTiles) * kTile < w.n ? tile + kPrefetchTiles * w.tile_bytes : nullptr;
  constexpr int64_t block_bytes = static_cast<int64_t>(shape.bytes) * kTile;
  for (int b = 0; b < w.k / shape.values; ++b) {
    if (ahead) prefetch_block(ahead + b * block_bytes, block_bytes);
    decode_block<T>(tile + b * block_bytes, rows);
  }
  for (int m = 0; m < MR; ++m) emit(p, t, m, (f32x16)rows.acc[m], p.out, best);
}

constexpr int kFusedRows = 8;
using FusedTile = void (*)(const Weight&, int64_t, const Problem&, const RowsView&, RowBest*);

inline FusedTile fused_tile_for(int type, int rows) {
  return for_type(type, FusedTile{}, [rows](auto t) {
    return for_rows<1, kFusedRows>(rows, FusedTile{}, [](auto r) -> FusedTile { return fused_tile<decltype(t)::value, decltype(r)::value>; });
  });
}

// one weight of a product: its tiles, type, the rows' terms for its type (set by run), where it writes
struct Part {
  Weight w;
  Problem p;
  int type;
  int64_t tiles;
  const SubTerms* terms = nullptr;
  RowsView view(const Rows& x) const { return {x.q.data(), x.k, terms->dx.data(), terms->corr.data(), terms->sum.data(), terms->subs}; }
};

// Few rows against several weights that share them: every part's tiles in one parallel loop
void run_fused(const std::vector<Part>& parts, const Rows& x, int rows, int64_t* argmax) {
  int64_t total = 0;
  std::vector<FusedTile> fused;
  for (const Part& part : parts) {
    total += part.tiles;
    fused.push_back(fused_tile_for(part.type, rows));
  }
  std::vector<float> merged_value(rows, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> merged_index(rows, -1);
#pragma omp parallel
  {
    std::vector<RowBest> best;
    if (argmax) best.assign(rows, RowBest{f32x16{} - std::numeric_limits<float>::infinity(), i32x16{} - 1});
    const int threads = omp_get_num_threads(), me = omp_get_thread_num();
    size_t i = 0;
    int64_t before = 0;
    for (int64_t g = total * me / threads; g < total * (me + 1) / threads; ++g) {
      while (g - before >= parts[i].tiles) before += parts[i++].tiles;
      const Part& part = parts[i];
      fused[i](part.w, g - before, part.p, part.view(x), argmax ? best.data() : nullptr);
    }
    if (argmax) merge_best(best, merged_value, merged_index);
  }
  if (argmax)
    for (int r = 0; r < rows; ++r) argmax[r] = merged_index[r] < 0 ? 0 : merged_index[r];
}

// More rows against one weight: each tile decoded once per chunk of rows
void run_tiled(const Part& part, const Rows& x, int rows, int64_t* argmax) {
  const Weight& w = part.w;
  const Problem& p = part.p;
  const TileShape ts = tile_shape(part.type, w.k);
  const TileDecoder decode = tile_decoder(part.type);
  const TilesBlock tiles_for = tiles_block_for(part.type);
  const RowsView all = part.view(x);
  std::vector<float> merged_value(rows, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> merged_index(rows, -1);
  const int64_t blocks = (part.tiles + kTilesPerBlock - 1) / kTilesPerBlock;
  const int64_t tile_bytes = (ts.bytes() + 63) / 64 * 64;
#pragma omp parallel
  {
    std::vector<RowBest> best;
    if (argmax) best.assign(rows, RowBest{f32x16{} - std::numeric_limits<float>::infinity(), i32x16{} - 1});
    uint8_t* decoded = static_cast<uint8_t*>(std::aligned_alloc(64, tile_bytes * kTilesPerBlock));
    const int threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t block_begin = blocks * me / threads, block_end = blocks * (me + 1) / threads;
    // rows per pass over the thread's tiles: their codes (1 MB, and at least 256 rows) stay in L2 or L3
    const int chunk_rows = std::max(256, static_cast<int>((1 << 20) / w.k) / kRows * kRows);
    const int64_t out_bytes = p.out_dtype == kFloat32 ? 4 : 2;
    for (int r0 = 0; r0 < rows; r0 += chunk_rows) {
      const int chunk = std::min(chunk_rows, rows - r0);
      const RowsView xc = all.from(r0);
      void* oc = p.out ? static_cast<void*>(static_cast<char*>(p.out) + static_cast<int64_t>(r0) * p.ldo * out_bytes) : nullptr;
      RowBest* bc = argmax ? best.data() + r0 : nullptr;
      for (int64_t b = block_begin; b < block_end; ++b) {
        const int64_t first = b * kTilesPerBlock;
        const int64_t count = std::min<int64_t>(kTilesPerBlock, part.tiles - first);
        for (int64_t t = 0; t < count; ++t) decode(w.tiles + (first + t) * w.tile_bytes, w.k, decoded + t * tile_bytes);
        tiles_for(p, decoded, tile_bytes, ts, first, count, xc, chunk, oc, bc);
      }
    }
    std::free(decoded);
    if (argmax) merge_best(best, merged_value, merged_index);
  }
  if (argmax)
    for (int r = 0; r < rows; ++r) argmax[r] = merged_index[r] < 0 ? 0 : merged_index[r];
}

// x (float32 or bf16 [rows, k], row stride ldx) @ each part's weight^T: the rows quantized once
void run(std::vector<Part>& parts, const void* x, bool bf16, int64_t ldx, int rows, int64_t* argmax) {
  const Rows& q = quantize(x, bf16, ldx, rows, parts[0].w.k);
  thread_local std::vector<SubTerms> terms;
  if (terms.size() < parts.size()) terms.resize(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    sub_terms(q, parts[i].type, rows, terms[i]);
    parts[i].terms = &terms[i];
  }
  if (rows <= kFusedRows) {
    run_fused(parts, q, rows, argmax);
    return;
  }
  for (const Part& part : parts) run_tiled(part, q, rows, argmax);
}

}  // namespace q8

#endif  // KVSERVE_HAS_GGUF_INT8
