// GGUF blocks times bf16 rows with AVX512-BF16 dot products (gguf_matmul.cpp includes this after
// its block decoding). A block's value is scale * code (+ min): Q8_0 d * q, Q4_0 d * (q - 8),
// Q4_1 d * q + m, Q4_K (d * sc) * q - dmin * mn, Q6_K (d * sc) * (q - 32), ... Its codes are
// small integers, exact in bf16, so instead of rounding each dequantized value to bf16 the kernel
// multiplies the row by the codes themselves, the products exact in float32:
//
//   y = sum over sub-blocks s of  scale_s * S_s  +  min_s * X_s,   S_s = sum x_l * code_l (vdpbf16ps),
//                                                                  X_s = sum x_l (float32, sub_block_sums)
//
// one float32 FMA chain over the sub-blocks. The weights are the file's exact values (never
// rounded to bf16), the only roundings are the float32 sums. A decoded tile is 16 rows' codes as
// bf16 pairs ([k/2][16][2], vdpbf16ps's operand) with each sub-block's scale and min as 16 lanes;
// every row count decodes the same tiles and runs the same chains, so a row's result does not
// depend on its batch.

#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVSERVE_HAS_GGUF_DOT 1
#else
#define KVSERVE_HAS_GGUF_DOT 0
#endif

#if KVSERVE_HAS_GGUF_DOT

namespace dot {

// codes per scale: 16 for Q6_K, 32 for the others
constexpr int sub_values(int type) { return type == kQ6_K ? 16 : 32; }
constexpr bool has_min(int type) { return type == kQ4_1 || type == kQ5_1 || type == kQ4_K || type == kQ5_K; }

// a decoded tile: pairs [k/2][32 bf16], then per sub-block 16 scales, then (min types) 16 mins
struct TileShape {
  int pairs;
  int subs;
  bool mins;
  int64_t bytes() const { return static_cast<int64_t>(pairs) * 64 + static_cast<int64_t>(subs) * 64 * (mins ? 2 : 1); }
};

inline TileShape tile_shape(int type, int k) { return {k / 2, k / sub_values(type), has_min(type)}; }

// bf16 of code - offset for codes 0..63, as two 32-entry tables for vpermt2w
struct CodeTable {
  __m512i lo, hi;
  explicit CodeTable(int offset) {
    alignas(64) uint16_t t[64];
    for (int i = 0; i < 64; ++i) {
      const float f = static_cast<float>(i - offset);
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof(bits));
      t[i] = static_cast<uint16_t>(bits >> 16);  // exact: |code - offset| < 256
    }
    lo = _mm512_load_si512(t);
    hi = _mm512_load_si512(t + 32);
  }
};

// bytes 0-15 (value v of rows 0-15) and 16-31 (value v + 1) as words v, v + 1 of row 0, then row 1, ...
inline __m512i interleave_words(__m256i codes) {
#if defined(__AVX512VBMI__)
  alignas(64) static const uint8_t index[64] = {
      0, 0, 16, 0, 1, 0, 17, 0, 2, 0, 18, 0, 3, 0, 19, 0, 4, 0, 20, 0, 5, 0, 21, 0, 6, 0, 22, 0, 7, 0, 23, 0,
      8, 0, 24, 0, 9, 0, 25, 0, 10, 0, 26, 0, 11, 0, 27, 0, 12, 0, 28, 0, 13, 0, 29, 0, 14, 0, 30, 0, 15, 0, 31, 0};
  return _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, _mm512_load_si512(index), _mm512_castsi256_si512(codes));
#else
  const __m128i a = _mm256_castsi256_si128(codes), b = _mm256_extracti128_si256(codes, 1);
  return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
#endif
}

// codes (< 64, bytes as interleave_words takes them) as the bf16 pairs of their values
inline __m512i pairs_of_codes(__m256i codes, const CodeTable& table) {
  return _mm512_permutex2var_epi16(table.lo, interleave_words(codes), table.hi);
}

// signed bytes (Q8_0's codes, laid out as interleave_words takes them) as bf16 pairs
inline __m512i pairs_of_int8(__m256i codes) {
  const __m128i a = _mm256_castsi256_si128(codes), b = _mm256_extracti128_si256(codes, 1);
  const __m512 rows_0_7 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(a, b)));
  const __m512 rows_8_15 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(a, b)));
  return (__m512i)_mm512_cvtne2ps_pbh(rows_8_15, rows_0_7);  // exact: |q| <= 128
}

// bytes j and j + 1 of the tile's 16 blocks (32 contiguous bytes of the interleaved layout)
inline __m256i lane_pair(const uint8_t* blk, int j) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + j * kTile)); }

// Decodes one block of a 16-row tile into sink: each sub-block's pairs in increasing value order
// (sink.pair), then its scale (sink.scale) and, for the types with one, its min (sink.min: the
// value added per unit of x)
template <int T, typename Sink>
inline void decode_block(const uint8_t* blk, Sink& sink) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (T == kQ8_0) {
    for (int l = 0; l < 32; l += 2) sink.pair(pairs_of_int8(lane_pair(blk, 2 + l)));
    sink.scale(lanes_half(blk, 0).v);
  } else if constexpr (T == kQ4_0 || T == kQ4_1) {
    static const CodeTable table(T == kQ4_0 ? 8 : 0);
    constexpr int qs_at = T == kQ4_1 ? 4 : 2;
    for (int l = 0; l < 16; l += 2) sink.pair(pairs_of_codes(_mm256_and_si256(lane_pair(blk, qs_at + l), low4), table));
    for (int l = 0; l < 16; l += 2) sink.pair(pairs_of_codes(_mm256_and_si256(_mm256_srli_epi16(lane_pair(blk, qs_at + l), 4), low4), table));
    sink.scale(lanes_half(blk, 0).v);
    if constexpr (T == kQ4_1) sink.min(lanes_half(blk, 2).v);
  } else if constexpr (T == kQ5_0 || T == kQ5_1) {
    static const CodeTable table(T == kQ5_0 ? 16 : 0);
    constexpr int qh_at = T == kQ5_1 ? 4 : 2, qs_at = T == kQ5_1 ? 8 : 6;
    for (int upper = 0; upper < 2; ++upper)  // values 0-15 (low nibbles, bits 0-15 of qh), then 16-31
      for (int l = 0; l < 16; l += 2) {
        const __m256i q = lane_pair(blk, qs_at + l);
        const __m256i nibbles = _mm256_and_si256(upper ? _mm256_srli_epi16(q, 4) : q, low4);
        const __m256i qh = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (qh_at + 2 * upper + l / 8) * kTile)));
        const __m256i bit = _mm256_set_m128i(_mm_set1_epi8(static_cast<char>(1 << (l % 8 + 1))), _mm_set1_epi8(static_cast<char>(1 << (l % 8))));
        sink.pair(pairs_of_codes(_mm256_mask_add_epi8(nibbles, _mm256_test_epi8_mask(qh, bit), nibbles, _mm256_set1_epi8(0x10)), table));
      }
    sink.scale(lanes_half(blk, 0).v);
    if constexpr (T == kQ5_1) sink.min(lanes_half(blk, 2).v);
  } else if constexpr (T == kQ4_K || T == kQ5_K) {
    static const CodeTable table(0);
    const V16 d = lanes_half(blk, 0), dmin = lanes_half(blk, 2);
    constexpr int qs_at = T == kQ5_K ? 48 : 16;
    for (int s = 0; s < 8; ++s) {
      u8x16 sc, mn;
      k4_scale_min(blk, s, sc, mn);
      for (int l = 0; l < 32; l += 2) {
        const __m256i q = lane_pair(blk, qs_at + (s / 2) * 32 + l);
        __m256i codes = _mm256_and_si256((s & 1) ? _mm256_srli_epi16(q, 4) : q, low4);
        if constexpr (T == kQ5_K)
          codes = _mm256_mask_add_epi8(codes, _mm256_test_epi8_mask(lane_pair(blk, 16 + l), _mm256_set1_epi8(static_cast<char>(1 << s))), codes,
                                       _mm256_set1_epi8(0x10));
        sink.pair(pairs_of_codes(codes, table));
      }
      sink.scale((d * to_float(sc)).v);
      sink.min(_mm512_sub_ps(_mm512_setzero_ps(), (dmin * to_float(mn)).v));  // the value is ds * q - dmin * mn
    }
  } else {  // Q6_K: sub-blocks of 16 values
    static const CodeTable table(32);
    const V16 d = lanes_half(blk, 208);
    for (int half = 0; half < 2; ++half)
      for (int j = 0; j < 4; ++j) {  // 32 values: low nibbles from ql (shift (j / 2) * 4), high bits from qh (shift j * 2)
        const int p0 = half * 128 + j * 32;
        for (int l = 0; l < 32; l += 2) {
          const __m256i low = _mm256_and_si256(_mm256_srli_epi16(lane_pair(blk, half * 64 + (j % 2) * 32 + l), (j / 2) * 4), low4);
          const __m256i high = _mm256_and_si256(_mm256_srli_epi16(lane_pair(blk, 128 + half * 32 + l), j * 2), _mm256_set1_epi8(3));
          sink.pair(pairs_of_codes(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), table));
          if (l == 14 || l == 30) sink.scale((d * to_float(reinterpret_cast<i8x16>(lanes(blk, 192 + (p0 + l) / 16)))).v);
        }
      }
  }
}

// the decoded tile layout (TileShape) as a sink
struct TileWriter {
  __m512i* pairs;
  __m512* scales;
  __m512* mins;
  void pair(__m512i w) { _mm512_store_si512(pairs++, w); }
  void scale(__m512 s) { _mm512_store_ps(scales++, s); }
  void min(__m512 m) { _mm512_store_ps(mins++, m); }
};

// one tile's blocks into its decoded form (TileShape's layout) at out
template <int T>
void decode_tile(const uint8_t* tile, int k, uint8_t* out) {
  constexpr BlockShape shape = block_shape(T);
  const TileShape ts = tile_shape(T, k);
  __m512* scales = reinterpret_cast<__m512*>(out + static_cast<int64_t>(ts.pairs) * 64);
  TileWriter writer{reinterpret_cast<__m512i*>(out), scales, scales + ts.subs};
  for (int b = 0; b < k / shape.values; ++b) decode_block<T>(tile + static_cast<int64_t>(b) * shape.bytes * kTile, writer);
}

using TileDecoder = void (*)(const uint8_t*, int, uint8_t*);

inline TileDecoder tile_decoder(int type) {
  return for_type(type, TileDecoder{}, [](auto t) -> TileDecoder { return decode_tile<decltype(t)::value>; });
}

// MR rows (x: bf16, row stride ldx; sums: their per-sub-block sums, row stride subs) against NT
// decoded tiles (tile_bytes apart). A sub-block's dot products stay in registers; the running
// sums (acc) live in L1 between sub-blocks, which leaves the registers to an 8 x 3 block.
template <int SUBP, bool MINS, int MR, int NT>
inline void micro_kernel(const uint8_t* tiles, int64_t tile_bytes, int pairs, int subs, const uint16_t* x, int64_t ldx, const float* sums,
                         float* acc) {
  for (int i = 0; i < MR * NT; ++i) _mm512_store_ps(acc + i * kTile, _mm512_setzero_ps());
  for (int s = 0; s < subs; ++s) {
    __m512 sub[MR][NT];
    for (int m = 0; m < MR; ++m)
      for (int t = 0; t < NT; ++t) sub[m][t] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int p = s * SUBP; p < (s + 1) * SUBP; ++p) {
      __m512bh w[NT];
      for (int t = 0; t < NT; ++t) w[t] = (__m512bh)_mm512_load_si512(tiles + t * tile_bytes + static_cast<int64_t>(p) * 64);
      for (int m = 0; m < MR; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * ldx + 2 * p, sizeof(pair));
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        for (int t = 0; t < NT; ++t) sub[m][t] = _mm512_dpbf16_ps(sub[m][t], a, w[t]);
      }
    }
    for (int t = 0; t < NT; ++t) {
      const float* scales = reinterpret_cast<const float*>(tiles + t * tile_bytes + static_cast<int64_t>(pairs) * 64);
      for (int m = 0; m < MR; ++m) {
        float* a = acc + (m * NT + t) * kTile;
        __m512 v = _mm512_fmadd_ps(_mm512_load_ps(scales + s * kTile), sub[m][t], _mm512_load_ps(a));
        if constexpr (MINS) v = _mm512_fmadd_ps(_mm512_load_ps(scales + (subs + s) * kTile), _mm512_set1_ps(sums[m * subs + s]), v);
        _mm512_store_ps(a, v);
      }
    }
  }
}

constexpr int kRows = 8;  // rows per register block (x 3 tiles: 24 accumulators)
constexpr int kTilesPerBlock = 3;

template <int SUBP, bool MINS, int MR, int NT>
void block(const Problem& p, const uint8_t* tiles, int64_t tile_bytes, const TileShape& ts, int64_t first, const uint16_t* x, int64_t ldx,
           const float* sums, int row, void* out, RowBest* best) {
  alignas(64) float acc[MR * NT * kTile];
  micro_kernel<SUBP, MINS, MR, NT>(tiles, tile_bytes, ts.pairs, ts.subs, x + row * ldx, ldx, MINS ? sums + static_cast<int64_t>(row) * ts.subs : nullptr,
                                   acc);
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MR; ++m) {
      f32x16 v;
      std::memcpy(&v, acc + (m * NT + t) * kTile, sizeof(v));
      emit(p, first + t, row + m, v, out, best);
    }
}

// the last rows - row (< MR) rows: the largest block that fits, then smaller ones
template <int SUBP, bool MINS, int MR, int NT>
void remainder(const Problem& p, const uint8_t* tiles, int64_t tile_bytes, const TileShape& ts, int64_t first, const uint16_t* x, int64_t ldx,
               const float* sums, int row, int rows, void* out, RowBest* best) {
  if constexpr (MR > 0) {
    if (rows - row >= MR) {
      block<SUBP, MINS, MR, NT>(p, tiles, tile_bytes, ts, first, x, ldx, sums, row, out, best);
      row += MR;
    }
    remainder<SUBP, MINS, MR - 1, NT>(p, tiles, tile_bytes, ts, first, x, ldx, sums, row, rows, out, best);
  }
}

template <int SUBP, bool MINS, int NT>
void rows_block(const Problem& p, const uint8_t* tiles, int64_t tile_bytes, const TileShape& ts, int64_t first, const uint16_t* x, int64_t ldx,
                const float* sums, int rows, void* out, RowBest* best) {
  int row = 0;
  for (; row + kRows <= rows; row += kRows) block<SUBP, MINS, kRows, NT>(p, tiles, tile_bytes, ts, first, x, ldx, sums, row, out, best);
  remainder<SUBP, MINS, kRows - 1, NT>(p, tiles, tile_bytes, ts, first, x, ldx, sums, row, rows, out, best);
}

template <int SUBP, bool MINS>
void tiles_block(const Problem& p, const uint8_t* tiles, int64_t tile_bytes, const TileShape& ts, int64_t first, int64_t count, const uint16_t* x,
                 int64_t ldx, const float* sums, int rows, void* out, RowBest* best) {
  if (count == 3) rows_block<SUBP, MINS, 3>(p, tiles, tile_bytes, ts, first, x, ldx, sums, rows, out, best);
  else if (count == 2) rows_block<SUBP, MINS, 2>(p, tiles, tile_bytes, ts, first, x, ldx, sums, rows, out, best);
  else rows_block<SUBP, MINS, 1>(p, tiles, tile_bytes, ts, first, x, ldx, sums, rows, out, best);
}

using TilesBlock = void (*)(const Problem&, const uint8_t*, int64_t, const TileShape&, int64_t, int64_t, const uint16_t*, int64_t, const float*, int,
                            void*, RowBest*);

inline TilesBlock tiles_block_for(int type) {
  if (type == kQ6_K) return tiles_block<8, false>;
  return has_min(type) ? tiles_block<16, true> : tiles_block<16, false>;
}

// bf16 rows: x [rows][ldx], and their sums (sub_block_sums) for the types with a min, else null
struct BfRows {
  const uint16_t* x;
  int64_t ldx;
  const float* sums;
};

// Few rows (a decode step): each tile's pairs go straight into the rows' chains as they are
// decoded, the same operations in the same order as micro_kernel on a decoded tile.
template <int MR>
struct FusedRows {
  __m512 sub[MR], acc[MR];
  const uint16_t* x;
  int64_t ldx;
  const float* sums;  // [MR][subs], or null
  int subs;
  int p = 0, s = 0;
  FusedRows(const uint16_t* x_, int64_t ldx_, const float* sums_, int subs_) : x(x_), ldx(ldx_), sums(sums_), subs(subs_) {
    for (int m = 0; m < MR; ++m) sub[m] = acc[m] = _mm512_setzero_ps();
  }
  void pair(__m512i w) {
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * p, sizeof(pair));
      sub[m] = _mm512_dpbf16_ps(sub[m], (__m512bh)_mm512_set1_epi32(pair), (__m512bh)w);
    }
    ++p;
  }
  void scale(__m512 sc) {
    for (int m = 0; m < MR; ++m) {
      acc[m] = _mm512_fmadd_ps(sc, sub[m], acc[m]);
      sub[m] = _mm512_setzero_ps();
    }
    ++s;
  }
  void min(__m512 mn) {
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sums[m * subs + s - 1]), acc[m]);
  }
};

template <int T, int MR>
void fused_tile(const Weight& w, int64_t t, const Problem& p, const BfRows& x, RowBest* best) {
  constexpr BlockShape shape = block_shape(T);
  FusedRows<MR> rows(x.x, x.ldx, x.sums, w.k / sub_values(T));
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
using FusedTile = void (*)(const Weight&, int64_t, const Problem&, const BfRows&, RowBest*);


inline FusedTile fused_tile_for(int type, int rows) {
  return for_type(type, FusedTile{}, [rows](auto t) {
    return for_rows<1, kFusedRows>(rows, FusedTile{}, [](auto r) -> FusedTile { return fused_tile<decltype(t)::value, decltype(r)::value>; });
  });
}

// the rows' sums over each run of 32 values (sums[r * k / 32 + s]): every type with a min has
// sub-blocks of 32 values. One fixed order per run: value 2i plus value 2i + 1, then the 16 pairs'
// sums reduced as _mm512_reduce_add_ps does.
inline std::vector<float> sub_block_sums(const uint16_t* x, int64_t ldx, int rows, int k) {
  constexpr int sub = 32;
  const int subs = k / sub;
  std::vector<float> sums(static_cast<size_t>(rows) * subs);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
#pragma omp parallel for schedule(static) if (rows >= 64)
  for (int r = 0; r < rows; ++r)
    for (int s = 0; s < subs; ++s) {
      const __m512i v = _mm512_loadu_si512(x + r * ldx + s * sub);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), odd = _mm512_castsi512_ps(_mm512_and_si512(v, high));
      sums[static_cast<size_t>(r) * subs + s] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
    }
  return sums;
}

// one weight of a few-row product: its tiles, the fused kernel for its type, where it writes
struct FusedPart {
  Weight w;
  Problem p;
  FusedTile fused;
  int64_t tiles;
};

// Few rows against several weights that share them (a fused projection's parts, or one weight):
// every part's tiles in one parallel loop, split evenly between the threads. argmax: one part only.
void run_fused(const FusedPart* parts, int count, const BfRows& x, int rows, int64_t* argmax) {
  int64_t total = 0;
  for (int i = 0; i < count; ++i) total += parts[i].tiles;
  std::vector<float> merged_value(rows, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> merged_index(rows, -1);
#pragma omp parallel
  {
    std::vector<RowBest> best;
    if (argmax) best.assign(rows, RowBest{f32x16{} - std::numeric_limits<float>::infinity(), i32x16{} - 1});
    const int threads = omp_get_num_threads(), me = omp_get_thread_num();
    int i = 0;
    int64_t before = 0;  // tiles of parts[0..i)
    for (int64_t g = total * me / threads; g < total * (me + 1) / threads; ++g) {
      while (g - before >= parts[i].tiles) before += parts[i++].tiles;
      const FusedPart& part = parts[i];
      part.fused(part.w, g - before, part.p, x, argmax ? best.data() : nullptr);
    }
    if (argmax) merge_best(best, merged_value, merged_index);
  }
  if (argmax)
    for (int r = 0; r < rows; ++r) argmax[r] = merged_index[r] < 0 ? 0 : merged_index[r];
}

// x (bf16 [rows, k], row stride ldx) @ w^T into p.out / argmax
void run(const Weight& w, int type, const Problem& p, const uint16_t* x, int64_t ldx, int rows, int64_t* argmax) {
  const TileShape ts = tile_shape(type, w.k);
  const std::vector<float> sums = ts.mins ? sub_block_sums(x, ldx, rows, w.k) : std::vector<float>{};
  const int64_t tiles = (w.n + kTile - 1) / kTile;
  if (rows <= kFusedRows) {
    const FusedPart part{w, p, fused_tile_for(type, rows), tiles};
    run_fused(&part, 1, {x, ldx, ts.mins ? sums.data() : nullptr}, rows, argmax);
    return;
  }
  const TileDecoder decode = tile_decoder(type);
  const TilesBlock tiles_for = tiles_block_for(type);
  std::vector<float> merged_value(rows, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> merged_index(rows, -1);
  const int64_t blocks = (tiles + kTilesPerBlock - 1) / kTilesPerBlock;
  const int64_t tile_bytes = (ts.bytes() + 63) / 64 * 64;
#pragma omp parallel
  {
    std::vector<RowBest> best;
    if (argmax) best.assign(rows, RowBest{f32x16{} - std::numeric_limits<float>::infinity(), i32x16{} - 1});
    uint8_t* decoded = static_cast<uint8_t*>(std::aligned_alloc(64, tile_bytes * kTilesPerBlock));
    const int threads = omp_get_num_threads();
    const int me = omp_get_thread_num();
    const int64_t block_begin = blocks * me / threads;
    const int64_t block_end = blocks * (me + 1) / threads;
    // rows per pass over the thread's tiles, each tile decoded once per pass: their x (1 MB, and at
    // least 256 rows, so that the decoding is spread over as many) stays in L2 or L3
    const int chunk_rows = std::max(256, static_cast<int>((1 << 20) / (static_cast<int64_t>(w.k) * 2)) / kRows * kRows);
    const int64_t out_bytes = p.out_dtype == kFloat32 ? 4 : 2;
    for (int r0 = 0; r0 < rows; r0 += chunk_rows) {
      const int chunk = std::min(chunk_rows, rows - r0);
      const uint16_t* xc = x + r0 * ldx;
      const float* sc = ts.mins ? sums.data() + static_cast<int64_t>(r0) * ts.subs : nullptr;
      void* oc = p.out ? static_cast<void*>(static_cast<char*>(p.out) + static_cast<int64_t>(r0) * p.ldo * out_bytes) : nullptr;
      RowBest* bc = argmax ? best.data() + r0 : nullptr;
      for (int64_t b = block_begin; b < block_end; ++b) {
        const int64_t first = b * kTilesPerBlock;
        const int64_t count = std::min<int64_t>(kTilesPerBlock, tiles - first);
        for (int64_t t = 0; t < count; ++t) decode(w.tiles + (first + t) * w.tile_bytes, w.k, decoded + t * tile_bytes);
        tiles_for(p, decoded, tile_bytes, ts, first, count, xc, ldx, sc, chunk, oc, bc);
      }
    }
    std::free(decoded);
    if (argmax) merge_best(best, merged_value, merged_index);
  }
  if (argmax)
    for (int r = 0; r < rows; ++r) argmax[r] = merged_index[r] < 0 ? 0 : merged_index[r];
}

}  // namespace dot

#endif  // KVSERVE_HAS_GGUF_DOT
