// Greedy decoding's lm_head argmax, exact, at int8 speed: screen every token with int8 dot
// products and a proven error bound, then rescore the few tiles that can still win in bf16.
//
// The weight W [n, k] is kept twice: packed bf16 (packed_matmul.cpp's layout, what the logits
// path multiplies) and int8 with one scale per row, W = s_i * q_i + E (|E_ij| <= eps_i). Each
// hidden row x is quantized in groups of `group` dims, x = t_g * r + D (|D_j| <= delta_g). Then
//   |x . w_i - s_i * sum_g t_g (q_i,g . r_g)| <= sum_g delta_g * s_i * |q_i,g|_1 + eps_i * |x|_1,
// computed per token (lane) here, widened by 0.1% plus a per-row slack for float rounding (the
// caller's). vpdpbusd takes unsigned x signed bytes, so the weight is stored as q + 128 and the
// excess 128 * sum(r_g) is removed per group: the correction depends on the row only.
//
// A tile stays a candidate while some lane's upper bound (approx + B) reaches the best lower
// bound (approx - B) seen so far, by any thread. Most tiles fail a cheap first test against a
// per-tile bound (the caller's, at least every lane's B) and never compute B per lane. The final
// bar drops more. Candidate tiles are recomputed with exactly the bf16 dot products of the full
// kernel (same instruction sequence per lane), so the result is bit-identical to
// packed_matmul's argmax, ties to the lowest index included.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

#include "args.h"
#include "int8_screen.h"
#include "simd.h"

namespace {

using namespace kvserve::screen;

#if KVSERVE_HAS_SCREEN

struct Candidate {
  int row;
  int64_t tile;
  float upper;  // the tile's best upper bound
};

struct RowState {
  __m512 lower;  // per lane: the best lower bound (approx - bound) this thread has seen
};

// The best lower bound per row, shared by the threads: each thread screens its own part of the
// vocabulary, and a high bar found by one (common tokens come first in most vocabularies) spares
// the other most of its candidates. Only ever raised.
inline void raise(std::atomic<float>& bar, float value) {
  float seen = bar.load(std::memory_order_relaxed);
  while (value > seen && !bar.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

struct ScreenArgs {
  const uint8_t* qpacked;
  const float* row_scale;
  const float* row_error;
  const float* row_abs_q;  // [tile][group][16]
  int64_t n;
  int k;
  const int8_t* xq;
  int64_t ldxq;
  const float* group_scale;  // [rows][groups]
  const float* group_delta;  // [rows][groups]
  int groups;
  int quads_per_group;
  const float* correction;  // [rows]
  const float* x_l1;        // [rows]
  const float* slack;       // [rows]
  const float* tile_bound;  // [rows][tiles]: at least the largest lane bound of the tile
  int64_t tiles;
};

template <int MR, int NT>
void screen_rows(const ScreenArgs& a, int64_t first, int row, RowState* state, std::atomic<float>* bars,
                 std::vector<Candidate>& found) {
  const int64_t n = a.n;
  const int k = a.k;
  const int groups = a.groups;
  const int quads = k / 4;
  const int64_t tile_stride = static_cast<int64_t>(k) * kTile;
  __m512 approx[MR][NT];
  screen_block<MR, NT>(a.qpacked + first * tile_stride, tile_stride, a.xq + row * a.ldxq, a.ldxq, quads, a.quads_per_group,
                       a.group_scale + row * groups, groups, approx);
  for (int t = 0; t < NT; ++t) {
    const int64_t tile = first + t;
    const int64_t left = n - tile * kTile;
    const __mmask16 valid = left >= kTile ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 s = _mm512_loadu_ps(a.row_scale + tile * kTile);
    const __m512 error = _mm512_loadu_ps(a.row_error + tile * kTile);
    const float* abs_q = a.row_abs_q + tile * groups * kTile;
    for (int m = 0; m < MR; ++m) {
      RowState& st = state[row + m];
      const __m512 z = _mm512_mul_ps(s, _mm512_sub_ps(approx[m][t], _mm512_set1_ps(a.correction[row + m])));
      // a tile whose upper bound stays below the threshold (most of them) can neither win nor raise it
      const float cheap = a.tile_bound[static_cast<int64_t>(row + m) * a.tiles + tile];
      const float bar = bars[row + m].load(std::memory_order_relaxed);
      if (!_mm512_mask_cmp_ps_mask(valid, z, _mm512_set1_ps(bar - cheap), _CMP_GE_OQ)) continue;
      // the proven per-lane bound, widened by 0.1% and the row's slack for float rounding
      __m512 bound = _mm512_mul_ps(error, _mm512_set1_ps(a.x_l1[row + m]));
      for (int g = 0; g < groups; ++g)
        bound = _mm512_fmadd_ps(_mm512_set1_ps(a.group_delta[(row + m) * groups + g]), _mm512_loadu_ps(abs_q + g * kTile), bound);
      const __m512 bv = _mm512_fmadd_ps(bound, _mm512_set1_ps(1.001f), _mm512_set1_ps(a.slack[row + m]));
      st.lower = _mm512_mask_max_ps(st.lower, valid, st.lower, _mm512_sub_ps(z, bv));
      const float raised = _mm512_reduce_max_ps(st.lower);
      if (raised > bar) raise(bars[row + m], raised);
      const __m512 upper = _mm512_add_ps(z, bv);
      if (_mm512_mask_cmp_ps_mask(valid, upper, _mm512_set1_ps(std::max(bar, raised)), _CMP_GE_OQ))
        found.push_back({row + m, tile, _mm512_mask_reduce_max_ps(valid, upper)});
    }
  }
}

#endif  // KVSERVE_HAS_SCREEN

}  // namespace

extern "C" {

int kvserve_has_int8_screen() { return KVSERVE_HAS_SCREEN; }

// weight: bf16 [n, k], k % 4 == 0. qpacked: uint8 [ceil(n/16) * 16 * k] as [tile][k/4][16][4],
// each byte q + 128 with q = round(w / s) in [-127, 127]. row_scale: float [ceil(n/16) * 16] (s,
// 0 for padding). row_error: float [same] (max |w - s q| over the row, computed in double).
// row_abs_q: float [ceil(n/16)][groups][16] (s * sum |q| over each group of `group` dims).
int kvserve_pack_int8_weight(const uint16_t* weight, int64_t n, int k, int group, uint8_t* qpacked, float* row_scale,
                             float* row_error, float* row_abs_q) {
  if (n <= 0 || k <= 0 || k % 4 || group <= 0 || group % 4) return 1;
  const int64_t tiles = (n + kTile - 1) / kTile;
  const int groups = (k + group - 1) / group;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    std::vector<float> w(k);
    for (int i = 0; i < kTile; ++i) {
      const int64_t r = t * kTile + i;
      float peak = 0.f;
      if (r < n)
        for (int j = 0; j < k; ++j) {
          uint32_t bits = static_cast<uint32_t>(weight[r * k + j]) << 16;
          std::memcpy(&w[j], &bits, sizeof(float));
          peak = std::max(peak, std::abs(w[j]));
        }
      const float s = r < n && peak > 0.f ? peak / 127.f : 0.f;
      double error = 0.0;
      float* abs_q = row_abs_q + t * groups * kTile;
      for (int g = 0; g < groups; ++g) abs_q[g * kTile + i] = 0.f;
      for (int j = 0; j < k; ++j) {
        int q = 0;
        if (s > 0.f) q = std::max(-127, std::min(127, static_cast<int>(std::nearbyint(w[j] / s))));
        if (r < n && s > 0.f) {
          error = std::max(error, std::abs(static_cast<double>(w[j]) - static_cast<double>(s) * q));
          abs_q[(j / group) * kTile + i] += s * std::abs(q);
        } else if (r < n) {
          error = std::max(error, std::abs(static_cast<double>(w[j])));
        }
        qpacked[((t * (k / 4) + j / 4) * kTile + i) * 4 + j % 4] = static_cast<uint8_t>(q + 128);
      }
      row_scale[r] = s;
      // rounded up so the stored float still bounds the true error
      row_error[r] = static_cast<float>(error) * (1.f + 1e-6f) + 1e-30f;
    }
  }
  return 0;
}

// xq: int8 [rows, k] (row stride ldxq); group_scale: float [rows, groups]; correction: float
// [rows] (128 * sum_g t_g * sum(r_g)); bound: float [rows, ceil(n/16)]. x: bf16 [rows, k] for
// the exact rescoring. argmax: int64 [rows]. rescored (may be null): int64 [rows], the tiles
// recomputed in bf16 per row.
int kvserve_screened_argmax(const kvserve::ScreenedArgmaxArgs* a) {
#if KVSERVE_HAS_SCREEN
  const uint8_t* qpacked = a->qpacked;
  const uint16_t* bf16_packed = a->bf16_packed;
  const int64_t n = a->n, ldxq = a->ldxq, ldx = a->ldx;
  const int k = a->k, group = a->group, rows = a->rows;
  const uint16_t* x = a->x;
  int64_t* argmax = a->argmax;
  int64_t* rescored = a->rescored;
  if (n <= 0 || k <= 0 || k % 4 || group <= 0 || group % 4 || rows <= 0 || ldxq < k || ldx < k) return 1;
  if (check_layout(a->bf16_layout, k)) return 1;
  const int groups = (k + group - 1) / group;
  if (groups > kMaxGroups) return 1;
  const ScreenArgs args{qpacked, a->row_scale, a->row_error, a->row_abs_q, n, k, a->xq, ldxq, a->group_scale, a->group_delta, groups,
                        group / 4, a->correction, a->x_l1, a->slack, a->tile_bound, (n + kTile - 1) / kTile};
  const int64_t tiles = args.tiles;
  constexpr int NT = 3;
  constexpr int MR = 4;
  const int64_t blocks = (tiles + NT - 1) / NT;
  const int threads = omp_get_max_threads();
  std::vector<std::vector<Candidate>> found(threads);
  std::vector<std::vector<RowState>> states(threads);
  std::vector<std::atomic<float>> bars(rows);
  for (auto& bar : bars) bar.store(-std::numeric_limits<float>::infinity());
#pragma omp parallel
  {
    const int me = omp_get_thread_num();
    std::vector<RowState>& state = states[me];
    state.assign(rows, RowState{_mm512_set1_ps(-std::numeric_limits<float>::infinity())});
    std::vector<Candidate>& mine = found[me];
    const int64_t tile_bytes = static_cast<int64_t>(k) * kTile;
    const int row_groups = (rows + MR - 1) / MR;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t first = b * NT;
      const int64_t count = std::min<int64_t>(NT, tiles - first);
      // the weights stream from DRAM once per call: the next block's lines go to L2 a share per
      // row group, while this block (already in cache after the first group) is computed
      const int64_t next_lines = std::max<int64_t>(0, std::min<int64_t>(NT, tiles - first - NT)) * tile_bytes / 64;
      const int64_t share = (next_lines + row_groups - 1) / row_groups;
      const char* next = reinterpret_cast<const char*>(qpacked + (first + NT) * tile_bytes);
      int row = 0;
      for (; row + MR <= rows; row += MR) {
        for (int64_t line = (row / MR) * share; line < std::min(next_lines, (row / MR + 1) * share); ++line)
          _mm_prefetch(next + line * 64, _MM_HINT_T1);
        if (count == NT)
          screen_rows<MR, NT>(args, first, row, state.data(), bars.data(), mine);
        else
          for (int64_t t = first; t < first + count; ++t) screen_rows<MR, 1>(args, t, row, state.data(), bars.data(), mine);
      }
      for (; row < rows; ++row)
        for (int64_t t = first; t < first + count; ++t) screen_rows<1, 1>(args, t, row, state.data(), bars.data(), mine);
    }
  }
  // the final threshold per row: the best lower bound over every thread
  std::vector<float> threshold(rows, -std::numeric_limits<float>::infinity());
  for (auto& state : states)
    for (int r = 0; r < rows && !state.empty(); ++r) threshold[r] = std::max(threshold[r], _mm512_reduce_max_ps(state[r].lower));
  std::vector<Candidate> all;
  for (auto& mine : found)
    for (const Candidate& c : mine)
      if (c.upper >= threshold[c.row]) all.push_back(c);
  std::vector<float> best_value(rows, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> best_index(rows, -1);
  std::vector<int64_t> count(rows, 0);
  // rescore; a tile found before the threshold settled is kept only if it can still win
  const int64_t total = static_cast<int64_t>(all.size());
#pragma omp parallel
  {
    std::vector<float> local_value(rows, -std::numeric_limits<float>::infinity());
    std::vector<int64_t> local_index(rows, -1);
    std::vector<int64_t> local_count(rows, 0);
    constexpr int kChains = 8;
    const int64_t batches = (total + kChains - 1) / kChains;
#pragma omp for schedule(dynamic, 4)
    for (int64_t batch = 0; batch < batches; ++batch) {
      int64_t tile[kChains];
      const uint16_t* row_x[kChains];
      int row[kChains];
      for (int c = 0; c < kChains; ++c) {
        const Candidate& cand = all[std::min(total - 1, batch * kChains + c)];  // a short last batch repeats its final entry
        tile[c] = cand.tile;
        row[c] = cand.row;
        row_x[c] = x + cand.row * ldx;
      }
      __m512 exact[kChains];
      exact_tiles_of<kChains>(a->bf16_layout, bf16_packed, tile, k, row_x, exact);
      const int used = static_cast<int>(std::min<int64_t>(kChains, total - batch * kChains));
      for (int c = 0; c < used; ++c) {
        const int r = row[c];
        ++local_count[r];
        alignas(64) float lanes[kTile];
        _mm512_store_ps(lanes, exact[c]);
        for (int i = 0; i < kTile; ++i) {
          const int64_t index = tile[c] * kTile + i;
          if (index >= n) break;
          if (local_index[r] < 0 || lanes[i] > local_value[r] || (lanes[i] == local_value[r] && index < local_index[r])) {
            local_value[r] = lanes[i];
            local_index[r] = index;
          }
        }
      }
    }
#pragma omp critical
    for (int r = 0; r < rows; ++r) {
      count[r] += local_count[r];
      if (local_index[r] >= 0 &&
          (best_index[r] < 0 || local_value[r] > best_value[r] || (local_value[r] == best_value[r] && local_index[r] < best_index[r]))) {
        best_value[r] = local_value[r];
        best_index[r] = local_index[r];
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    if (best_index[r] < 0) return 3;  // no candidate: the bound was violated (non-finite input)
    argmax[r] = best_index[r];
    if (rescored) rescored[r] = count[r];
  }
  return 0;
#else
  return 2;  // built for a CPU without AVX512-VNNI/BF16
#endif
}

}  // extern "C"
