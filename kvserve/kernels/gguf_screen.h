// Greedy argmax over a Q8_0 weight (a GGUF lm_head), exact, screened with int8 dot products on the
// blocks' own codes (gguf_matmul.cpp includes this after gguf_dot.h). A Q8_0 value is d * q (d an
// fp16 per 32 codes, q int8), so with each row x quantized per block of 32 dims, x = t_b * r + e
// (r int8, |e| <= E_b), a logit is approximated exactly in integers per block:
//
//   z_i = sum_b d_ib * t_b * sum_j q_ibj * r_bj,    |x . w_i - z_i| <= sum_b |d_ib| |q_ib|_1 E_b.
//
// No second copy of the weight: the screen reads the same bytes as the full product (vpdpbusd takes
// unsigned x signed bytes, so each code goes in as q + 128 and 128 * sum_j r_bj comes off per block).
// The bound is the smaller of two: per tile of 16 rows and block, the largest |d| |q|_1 of its rows
// (kept beside the weight, 4 bytes per 512 weights) times that block's E_b, summed; and per tile the
// largest row L1 norm times the largest E_b (also the cheap first test, and the scale of the float
// rounding of both z and the exact product). A tile stays a candidate while its upper
// bound reaches the best lower bound seen (by any thread); candidates are recomputed with the full
// product's own one-row kernel (dot::fused_tile), so the result is its argmax bit for bit, ties to
// the lowest index.

#pragma once

#if KVSERVE_HAS_GGUF_DOT && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define KVSERVE_HAS_GGUF_SCREEN 1
#else
#define KVSERVE_HAS_GGUF_SCREEN 0
#endif

#if KVSERVE_HAS_GGUF_SCREEN

namespace screen8 {

constexpr int kValues = 32;                   // Q8_0 codes per block
constexpr int kBlockBytes = 34 * kTile;       // one block of a 16-row tile: fp16 d, then 32 codes, interleaved
constexpr int kScreenRows = 4;                // rows screened together against kScreenTiles tiles held in L1
constexpr int kScreenTiles = 3;

inline float up(double v) {
  const float f = static_cast<float>(v);
  return static_cast<double>(f) >= v ? f : std::nextafter(f, std::numeric_limits<float>::infinity());
}

// block_bound [tiles][k/32]: max over the tile's rows of |d| * sum |q|; tile_l1 [tiles]: max row L1
inline void bounds(const uint8_t* tiles_data, int64_t n, int k, float* block_bound, float* tile_l1) {
  const int blocks = k / kValues;
  const int64_t tiles = (n + kTile - 1) / kTile;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    const uint8_t* tile = tiles_data + t * blocks * kBlockBytes;
    double row_l1[kTile] = {};
    for (int b = 0; b < blocks; ++b) {
      const uint8_t* blk = tile + static_cast<int64_t>(b) * kBlockBytes;
      alignas(64) float d[kTile];
      _mm512_store_ps(d, lanes_half(blk, 0).v);
      double top = 0.0;
      for (int i = 0; i < kTile; ++i) {
        int sum = 0;
        for (int j = 0; j < kValues; ++j) sum += std::abs(static_cast<int>(static_cast<int8_t>(blk[(2 + j) * kTile + i])));
        const double v = std::fabs(static_cast<double>(d[i])) * sum;
        row_l1[i] += v;
        top = std::max(top, v);
      }
      block_bound[t * blocks + b] = up(top);
    }
    tile_l1[t] = up(*std::max_element(row_l1, row_l1 + kTile));
  }
}

// rows quantized per block: r = round(x / t_b) (|r| <= 127), t_b = max |x_b| / 127; E_b >= max |x - t_b r|
struct QuantRows {
  std::vector<int8_t> r;        // [rows][k]
  std::vector<float> scale;     // [rows][blocks]
  std::vector<int32_t> excess;  // [rows][blocks]: 128 * sum r
  std::vector<float> error;     // [rows][blocks]
  std::vector<float> error_max, x_max;  // [rows]
};

inline QuantRows quantize(const uint16_t* x, int64_t ldx, int rows, int k) {
  const int blocks = k / kValues;
  QuantRows q{std::vector<int8_t>(static_cast<size_t>(rows) * k), std::vector<float>(static_cast<size_t>(rows) * blocks),
              std::vector<int32_t>(static_cast<size_t>(rows) * blocks), std::vector<float>(static_cast<size_t>(rows) * blocks),
              std::vector<float>(rows), std::vector<float>(rows)};
  for (int r = 0; r < rows; ++r) {
    float x_max = 0.0f, error_max = 0.0f;
    for (int b = 0; b < blocks; ++b) {
      const uint16_t* xb = x + r * ldx + b * kValues;
      float amax = 0.0f;
      for (int j = 0; j < kValues; ++j) amax = std::max(amax, std::fabs(Elem<kBFloat16>::load(xb[j])));
      const float t = amax / 127.0f;
      int32_t sum = 0;
      double error = 0.0;
      int8_t* out = q.r.data() + static_cast<size_t>(r) * k + b * kValues;
      for (int j = 0; j < kValues; ++j) {
        const float v = Elem<kBFloat16>::load(xb[j]);
        const float code = t > 0.0f ? std::min(127.0f, std::max(-127.0f, std::nearbyint(v / t))) : 0.0f;
        out[j] = static_cast<int8_t>(code);
        sum += out[j];
        error = std::max(error, std::fabs(static_cast<double>(v) - static_cast<double>(t) * code));
      }
      const size_t at = static_cast<size_t>(r) * blocks + b;
      q.scale[at] = t;
      q.excess[at] = 128 * sum;
      q.error[at] = up(error);
      x_max = std::max(x_max, amax);
      error_max = std::max(error_max, q.error[at]);
    }
    q.x_max[r] = x_max;
    q.error_max[r] = error_max;
  }
  return q;
}

struct Candidate {
  int row;
  int64_t tile;
  float upper;
};

inline void raise(std::atomic<float>& bar, float value) {
  float seen = bar.load(std::memory_order_relaxed);
  while (value > seen && !bar.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

// z[m][t] = tile t's 16 lanes' approximations for rows row0 .. row0 + MR - 1, against NT tiles (MR
// and NT fixed, so the sums stay in registers; each tile's codes tile_codes apart)
template <int MR, int NT>
void screen_rows(const __m512i* codes, int64_t tile_codes, const __m512* scales, int blocks, const QuantRows& q, int k, int row0, __m512 (*z)[kScreenTiles]) {
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  const int8_t* r = q.r.data() + static_cast<size_t>(row0) * k;
  for (int b = 0; b < blocks; ++b) {
    __m512i sum[MR][NT];
    for (int m = 0; m < MR; ++m)
      for (int t = 0; t < NT; ++t) sum[m][t] = _mm512_setzero_si512();
    for (int quad = 0; quad < 8; ++quad) {
      __m512i wq[NT];
      for (int t = 0; t < NT; ++t) wq[t] = codes[t * tile_codes + b * 8 + quad];
      for (int m = 0; m < MR; ++m) {
        int32_t four;
        std::memcpy(&four, r + static_cast<size_t>(m) * k + b * kValues + 4 * quad, sizeof(four));
        const __m512i a = _mm512_set1_epi32(four);
        for (int t = 0; t < NT; ++t) sum[m][t] = _mm512_dpbusd_epi32(sum[m][t], wq[t], a);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const size_t at = static_cast<size_t>(row0 + m) * blocks + b;
      const __m512i excess = _mm512_set1_epi32(q.excess[at]);
      const __m512 scale = _mm512_set1_ps(q.scale[at]);
      for (int t = 0; t < NT; ++t)
        acc[m][t] = _mm512_fmadd_ps(scales[t * blocks + b], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum[m][t], excess)), scale), acc[m][t]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) z[m][t] = acc[m][t];
}

using ScreenRows = void (*)(const __m512i*, int64_t, const __m512*, int, const QuantRows&, int, int, __m512 (*)[kScreenTiles]);

template <int NT>
ScreenRows screen_rows_for_tiles(int rows) {
  return for_rows<1, kScreenRows>(rows, ScreenRows{}, [](auto r) -> ScreenRows { return screen_rows<decltype(r)::value, NT>; });
}

inline ScreenRows screen_rows_for(int rows, int tiles) {
  return tiles == 3 ? screen_rows_for_tiles<3>(rows) : tiles == 2 ? screen_rows_for_tiles<2>(rows) : screen_rows_for_tiles<1>(rows);
}

// x (bf16 [rows, k], stride ldx) against the Q8_0 weight w: argmax [rows]; rescored (optional): the
// candidate tiles recomputed exactly, summed over the rows
inline void argmax(const Weight& w, const uint16_t* x, int64_t ldx, int rows, const float* block_bound, const float* tile_l1, int64_t* out,
                   int64_t* rescored) {
  const int k = w.k, blocks = k / kValues;
  const int64_t tiles = (w.n + kTile - 1) / kTile;
  const QuantRows q = quantize(x, ldx, rows, k);
  // float rounding of z (20-odd block terms) and of the exact product (k products summed), as a
  // fraction of a row's L1 norm times |x|: generously (2x) above both
  const float rounding = static_cast<float>(2.0 * (k + k / 16 + 64) * std::ldexp(1.0, -24));
  // and a block term (d as small as 2^-24) may land among the subnormals, absolute error 2^-150 an operation
  const float underflow = static_cast<float>((3 * blocks + 8) * std::ldexp(1.0, -149));
  std::vector<std::atomic<float>> bars(rows);
  for (auto& bar : bars) bar.store(-std::numeric_limits<float>::infinity(), std::memory_order_relaxed);
  alignas(64) static const uint8_t transpose[64] = {
      0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53, 6, 22, 38, 54, 7, 23, 39, 55,
      8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59, 12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
  std::vector<Candidate> found;
#pragma omp parallel
  {
    std::vector<Candidate> mine;
    // kScreenTiles tiles' codes as vpdpbusd takes them ([block][quad][lane][4] bytes, + 128) and their d's
    const int64_t tile_codes = static_cast<int64_t>(blocks) * 8;
    std::vector<__m512i> codes(static_cast<size_t>(tile_codes) * kScreenTiles);
    std::vector<__m512> scales(static_cast<size_t>(blocks) * kScreenTiles);
    const __m512i index = _mm512_load_si512(transpose);
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const int threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t end = tiles * (me + 1) / threads;
    for (int64_t first = tiles * me / threads; first < end; first += kScreenTiles) {
      const int group = static_cast<int>(std::min<int64_t>(kScreenTiles, end - first));
      for (int g = 0; g < group; ++g) {
        const uint8_t* tile = w.tiles + (first + g) * w.tile_bytes;
        for (int b = 0; b < blocks; ++b) {
          const uint8_t* blk = tile + static_cast<int64_t>(b) * kBlockBytes;
          scales[g * blocks + b] = lanes_half(blk, 0).v;
          for (int quad = 0; quad < 8; ++quad)
            codes[g * tile_codes + b * 8 + quad] = _mm512_xor_si512(
                _mm512_permutexvar_epi8(index, _mm512_loadu_si512(blk + (2 + 4 * quad) * kTile)), flip);
        }
      }
      for (int row0 = 0; row0 < rows; row0 += kScreenRows) {
        const int count = std::min(kScreenRows, rows - row0);
        __m512 z[kScreenRows][kScreenTiles];
        screen_rows_for(count, group)(codes.data(), tile_codes, scales.data(), blocks, q, k, row0, z);
        for (int g = 0; g < group; ++g) {
          const int64_t t = first + g;
          const int64_t left = w.n - t * kTile;
          const __mmask16 valid = left >= kTile ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
          const float* tile_blocks = block_bound + t * blocks;
          for (int m = 0; m < count; ++m) {
            const int row = row0 + m;
            const float top = _mm512_mask_reduce_max_ps(valid, z[m][g]);
            const float slack = rounding * tile_l1[t] * (q.x_max[row] + q.error_max[row]) + underflow;
            const float bar = bars[row].load(std::memory_order_relaxed);
            // two bounds on every lane's |x . w_i - z_i|: its L1 norm times the largest E_b (cheap: a tile
            // under the bar with it can neither win nor raise the bar), and the sum over blocks
            const float cheap = tile_l1[t] * q.error_max[row];
            if (top + 1.001f * (cheap + slack) < bar) continue;
            float blockwise = 0.0f;
            for (int b = 0; b < blocks; ++b) blockwise += tile_blocks[b] * q.error[static_cast<size_t>(row) * blocks + b];
            const float bound = 1.001f * (std::min(cheap, blockwise) + slack);
            if (top - bound > bar) raise(bars[row], top - bound);
            if (top + bound >= bar) mine.push_back({row, t, top + bound});  // (a bar just raised by this tile: it stays too)
          }
        }
      }
    }
#pragma omp critical
    found.insert(found.end(), mine.begin(), mine.end());
  }
  // the survivors against each row's final bar, recomputed exactly in tile order
  std::vector<Candidate> kept;
  for (const Candidate& c : found)
    if (c.upper >= bars[c.row].load(std::memory_order_relaxed)) kept.push_back(c);
  std::sort(kept.begin(), kept.end(), [](const Candidate& a, const Candidate& b) { return a.row != b.row ? a.row < b.row : a.tile < b.tile; });
  if (rescored) *rescored = static_cast<int64_t>(kept.size());
  std::vector<float> merged_value(rows, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> merged_index(rows, -1);
  const Problem p{nullptr, kFloat32, w.n, k, nullptr, ldx, nullptr, kFloat32, w.n};
  const dot::FusedTile exact = dot::fused_tile_for(kQ8_0, 1);
#pragma omp parallel
  {
    std::vector<RowBest> best(rows, RowBest{f32x16{} - std::numeric_limits<float>::infinity(), i32x16{} - 1});
#pragma omp for schedule(static)
    for (size_t i = 0; i < kept.size(); ++i) {
      const Candidate& c = kept[i];
      exact(w, c.tile, p, dot::BfRows{x + c.row * ldx, ldx, nullptr}, &best[c.row]);
    }
    merge_best(best, merged_value, merged_index);
  }
  for (int r = 0; r < rows; ++r) out[r] = merged_index[r] < 0 ? 0 : merged_index[r];
}

}  // namespace screen8

#endif  // KVSERVE_HAS_GGUF_SCREEN
