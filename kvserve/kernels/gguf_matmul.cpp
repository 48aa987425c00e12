// x @ weight^T on a weight kept in its GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
// Q6_K), dequantized inside the kernel one 16-row tile at a time into the float32 tile layout of
// float_tiles.h, then multiplied there: the weight is held once, in the file's own bytes.
//
// Layout: the file's bytes, interleaved by tiles of 16 rows: [n/16][blocks per row][block
// bytes][16], byte j of row 16t + i's block b at ((t * blocks + b) * block_bytes + j) * 16 + i
// (rows past n zero). Byte j of a tile's 16 blocks is then one 16-byte vector, so a block's
// scalar decoding runs on 16 rows at once, one row per lane, and yields the tile's [k][16]
// layout directly (no transpose). Same size as the file's tensor.
//
// Each dequantized value is exactly gguf-py's (and llama.cpp's reference dequantization): the
// same float32 operations in the same order, one rounding each (this file is compiled without
// multiply-add contraction; `d * q + m` is a multiply, then an add). Every output is one float32
// FMA chain in k order (float_tiles.h), so a row's result does not depend on its batch, and the
// dequantized tile is the same whichever rows it meets.
//
// A tile is dequantized once per chunk of rows that fits L2 (float_matmul's walk), so one row
// (decode) costs a dequantization and an FMA per weight, and a batch amortizes the first.
//
// bf16 rows on a CPU with AVX512-BF16 take gguf_dot.h instead: bf16 dot products on the blocks'
// integer codes, each block's scale (and min) applied in float32.

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "amx_core.h"
#include "args.h"
#include "float_tiles.h"

extern "C" int kvserve_amx_available();  // amx_matmul.cpp

namespace {

// ggml's type codes (GGMLQuantizationType) and their block shapes
enum GgufType : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct BlockShape {
  int values;
  int bytes;
};

constexpr BlockShape block_shape(int type) {
  switch (type) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: return {0, 0};
  }
}

// fn(std::integral_constant<int, T>{}) for the type code `type` (a kernel instantiated per type),
// or fallback for a type this file does not read
template <typename R, typename Fn>
R for_type(int type, R fallback, Fn&& fn) {
  switch (type) {
    case kQ4_0: return fn(std::integral_constant<int, kQ4_0>{});
    case kQ4_1: return fn(std::integral_constant<int, kQ4_1>{});
    case kQ5_0: return fn(std::integral_constant<int, kQ5_0>{});
    case kQ5_1: return fn(std::integral_constant<int, kQ5_1>{});
    case kQ8_0: return fn(std::integral_constant<int, kQ8_0>{});
    case kQ4_K: return fn(std::integral_constant<int, kQ4_K>{});
    case kQ5_K: return fn(std::integral_constant<int, kQ5_K>{});
    case kQ6_K: return fn(std::integral_constant<int, kQ6_K>{});
    default: return fallback;
  }
}

// fn(std::integral_constant<int, rows>{}) for rows in [R, Max], else fallback
template <int R, int Max, typename Ret, typename Fn>
Ret for_rows(int rows, Ret fallback, Fn&& fn) {
  if constexpr (R > Max) {
    return fallback;
  } else {
    return rows == R ? fn(std::integral_constant<int, R>{}) : for_rows<R + 1, Max>(rows, fallback, fn);
  }
}

inline float half_at(const uint8_t* p) {
  _Float16 h;
  std::memcpy(&h, p, sizeof(h));
  return static_cast<float>(h);
}

inline uint32_t le32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

// Q4_K / Q5_K: eight 6-bit scales and mins packed in 12 bytes
inline void scale_min_k4(const uint8_t* s, uint8_t (&sc)[8], uint8_t (&mn)[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
  }
}

// one row of `k` values from its blocks
template <int T>
void dequantize_row(const uint8_t* row, int k, float* out) {
  constexpr BlockShape shape = block_shape(T);
  const int blocks = k / shape.values;
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + static_cast<int64_t>(b) * shape.bytes;
    float* y = out + static_cast<int64_t>(b) * shape.values;
    if constexpr (T == kQ8_0) {
      const float d = half_at(blk);
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
      for (int l = 0; l < 32; ++l) y[l] = static_cast<float>(q[l]) * d;
    } else if constexpr (T == kQ4_0) {
      const float d = half_at(blk);
      const uint8_t* q = blk + 2;
      for (int l = 0; l < 16; ++l) {
        y[l] = d * static_cast<float>((q[l] & 0x0F) - 8);
        y[l + 16] = d * static_cast<float>((q[l] >> 4) - 8);
      }
    } else if constexpr (T == kQ4_1) {
      const float d = half_at(blk), m = half_at(blk + 2);
      const uint8_t* q = blk + 4;
      for (int l = 0; l < 16; ++l) {
        y[l] = d * static_cast<float>(q[l] & 0x0F) + m;
        y[l + 16] = d * static_cast<float>(q[l] >> 4) + m;
      }
    } else if constexpr (T == kQ5_0 || T == kQ5_1) {
      constexpr bool has_min = T == kQ5_1;
      const float d = half_at(blk), m = has_min ? half_at(blk + 2) : 0.0f;
      const uint32_t qh = le32(blk + (has_min ? 4 : 2));
      const uint8_t* q = blk + (has_min ? 8 : 6);
      for (int l = 0; l < 16; ++l) {
        const int lo = (q[l] & 0x0F) | static_cast<int>(((qh >> l) & 1u) << 4);
        const int hi = (q[l] >> 4) | static_cast<int>(((qh >> (l + 16)) & 1u) << 4);
        if constexpr (has_min) {
          y[l] = d * static_cast<float>(lo) + m;
          y[l + 16] = d * static_cast<float>(hi) + m;
        } else {
          y[l] = d * static_cast<float>(lo - 16);
          y[l + 16] = d * static_cast<float>(hi - 16);
        }
      }
    } else if constexpr (T == kQ4_K || T == kQ5_K) {
      const float d = half_at(blk), dmin = half_at(blk + 2);
      uint8_t sc[8], mn[8];
      scale_min_k4(blk + 4, sc, mn);
      const uint8_t* qh = blk + 16;                       // Q5_K: the fifth bits
      const uint8_t* qs = blk + (T == kQ5_K ? 48 : 16);   // nibbles: byte j*32+l holds sub-blocks 2j and 2j+1
      for (int s = 0; s < 8; ++s) {
        const float ds = d * static_cast<float>(sc[s]);
        const float ms = dmin * static_cast<float>(mn[s]);
        const uint8_t* nib = qs + (s / 2) * 32;
        const int shift = (s & 1) * 4;
        for (int l = 0; l < 32; ++l) {
          int q = (nib[l] >> shift) & 0x0F;
          if constexpr (T == kQ5_K) q |= ((qh[l] >> s) & 1) << 4;
          y[s * 32 + l] = ds * static_cast<float>(q) - ms;
        }
      }
    } else {  // Q6_K: ql[128], qh[64], int8 scales[16], fp16 d
      const uint8_t* ql = blk;
      const uint8_t* qh = blk + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = half_at(blk + 208);
      for (int half = 0; half < 2; ++half) {
        for (int r = 0; r < 128; ++r) {
          const int p = half * 128 + r;
          const int low = (ql[half * 64 + (r & 63)] >> ((r >> 6) * 4)) & 0x0F;
          const int high = (qh[half * 32 + (r & 31)] >> ((r >> 5) * 2)) & 0x03;
          const float ds = d * static_cast<float>(scales[p / 16]);
          y[p] = ds * static_cast<float>((low | (high << 4)) - 32);
        }
      }
    }
  }
}

using RowDequantizer = void (*)(const uint8_t*, int, float*);

RowDequantizer row_dequantizer(int type) {
  return for_type(type, RowDequantizer{}, [](auto t) -> RowDequantizer { return dequantize_row<decltype(t)::value>; });
}

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

// byte j of the tile's 16 blocks, one per lane
inline u8x16 lanes(const uint8_t* blk, int j) {
  u8x16 v;
  std::memcpy(&v, blk + j * kTile, sizeof(v));
  return v;
}

// 16 float lanes. gcc keeps a generic 64-byte vector in memory on an AVX2 machine, so there each
// operation is spelled on two ymm halves.
#if defined(__AVX512F__)
struct V16 {
  __m512 v;
};
inline V16 operator*(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 operator+(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 operator-(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 to_float(u8x16 q) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)q))}; }
inline V16 to_float(i8x16 q) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32((__m128i)q))}; }
inline V16 halves_to_float(__m256i bits) { return {_mm512_cvtph_ps(bits)}; }
inline void put(float* out, int row, V16 x) { _mm512_storeu_ps(out + static_cast<int64_t>(row) * kTile, x.v); }
#elif defined(__AVX2__) && defined(__F16C__)
struct V16 {
  __m256 lo, hi;
};
inline V16 operator*(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 operator+(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 operator-(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 to_float(u8x16 q) {
  const __m128i x = (__m128i)q;
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(x, 8)))};
}
inline V16 to_float(i8x16 q) {
  const __m128i x = (__m128i)q;
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(x, 8)))};
}
inline V16 halves_to_float(__m256i bits) {
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(bits)), _mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1))};
}
inline void put(float* out, int row, V16 x) {
  float* at = out + static_cast<int64_t>(row) * kTile;
  _mm256_storeu_ps(at, x.lo);
  _mm256_storeu_ps(at + 8, x.hi);
}
#else
struct V16 {
  f32x16 v;
};
inline V16 operator*(V16 a, V16 b) { return {a.v * b.v}; }
inline V16 operator+(V16 a, V16 b) { return {a.v + b.v}; }
inline V16 operator-(V16 a, V16 b) { return {a.v - b.v}; }
inline V16 to_float(u8x16 q) { return {__builtin_convertvector(q, f32x16)}; }
inline V16 to_float(i8x16 q) { return {__builtin_convertvector(q, f32x16)}; }
inline void put(float* out, int row, V16 x) { std::memcpy(out + static_cast<int64_t>(row) * kTile, &x.v, sizeof(x.v)); }
#endif

// Q4_K / Q5_K: sub-block s's 6-bit scale and min of each lane's block (scale_min_k4, 16 rows at once)
inline void k4_scale_min(const uint8_t* blk, int s, u8x16& sc, u8x16& mn) {
  if (s < 4) {
    sc = lanes(blk, 4 + s) & 63;
    mn = lanes(blk, 8 + s) & 63;
  } else {
    sc = (lanes(blk, 12 + s - 4) & 0x0F) | ((lanes(blk, 4 + s - 4) >> 2) & 0x30);
    mn = (lanes(blk, 12 + s - 4) >> 4) | ((lanes(blk, 8 + s - 4) >> 2) & 0x30);
  }
}

// the fp16 at bytes j, j+1 of each lane's block, as float
inline V16 lanes_half(const uint8_t* blk, int j) {
  const u16x16 bits = __builtin_convertvector(lanes(blk, j), u16x16) | (__builtin_convertvector(lanes(blk, j + 1), u16x16) << 8);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
  return halves_to_float((__m256i)bits);
#else
  f16x16 h;
  std::memcpy(&h, &bits, sizeof(h));
  return {__builtin_convertvector(h, f32x16)};
#endif
}

// one block of a 16-row tile (interleaved): lane i is row i's block, decoded with
// dequantize_row's arithmetic; each of the block's values (a 16-lane vector) goes to sink(l, w)
// in increasing l, so a sink may fold them straight into FMA chains
template <int T, typename Sink>
inline void dequantize_tile_block(const uint8_t* blk, Sink&& sink) {
  if constexpr (T == kQ8_0) {
    const V16 d = lanes_half(blk, 0);
    for (int l = 0; l < 32; ++l) sink(l, to_float(reinterpret_cast<i8x16>(lanes(blk, 2 + l))) * d);
  } else if constexpr (T == kQ4_0) {
    const V16 d = lanes_half(blk, 0);
    for (int l = 0; l < 16; ++l) sink(l, d * to_float(reinterpret_cast<i8x16>(lanes(blk, 2 + l) & 0x0F) - 8));
    for (int l = 0; l < 16; ++l) sink(l + 16, d * to_float(reinterpret_cast<i8x16>(lanes(blk, 2 + l) >> 4) - 8));
  } else if constexpr (T == kQ4_1) {
    const V16 d = lanes_half(blk, 0), m = lanes_half(blk, 2);
    for (int l = 0; l < 16; ++l) sink(l, d * to_float(lanes(blk, 4 + l) & 0x0F) + m);
    for (int l = 0; l < 16; ++l) sink(l + 16, d * to_float(lanes(blk, 4 + l) >> 4) + m);
  } else if constexpr (T == kQ5_0 || T == kQ5_1) {
    constexpr bool has_min = T == kQ5_1;
    const V16 d = lanes_half(blk, 0);
    const V16 m = has_min ? lanes_half(blk, 2) : V16{};
    constexpr int qh_at = has_min ? 4 : 2, qs_at = has_min ? 8 : 6;
#pragma GCC unroll 2
    for (int upper = 0; upper < 2; ++upper) {  // values 0-15 (low nibbles, bits 0-15 of qh), then 16-31
#pragma GCC unroll 16
      for (int l = 0; l < 16; ++l) {
        const u8x16 q = lanes(blk, qs_at + l);
        const u8x16 bit = static_cast<u8x16>(static_cast<uint8_t>(1u << (l % 8)) + u8x16{});
        const u8x16 fifth = reinterpret_cast<u8x16>((lanes(blk, qh_at + 2 * upper + l / 8) & bit) != 0) & 0x10;
        const u8x16 value = (upper ? q >> 4 : q & 0x0F) | fifth;
        if constexpr (has_min) sink(l + 16 * upper, d * to_float(value) + m);
        else sink(l + 16 * upper, d * to_float(reinterpret_cast<i8x16>(value) - 16));
      }
    }
  } else if constexpr (T == kQ4_K || T == kQ5_K) {
    const V16 d = lanes_half(blk, 0), dmin = lanes_half(blk, 2);
    const int qs_at = T == kQ5_K ? 48 : 16;
    for (int s = 0; s < 8; ++s) {
      u8x16 sc, mn;
      k4_scale_min(blk, s, sc, mn);
      const V16 ds = d * to_float(sc), ms = dmin * to_float(mn);
      const int shift = (s & 1) * 4;
      for (int l = 0; l < 32; ++l) {
        u8x16 q = (lanes(blk, qs_at + (s / 2) * 32 + l) >> shift) & 0x0F;
        if constexpr (T == kQ5_K) q |= ((lanes(blk, 16 + l) >> s) & 1) << 4;
        sink(s * 32 + l, ds * to_float(q) - ms);
      }
    }
  } else {  // Q6_K
    const V16 d = lanes_half(blk, 208);
    for (int half = 0; half < 2; ++half) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {  // 32 values: low nibbles from ql (shift (j / 2) * 4), high bits from qh (shift j * 2)
        const int p0 = half * 128 + j * 32;
        const V16 ds_a = d * to_float(reinterpret_cast<i8x16>(lanes(blk, 192 + p0 / 16)));
        const V16 ds_b = d * to_float(reinterpret_cast<i8x16>(lanes(blk, 192 + p0 / 16 + 1)));
#pragma GCC unroll 32
        for (int l = 0; l < 32; ++l) {
          const u8x16 low = (lanes(blk, half * 64 + (j % 2) * 32 + l) >> ((j / 2) * 4)) & 0x0F;
          const u8x16 high = (lanes(blk, 128 + half * 32 + l) >> (j * 2)) & 0x03;
          sink(p0 + l, (l < 16 ? ds_a : ds_b) * to_float(reinterpret_cast<i8x16>(low | (high << 4)) - 32));
        }
      }
    }
  }
}

template <int T>
void dequantize_tile(const uint8_t* tile, int k, float* out) {
  constexpr BlockShape shape = block_shape(T);
  for (int b = 0; b < k / shape.values; ++b)
  {
    float* block_out = out + static_cast<int64_t>(b) * shape.values * kTile;
    dequantize_tile_block<T>(tile + static_cast<int64_t>(b) * shape.bytes * kTile, [block_out](int l, V16 w) { put(block_out, l, w); });
  }
}

using TileDequantizer = void (*)(const uint8_t*, int, float*);

TileDequantizer tile_dequantizer(int type) {
  return for_type(type, TileDequantizer{}, [](auto t) -> TileDequantizer { return dequantize_tile<decltype(t)::value>; });
}

struct Weight {
  const uint8_t* tiles;
  int64_t tile_bytes;  // 16 rows' blocks
  int64_t n;
  int k;
  TileDequantizer dequantize;
};

// tiles [first, first + count) of the weight into `tile` ([count][k][16] float32)
void dequantize_tiles(const Weight& w, int64_t first, int64_t count, float* tile) {
  for (int64_t t = 0; t < count; ++t) w.dequantize(w.tiles + (first + t) * w.tile_bytes, w.k, tile + t * static_cast<int64_t>(w.k) * kTile);
}

inline V16 fma(V16 a, V16 b, V16 c) {
#if defined(__AVX512F__)
  return {_mm512_fmadd_ps(a.v, b.v, c.v)};
#elif defined(__AVX2__) && defined(__F16C__)
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
#else
  for (int i = 0; i < kTile; ++i) c.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]);
  return c;
#endif
}

inline V16 broadcast(float x) {
#if defined(__AVX512F__)
  return {_mm512_set1_ps(x)};
#elif defined(__AVX2__) && defined(__F16C__)
  return {_mm256_set1_ps(x), _mm256_set1_ps(x)};
#else
  return {f32x16{} + x};
#endif
}

inline V16 load_lanes(const float* p) {
#if defined(__AVX512F__)
  return {_mm512_loadu_ps(p)};
#elif defined(__AVX2__) && defined(__F16C__)
  return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
#else
  V16 v;
  std::memcpy(&v.v, p, sizeof(v.v));
  return v;
#endif
}

// A decode step streams each weight from memory once: while a few rows' tile is decoded, the
// tile kPrefetchTiles on is fetched a block at a time (the hardware prefetchers alone reached a
// third of the memory's bandwidth on a decode step's projections).
constexpr int64_t kPrefetchTiles = 2;

inline void prefetch_block(const uint8_t* block, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(block + line, 0, 3);
}

// MR (<= kMaxRows) rows against tile t, each value folded into the FMA chains as it is decoded:
// the same FMA chain per output as the dequantize-the-tile-then-multiply path, so the same bits
template <int T, int MR>
void fused_tile(const Weight& w, int64_t t, const Problem& p, const float* x, void* out, RowBest* best) {
  constexpr BlockShape shape = block_shape(T);
  constexpr int64_t block_bytes = static_cast<int64_t>(shape.bytes) * kTile;
  V16 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = broadcast(0.0f);
  const uint8_t* tile = w.tiles + t * w.tile_bytes;
  const uint8_t* ahead = (t + kPrefetchTiles) * kTile < w.n ? tile + kPrefetchTiles * w.tile_bytes : nullptr;
  for (int b = 0; b < w.k / shape.values; ++b) {
    const float* xb = x + b * shape.values;
    if (ahead) prefetch_block(ahead + b * block_bytes, block_bytes);
    dequantize_tile_block<T>(tile + b * block_bytes, [&acc, xb, &p](int l, V16 wv) {
      for (int m = 0; m < MR; ++m) acc[m] = fma(broadcast(xb[m * p.ldx + l]), wv, acc[m]);
    });
  }
  for (int m = 0; m < MR; ++m) {
    f32x16 lanes_out;
    std::memcpy(&lanes_out, &acc[m], sizeof(lanes_out));
    emit(p, t, m, lanes_out, out, best);
  }
}

using FusedTile = void (*)(const Weight&, int64_t, const Problem&, const float*, void*, RowBest*);


FusedTile fused_tile_for(int type, int rows) {
  return for_type(type, FusedTile{}, [rows](auto t) {
    return for_rows<1, 8>(rows, FusedTile{}, [](auto r) -> FusedTile { return fused_tile<decltype(t)::value, decltype(r)::value>; });
  });
}

// few rows (decode of a small batch): every tile once, fused
void run_fused(const Weight& w, const Problem& p, int rows, FusedTile fused, int64_t* argmax) {
  const int64_t tiles = (w.n + kTile - 1) / kTile;
  std::vector<float> merged_value(rows, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> merged_index(rows, -1);
#pragma omp parallel
  {
    std::vector<RowBest> best;
    if (argmax) best.assign(rows, RowBest{f32x16{} - std::numeric_limits<float>::infinity(), i32x16{} - 1});
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < tiles; ++t) fused(w, t, p, p.x, p.out, argmax ? best.data() : nullptr);
    if (argmax) merge_best(best, merged_value, merged_index);
  }
  if (argmax)
    for (int r = 0; r < rows; ++r) argmax[r] = merged_index[r] < 0 ? 0 : merged_index[r];
}

// more rows: each tile decoded once per chunk of rows into a scratch tile, then float_matmul's walk
void run(const Weight& w, const Problem& p, int rows, int64_t* argmax) {
  run_chunked<kFloat32>(p, rows, argmax, [&w] {
    return [&w, tile = std::vector<float>(static_cast<size_t>(kTiles) * w.k * kTile)](int64_t first, int64_t count) mutable {
      dequantize_tiles(w, first, count, tile.data());
      return std::pair<const void*, int64_t>{tile.data(), 0};
    };
  });
}

#include "gguf_dot.h"
#include "gguf_int8.h"
#include "gguf_screen.h"
#include "gguf_amx.h"

}  // namespace

extern "C" {

// Bytes of one row of k values in this GGUF type, or 0 when the type is not one this file reads
// or k is not a whole number of its blocks.
int64_t kvserve_gguf_row_bytes(int type, int64_t k) {
  const BlockShape shape = block_shape(type);
  if (shape.values == 0 || k <= 0 || k % shape.values) return 0;
  return k / shape.values * shape.bytes;
}

// Rows of a GGUF weight [n, k] in the interleaved tile layout, as float32: rows ids[0..count)
// (or 0..count when ids is null) into out [count, k].
int kvserve_gguf_dequantize(const uint8_t* tiles, int type, int64_t n, int k, const int64_t* ids, int64_t count, float* out) {
  const int64_t row_bytes = kvserve_gguf_row_bytes(type, k);
  if (row_bytes == 0 || n <= 0 || count < 0) return 1;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t r = ids ? ids[i] : i;
    if (r < 0 || r >= n) return 2;
  }
  const RowDequantizer dequantize = row_dequantizer(type);
#pragma omp parallel if (count * k >= (1 << 16))
  {
    std::vector<uint8_t> row(row_bytes);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < count; ++i) {
      const int64_t r = ids ? ids[i] : i;
      const uint8_t* from = tiles + (r / kTile) * row_bytes * kTile + r % kTile;
      for (int64_t j = 0; j < row_bytes; ++j) row[j] = from[j * kTile];
      dequantize(row.data(), k, out + i * k);
    }
  }
  return 0;
}

// The arguments make a product this file computes.
static bool valid(const kvserve::GgufMatmulArgs* a) {
  // activations 0 exact, 1 int8 rows, 2 bf16 tiles (bf16 rows, float32 or bf16 out)
  const bool x_ok = a->activations == 2 ? a->x_dtype == kBFloat16 && a->out_dtype <= kBFloat16
                                         : (a->x_dtype == kFloat32 || a->x_dtype == kBFloat16) && (a->activations == 0 || a->activations == 1);
  return kvserve_gguf_row_bytes(a->type, a->k) != 0 && a->n > 0 && a->rows > 0 && a->ldx >= a->k && x_ok && a->out_dtype >= 0 && a->out_dtype <= 2 &&
         (!a->out || a->ldo >= a->n);
}

// The weight the arguments name.
static Weight weight_of(const kvserve::GgufMatmulArgs& a) {
  return {a.blocks, kvserve_gguf_row_bytes(a.type, a.k) * kTile, a.n, a.k, tile_dequantizer(a.type)};
}

// x: float32 or bf16 [rows, k] (row stride ldx). out ([rows, ldo] in out_dtype, columns 0..n-1
// written) and argmax (int64 [rows]) may each be null. Returns 2 for bf16 tiles where AMX tiles
// cannot run, 4 for int8 rows this build lacks.
int kvserve_gguf_matmul(const kvserve::GgufMatmulArgs* a) {
  if (!valid(a)) return 1;
  const int k = a->k, rows = a->rows;
  const Weight w = weight_of(*a);
  if (a->activations == 2) {
#if KVSERVE_AMX_SUPPORTED
    if (!kvserve_amx_available()) return 2;
    tiles::run(w, a->type, static_cast<const uint16_t*>(a->x), a->ldx, rows, a->out, a->out_dtype, a->ldo, a->argmax);
    return 0;
#else
    return 2;
#endif
  }
  Problem p{nullptr, kFloat32, a->n, k, static_cast<const float*>(a->x), a->ldx, a->out, a->out_dtype, a->ldo};
  if (a->activations == 1) {
#if KVSERVE_HAS_GGUF_INT8
    std::vector<q8::Part> parts{{w, p, a->type, (a->n + kTile - 1) / kTile}};
    q8::run(parts, a->x, a->x_dtype == kBFloat16, a->ldx, rows, a->argmax);
    return 0;
#else
    return 4;
#endif
  }
#if KVSERVE_HAS_GGUF_DOT
  if (a->x_dtype == kBFloat16) {
    dot::run(w, a->type, p, static_cast<const uint16_t*>(a->x), a->ldx, rows, a->argmax);
    return 0;
  }
#endif
  std::vector<float> widened;
  if (a->x_dtype == kBFloat16) {
    widened.resize(static_cast<size_t>(rows) * k);
    const uint16_t* x = static_cast<const uint16_t*>(a->x);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; ++r)
      for (int kk = 0; kk < k; ++kk) widened[static_cast<size_t>(r) * k + kk] = Elem<kBFloat16>::load(x[r * a->ldx + kk]);
    p.x = widened.data();
    p.ldx = k;
  }
  const FusedTile fused = rows <= kMaxRows ? fused_tile_for(a->type, rows) : nullptr;
  if (fused) run_fused(w, p, rows, fused, a->argmax);
  else run(w, p, rows, a->argmax);
  return 0;
}

// 1 when this build has the int8-rows products (AVX512 VNNI, BW and VBMI: gguf_int8.h)
int kvserve_gguf_int8_available() { return KVSERVE_HAS_GGUF_INT8; }

// 1 when this build has the int8 screen of a Q8_0 weight (AVX512-BF16, VNNI and VBMI)
int kvserve_gguf_screen_available() { return KVSERVE_HAS_GGUF_SCREEN; }

// A Q8_0 weight's screen bounds (gguf_screen.h): block_bound [tiles][k/32], tile_l1 [tiles].
int kvserve_gguf_screen_bounds(const uint8_t* blocks, int64_t n, int k, float* block_bound, float* tile_l1) {
#if KVSERVE_HAS_GGUF_SCREEN
  if (n <= 0 || k <= 0 || k % 32) return 1;
  screen8::bounds(blocks, n, k, block_bound, tile_l1);
  return 0;
#else
  (void)blocks, (void)n, (void)k, (void)block_bound, (void)tile_l1;
  return 2;
#endif
}

// kvserve_gguf_matmul's argmax of bf16 rows on a Q8_0 weight (no output), bit for bit, through the
// int8 screen with its bounds; rescored (nullable): the tiles recomputed exactly. Returns 2 where
// the screen is not built and 3 for a row outside its range (non-finite, |x| > 2^64 or a nonzero
// |x| < 2^-100: the caller takes the full product).
int kvserve_gguf_screened_argmax(const kvserve::GgufMatmulArgs* a, const float* block_bound, const float* tile_l1, int64_t* rescored) {
#if KVSERVE_HAS_GGUF_SCREEN
  if (!valid(a) || a->type != kQ8_0 || a->x_dtype != kBFloat16 || !a->argmax || a->out) return 1;
  // The screen's bounds hold where nothing over- or underflows: every nonzero |x| in [2^-100, 2^64]
  // (then vdpbf16ps's flushing of subnormals never meets the full product's sums either). Rows
  // outside, non-finite ones included, are handed back to the full product.
  const uint16_t* x = static_cast<const uint16_t*>(a->x);
  for (int r = 0; r < a->rows; ++r)
    for (int j = 0; j < a->k; ++j) {
      const float v = std::fabs(Elem<kBFloat16>::load(x[r * a->ldx + j]));
      if (!(v <= 0x1p64f) || (v != 0.0f && v < 0x1p-100f)) return 3;
    }
  screen8::argmax(weight_of(*a), x, a->ldx, a->rows, block_bound, tile_l1, a->argmax, rescored);
  return 0;
#else
  (void)a, (void)block_bound, (void)tile_l1, (void)rescored;
  return 2;
#endif
}

// Several weights times the same rows (a fused projection's parts), their outputs side by side:
// `a` as kvserve_gguf_matmul takes it (its blocks, n and type unused; no argmax), part i writing
// the columns after parts 0..i-1's. A decode step's bf16 rows run every part's tiles in one
// parallel loop; other products run the parts one after another. Each output's arithmetic is
// kvserve_gguf_matmul's.
int kvserve_gguf_matmul_parts(const kvserve::GgufMatmulArgs* a, const kvserve::GgufPart* parts, int count) {
  if (count <= 0 || a->argmax) return 1;
  const int64_t out_bytes = a->out_dtype == kFloat32 ? 4 : 2;
  std::vector<kvserve::GgufMatmulArgs> each(count, *a);
  int64_t column = 0;
  for (int i = 0; i < count; ++i) {
    each[i].blocks = parts[i].blocks;
    each[i].n = parts[i].n;
    each[i].type = parts[i].type;
    each[i].out = a->out ? static_cast<char*>(a->out) + column * out_bytes : nullptr;
    column += parts[i].n;
    if (!valid(&each[i])) return 1;
  }
  if (a->out && a->ldo < column) return 1;
  if (a->activations == 1) {
#if KVSERVE_HAS_GGUF_INT8
    std::vector<q8::Part> int8_parts;
    for (const kvserve::GgufMatmulArgs& part : each) {
      const Problem p{nullptr, kFloat32, part.n, part.k, nullptr, part.ldx, part.out, part.out_dtype, part.ldo};
      int8_parts.push_back({weight_of(part), p, part.type, (part.n + kTile - 1) / kTile});
    }
    q8::run(int8_parts, a->x, a->x_dtype == kBFloat16, a->ldx, a->rows, nullptr);
    return 0;
#else
    return 4;
#endif
  }
#if KVSERVE_HAS_GGUF_DOT
  if (a->activations == 0 && a->x_dtype == kBFloat16 && a->rows <= dot::kFusedRows) {
    std::vector<dot::FusedPart> fused;
    bool mins = false;
    for (const kvserve::GgufMatmulArgs& part : each) {
      const Problem p{nullptr, kFloat32, part.n, part.k, nullptr, part.ldx, part.out, part.out_dtype, part.ldo};
      fused.push_back({weight_of(part), p, dot::fused_tile_for(part.type, part.rows), (part.n + kTile - 1) / kTile});
      mins = mins || dot::has_min(part.type);
    }
    const uint16_t* x = static_cast<const uint16_t*>(a->x);
    const std::vector<float> sums = mins ? dot::sub_block_sums(x, a->ldx, a->rows, a->k) : std::vector<float>{};
    dot::run_fused(fused.data(), count, {x, a->ldx, mins ? sums.data() : nullptr}, a->rows, nullptr);
    return 0;
  }
#endif
  for (const kvserve::GgufMatmulArgs& part : each)
    if (const int rc = kvserve_gguf_matmul(&part)) return rc;
  return 0;
}

}  // extern "C"
