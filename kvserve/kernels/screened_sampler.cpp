// Sampling without full logits, exact: the token sampler.cpp would draw from the full logits,
// found from the lm_head's int8 screen (int8_screen.h) and the exact bf16 values of the few tiles
// that can matter.
//
// The screen gives every token an approximate logit z with a proven bound B per tile of 16
// (|logit - z| <= B, as in screened_argmax.cpp). Per row, tiles are recomputed exactly (bit for bit
// packed_matmul's values) when they hold a penalized token, when they can hold the largest logit
// (so the scores s = (logit - max) / T are exact where computed), and when one of their tokens can
// still win the Gumbel-max draw (gumbel.h): its score's upper bound plus its noise reaches the best
// exact noisy score. That gives w, the token Gumbel-max picks among all tokens with mass, exactly.
// The filters only remove tokens, so when w survives them it is also the winner among the kept
// tokens. Top-k and min-p keep s >= a threshold: the tiles that can reach it are recomputed, and
// the kept set is then known exactly (and top-p over it, and the winner among it if w fell out).
// Top-p alone keeps w when the mass before it is below top_p times the smallest the total mass
// can be; the tokens that can rank above w are recomputed for that. A row the screen cannot
// decide (w past the top-p cut, a boundary within the bound) is left to the full-logits path:
// token -1.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include <omp.h>

#include "args.h"
#include "gumbel.h"
#include "int8_screen.h"
#include "simd.h"

namespace {

using namespace kvserve;
using namespace kvserve::screen;

constexpr float kMassFloor = -88.f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kBinsPerNat = 8;
constexpr int kBandBins = 16 * kBinsPerNat;
constexpr int64_t kMaxRankTiles = 4096;  // top-p alone: past this many tiles above w, the full path is cheaper

#if KVSERVE_HAS_SCREEN

// Every token's approximation z = s_i * (int8 dot - correction), for every row, into approx
// [rows][stride] (lanes past n hold -inf), and each tile's largest z into tile_max [rows][tiles].
// The per-lane bounds are left to the rows, which compute them for the few tiles that need them.
void screen_all(const kvserve::ScreenedArgmaxArgs& a, int groups, float* approx, int64_t stride, int64_t tiles, float* tile_max) {
  const int64_t n = a.n;
  const int k = a.k;
  const int rows = a.rows;
  const int64_t tile_stride = static_cast<int64_t>(k) * kTile;
  constexpr int NT = 3;
  constexpr int MR = 4;
  const int64_t blocks = (tiles + NT - 1) / NT;
  auto store = [&](int row, int64_t tile, __m512 value) {
    const __m512 s = _mm512_loadu_ps(a.row_scale + tile * kTile);
    const __m512 z = _mm512_mul_ps(s, _mm512_sub_ps(value, _mm512_set1_ps(a.correction[row])));
    const int64_t left = n - tile * kTile;
    const __mmask16 valid = left >= kTile ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 lanes = _mm512_mask_blend_ps(valid, _mm512_set1_ps(kNegInf), z);
    _mm512_storeu_ps(approx + row * stride + tile * kTile, lanes);
    tile_max[row * tiles + tile] = _mm512_reduce_max_ps(lanes);
  };
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * NT;
    const int64_t count = std::min<int64_t>(NT, tiles - first);
    int row = 0;
    for (; row + MR <= rows; row += MR) {
      if (count == NT) {
        __m512 value[MR][NT];
        screen_block<MR, NT>(a.qpacked + first * tile_stride, tile_stride, a.xq + row * a.ldxq, a.ldxq, k / 4, a.group / 4,
                             a.group_scale + row * groups, groups, value);
        for (int m = 0; m < MR; ++m)
          for (int t = 0; t < NT; ++t) store(row + m, first + t, value[m][t]);
      } else {
        for (int64_t t = first; t < first + count; ++t) {
          __m512 value[MR][1];
          screen_block<MR, 1>(a.qpacked + t * tile_stride, tile_stride, a.xq + row * a.ldxq, a.ldxq, k / 4, a.group / 4,
                              a.group_scale + row * groups, groups, value);
          for (int m = 0; m < MR; ++m) store(row + m, t, value[m][0]);
        }
      }
    }
    for (; row < rows; ++row)
      for (int64_t t = first; t < first + count; ++t) {
        __m512 value[1][1];
        screen_block<1, 1>(a.qpacked + t * tile_stride, tile_stride, a.xq + row * a.ldxq, a.ldxq, k / 4, a.group / 4,
                           a.group_scale + row * groups, groups, value);
        store(row, t, value[0][0]);
      }
  }
}

// s = (value - max) * inv_t, and the same of an interval widened for float rounding
inline f32x16 widen_up(f32x16 s) { return s + (s < 0.f ? -s : s) * 1e-6f + 1e-6f; }
inline f32x16 widen_down(f32x16 s) { return s - (s < 0.f ? -s : s) * 1e-6f - 1e-6f; }

class ScreenedRow {
 public:
  // inner: the row has the threads to itself (the loops over the vocabulary run in parallel)
  // tile_max: each tile's largest approximation (screen_all)
  ScreenedRow(const kvserve::ScreenedArgmaxArgs& screen, const kvserve::SamplerArgs& sample, int64_t r, int groups,
              const float* tile_max, bool inner)
      : inner_(inner), screen_(screen), p_(sample.params[r]), key_{p_.seed, static_cast<uint64_t>(p_.position)},
        n_(screen.n), tiles_((screen.n + kTile - 1) / kTile), z_(sample.logits + r * sample.stride),
        bound_(z_ + tiles_ * kTile), x_(screen.x + r * screen.ldx), tile_max_(tile_max + r * tiles_),
        tile_bound_(screen.tile_bound + r * tiles_), groups_(groups), group_delta_(screen.group_delta + r * groups),
        x_l1_(screen.x_l1[r]), slack_(screen.slack[r]), exact_(tiles_, 0), lane_bounds_(tiles_, 0), tile_hi_(tiles_),
        tile_lo_(tiles_), penalty_ids_(sample.penalty_ids), penalty_counts_(sample.penalty_counts) {}

  // The token, or -1 when the screen cannot decide it. rescored: the tiles computed exactly.
  int64_t sample(int64_t* rescored) {
    const int64_t token = decide();
    *rescored = rescored_;
    return token;
  }

 private:
  int64_t decide() {
    // 1. penalized tokens: the penalty is increasing in the logit, so it maps a token's interval to
    // the penalized value's; a tile computed exactly later gets the penalty on its exact values
    std::vector<int64_t> todo;
    for (int64_t j = p_.penalty_begin; j < p_.penalty_end; ++j) {
      const int64_t id = penalty_ids_[j];
      penalized_.push_back({id / kTile, j});
      lane_bounds(id / kTile);
      const float lo = penalize(z_[id] - bound_[id], j), hi = penalize(z_[id] + bound_[id], j);
      z_[id] = 0.5f * (lo + hi);
      bound_[id] = 0.5f * (hi - lo) + (std::abs(lo) + std::abs(hi)) * 1e-6f + 1e-6f;
    }
    std::sort(penalized_.begin(), penalized_.end());
    // 2. the largest logit, exactly: first with each tile's bound (at least every lane's), then
    // with per-lane bounds for the tiles that can still hold it
    float lower = kNegInf;
#pragma omp parallel for if (inner_) reduction(max : lower) schedule(static)
    for (int64_t t = 0; t < tiles_; ++t) {
      if (lane_bounds_[t]) {
        tile_hi_[t] = hmax(lanes(t) + bounds(t));
        tile_lo_[t] = hmax(lanes(t) - bounds(t));
      } else {
        tile_hi_[t] = tile_max_[t] + tile_bound_[t];
        tile_lo_[t] = tile_max_[t] - tile_bound_[t];
      }
      lower = std::max(lower, tile_lo_[t]);
    }
    std::vector<int64_t> near;
    for (int64_t t = 0; t < tiles_; ++t)
      if (tile_hi_[t] >= lower) near.push_back(t);
    for (int64_t t : near) {
      lane_bounds(t);
      tile_hi_[t] = hmax(lanes(t) + bounds(t));
      tile_lo_[t] = hmax(lanes(t) - bounds(t));
      lower = std::max(lower, tile_lo_[t]);
    }
    for (int64_t t : near)
      if (!exact_[t] && tile_hi_[t] >= lower) todo.push_back(t);
    rescore(todo);
    max_ = kNegInf;
    for (int64_t t = 0; t < tiles_; ++t)
      if (exact_[t]) max_ = std::max(max_, tile_hi_[t]);
    if (!std::isfinite(max_)) return -1;
    inv_t_ = 1.f / p_.temperature;

    // 3. the Gumbel-max winner among every token with mass
    GumbelBest best;
    std::vector<int64_t> known;
    for (int64_t t = 0; t < tiles_; ++t)
      if (exact_[t]) known.push_back(t);
    offer_exact(known, best);
    // a chunk of 64 tokens is looked at when its largest uniform can lift its best upper bound to
    // the best noisy score; then each of its tokens that can reach it gets its tile recomputed
    const float floor = static_cast<float>(best.score) - kMaxNoise;
    const double best_score = best.score;
    const int64_t chunks = (n_ + 63) / 64;
#pragma omp parallel if (inner_)
    {
      std::vector<int64_t> mine;
#pragma omp for schedule(static) nowait
      for (int64_t c0 = 0; c0 < chunks; c0 += 16) {
        f32x16 top;
        uint32_t any = 0;
        for (int c = 0; c < 16; ++c) {
          top[c] = kNegInf;
          for (int j = 0; j < 4; ++j) {
            const int64_t t = (c0 + c) * 4 + j;
            if (t >= tiles_ || exact_[t] || score_hi(t) < floor) continue;
            top[c] = std::max(top[c], score_hi(t));
          }
          if (top[c] > kNegInf) any |= 1u << c;
        }
        if (!any) continue;
        u32x16 heads[4];
        chunk_heads16(key_, c0, heads);
        for (any &= chunk_may_reach(heads[0], static_cast<float>(best_score) - top); any; any &= any - 1) {
          const int c = __builtin_ctz(any);
          double u[64];
          chunk_uniforms(key_, c0 + c, heads[0][c], heads[1][c], u);
          for (int j = 0; j < 4; ++j) {
            const int64_t t = (c0 + c) * 4 + j;
            if (t >= tiles_ || exact_[t]) continue;
            lane_bounds(t);
            const f32x16 hi = upper(t);
            for (uint32_t bits = mask_gt(hi, kMassFloor); bits; bits &= bits - 1) {
              const int lane = __builtin_ctz(bits);
              if (static_cast<double>(hi[lane]) + gumbel_of_uniform(u[16 * j + lane]) >= best_score - 1e-6) {
                mine.push_back(t);
                break;
              }
            }
          }
        }
      }
#pragma omp critical
      todo.insert(todo.end(), mine.begin(), mine.end());
    }
    std::vector<int64_t> fresh = todo;
    rescore(todo);
    std::sort(fresh.begin(), fresh.end());
    fresh.erase(std::unique(fresh.begin(), fresh.end()), fresh.end());
    offer_exact(fresh, best);
    const int64_t w = best.id;
    if (w < 0) return -1;
    const float s_w = score(w);

    // 4. the filters
    const bool top_k = p_.top_k > 0 && p_.top_k < n_;
    const bool min_p = p_.min_p > 0.f;
    const bool top_p = p_.top_p < 1.f;
    if (!top_k && !min_p && !top_p) return w;
    const float log_min_p = min_p ? static_cast<float>(std::log(static_cast<double>(p_.min_p))) : kNegInf;
    // w survives the filters when few enough tokens rank above it, its s reaches min-p's threshold,
    // and the mass before it is below top_p times the least the kept mass can be
    bool kept_w = !(min_p && s_w < log_min_p);
    if (kept_w && (top_k || top_p)) {
      const Rank rank = rank_of(w, s_w);
      if (rank.count < 0) return -1;
      kept_w = !(top_k && rank.count >= p_.top_k);
      // the tokens before w and w itself are kept whenever w is; without top-k or min-p, every token
      const double least = top_k || min_p ? rank.before + rank.mass : rank.least_total;
      if (kept_w && top_p && !(rank.before < static_cast<double>(p_.top_p) * least * (1.0 - 1e-9))) {
        if (!top_k && !min_p) return -1;  // the total mass is needed, and only the full logits know it
        kept_w = false;  // decided below, exactly
      }
    }
    if (kept_w) return w;
    float threshold = log_min_p;
    if (top_k) {
      const float kth = top_k_threshold();
      if (std::isnan(kth)) return -1;
      threshold = std::max(threshold, kth);
    } else {
      exact_from(threshold);
    }
    // every token with s >= threshold is exact now: the kept set, in the order (s descending, id ascending)
    std::vector<Entry> kept;
    for (int64_t t = 0; t < tiles_; ++t) {
      if (!exact_[t]) continue;
      for (int i = 0; i < kTile && t * kTile + i < n_; ++i) {
        const int64_t id = t * kTile + i;
        const float s = score(id);
        if (s >= threshold && s > kMassFloor) kept.push_back(Entry{s, 0.f, id});
      }
    }
    std::sort(kept.begin(), kept.end(), [](const Entry& a, const Entry& b) { return a.s > b.s || (a.s == b.s && a.id < b.id); });
    masses(kept);
    int64_t end = static_cast<int64_t>(kept.size());
    if (top_p) {
      double total = 0.0;
      for (const Entry& e : kept) total += e.mass;
      const double target = static_cast<double>(p_.top_p) * total;
      double before = 0.0;
      end = 0;
      while (end < static_cast<int64_t>(kept.size()) && before < target) before += kept[end++].mass;
    }
    GumbelBest restricted;
    for (int64_t i = 0; i < end; ++i) {
      if (kept[i].id == w) return w;
      restricted.offer(noisy_score(kept[i].s, token_uniform(key_, kept[i].id)), kept[i].id);
    }
    return restricted.id;
  }

  struct Entry {
    float s;
    float mass;
    int64_t id;
  };

  // the full path's masses, exp16 of s, computed 16 at a time as it does
  static void masses(std::vector<Entry>& entries) {
    for (size_t i = 0; i < entries.size(); i += 16) {
      f32x16 s{};
      const size_t m = std::min<size_t>(16, entries.size() - i);
      for (size_t j = 0; j < m; ++j) s[j] = entries[i + j].s;
      const f32x16 e = exp16(s);
      for (size_t j = 0; j < m; ++j) entries[i + j].mass = e[j];
    }
  }

  struct Rank {
    int64_t count;       // tokens before w in the order (s descending, id ascending); -1: too many to compute
    double before;       // their mass
    double mass;         // w's
    double least_total;  // the least the mass of every token can be
  };

  // Every token that can rank above w is computed exactly, then counted.
  Rank rank_of(int64_t w, float s_w) {
    std::vector<int64_t> todo;
    for (int64_t t = 0; t < tiles_; ++t)
      if (!exact_[t] && score_hi(t) >= s_w) todo.push_back(t);
    if (static_cast<int64_t>(todo.size()) > kMaxRankTiles) return Rank{-1, 0.0, 0.0, 0.0};
    rescore(todo);
    int64_t count = 0;
    double before = 0.0, mass = 0.0, exact_total = 0.0, lower_total = 0.0;
#pragma omp parallel for if (inner_) reduction(+ : count, before, mass, exact_total, lower_total) schedule(static)
    for (int64_t t = 0; t < tiles_; ++t) {
      if (exact_[t]) {
        const f32x16 s = exact_scores(t);
        const f32x16 e = exp16(s);
        for (uint32_t bits = mask_gt(s, kMassFloor); bits; bits &= bits - 1) {
          const int lane = __builtin_ctz(bits);
          const int64_t id = t * kTile + lane;
          exact_total += e[lane];
          if (id == w) mass += e[lane];
          if (s[lane] > s_w || (s[lane] == s_w && id < w)) {
            ++count;
            before += e[lane];
          }
        }
      } else if (score_hi(t) > kMassFloor) {
        const f32x16 lo = lane_bounds_[t] ? lower(t) : coarse_lower(t);
        lower_total += hsum(lo > kMassFloor ? exp16(lo) : f32x16{});
      }
    }
    Rank rank{count, before, mass, exact_total};
    // exp16's own error (2e-7 relative) and the float sums', with room
    rank.least_total += lower_total * (1.0 - 1e-4);
    return rank;
  }

  // The k-th largest s, exactly: every tile that can reach a lower bound of it is recomputed; NaN
  // when the bound cannot be found within 16 nats of the top.
  float top_k_threshold() {
    int64_t count[kBandBins] = {};
    for (int64_t t = 0; t < tiles_; ++t) {
      if (!exact_[t] && score_hi(t) <= -16.f) continue;
      if (!exact_[t]) lane_bounds(t);
      const f32x16 lo = exact_[t] ? exact_scores(t) : lower(t);
      for (uint32_t bits = mask_gt(lo, -16.f); bits; bits &= bits - 1) {
        const int lane = __builtin_ctz(bits);
        ++count[std::min(kBandBins - 1, static_cast<int>(-lo[lane] * kBinsPerNat))];
      }
    }
    int64_t above = 0;
    int bin = -1;
    for (int b = 0; b < kBandBins && bin < 0; ++b)
      if ((above += count[b]) >= p_.top_k) bin = b;
    if (bin < 0) return std::numeric_limits<float>::quiet_NaN();
    const float floor = -static_cast<float>(bin + 1) / kBinsPerNat;
    exact_from(floor);
    std::vector<float> values;
    for (int64_t t = 0; t < tiles_; ++t) {
      if (!exact_[t]) continue;
      const f32x16 s = exact_scores(t);
      for (int i = 0; i < kTile; ++i)
        if (s[i] >= floor) values.push_back(s[i]);
    }
    if (static_cast<int64_t>(values.size()) < p_.top_k) return std::numeric_limits<float>::quiet_NaN();
    std::nth_element(values.begin(), values.begin() + (p_.top_k - 1), values.end(), std::greater<float>());
    return values[p_.top_k - 1];
  }

  // recompute every tile that can hold a token with s >= floor
  void exact_from(float floor) {
    std::vector<int64_t> todo;
    for (int64_t t = 0; t < tiles_; ++t)
      if (!exact_[t] && score_hi(t) >= floor) todo.push_back(t);
    rescore(todo);
  }

  f32x16 lanes(int64_t t) const {
    f32x16 v;
    std::memcpy(&v, z_ + t * kTile, sizeof(v));
    return v;
  }

  float score(int64_t id) const { return (z_[id] - max_) * inv_t_; }
  f32x16 exact_scores(int64_t t) const { return (lanes(t) - max_) * inv_t_; }
  f32x16 bounds(int64_t t) const {
    f32x16 v;
    std::memcpy(&v, bound_ + t * kTile, sizeof(v));
    return v;
  }
  float score_hi(int64_t t) const {
    const float s = (tile_hi_[t] - max_) * inv_t_;
    return s + std::abs(s) * 1e-6f + 1e-6f;
  }
  f32x16 upper(int64_t t) const { return widen_up((lanes(t) + bounds(t) - max_) * inv_t_); }
  f32x16 lower(int64_t t) const { return widen_down((lanes(t) - bounds(t) - max_) * inv_t_); }
  f32x16 coarse_lower(int64_t t) const { return widen_down((lanes(t) - tile_bound_[t] - max_) * inv_t_); }

  // Tile t's proven per-lane bounds into bound (once), as screened_argmax.cpp computes them:
  // widened by 0.1% and the row's slack for float rounding; 0 past n.
  void lane_bounds(int64_t t) {
    if (lane_bounds_[t]) return;
    lane_bounds_[t] = 1;
    __m512 bound = _mm512_mul_ps(_mm512_loadu_ps(screen_.row_error + t * kTile), _mm512_set1_ps(x_l1_));
    const float* abs_q = screen_.row_abs_q + t * groups_ * kTile;
    for (int g = 0; g < groups_; ++g)
      bound = _mm512_fmadd_ps(_mm512_set1_ps(group_delta_[g]), _mm512_loadu_ps(abs_q + g * kTile), bound);
    bound = _mm512_fmadd_ps(bound, _mm512_set1_ps(1.001f), _mm512_set1_ps(slack_));
    const int64_t left = n_ - t * kTile;
    const __mmask16 valid = left >= kTile ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    _mm512_storeu_ps(bound_ + t * kTile, _mm512_mask_blend_ps(valid, _mm512_setzero_ps(), bound));
  }

  // every token with mass of these exact tiles (sorted) at its noisy score, a chunk's uniforms made once
  void offer_exact(const std::vector<int64_t>& tiles, GumbelBest& best) const {
    int64_t chunk = -1;
    double u[64];
    for (int64_t t : tiles) {
      const f32x16 s = exact_scores(t);
      uint32_t bits = mask_gt(s, kMassFloor);
      if (!bits) continue;
      if (t / 4 != chunk) {
        chunk = t / 4;
        uint32_t head[4];
        philox(key_, static_cast<uint32_t>(chunk), 1u, head);
        chunk_uniforms(key_, chunk, head[0], head[1], u);
      }
      for (; bits; bits &= bits - 1) {
        const int lane = __builtin_ctz(bits);
        const int64_t id = t * kTile + lane;
        if (id < n_) best.offer(noisy_score(s[lane], u[16 * (t % 4) + lane]), id);
      }
    }
  }

  // the full path's penalty of entry j, the same float operations
  float penalize(float x, int64_t j) const {
    if (p_.repetition_penalty != 1.f) x = x > 0.f ? x / p_.repetition_penalty : x * p_.repetition_penalty;
    if (penalty_counts_[j] > 0) x -= p_.frequency_penalty * static_cast<float>(penalty_counts_[j]) + p_.presence_penalty;
    return x;
  }

  // The tiles' exact values into z (each tile once; the list is emptied).
  void rescore(std::vector<int64_t>& todo) {
    std::sort(todo.begin(), todo.end());
    todo.erase(std::unique(todo.begin(), todo.end()), todo.end());
    todo.erase(std::remove_if(todo.begin(), todo.end(), [&](int64_t t) { return exact_[t] != 0; }), todo.end());
    constexpr int kChains = 8;
    const int64_t total = static_cast<int64_t>(todo.size());
#pragma omp parallel for if (inner_ && total > kChains) schedule(dynamic, 1)
    for (int64_t at = 0; at < total; at += kChains) {
      int64_t tile[kChains];
      const uint16_t* row_x[kChains];
      for (int c = 0; c < kChains; ++c) {
        tile[c] = todo[std::min(total - 1, at + c)];
        row_x[c] = x_;
      }
      __m512 exact[kChains];
      exact_tiles_of<kChains>(screen_.bf16_layout, screen_.bf16_packed, tile, screen_.k, row_x, exact);
      for (int c = 0; c < kChains && at + c < total; ++c) {
        const int64_t t = tile[c];
        const int64_t left = n_ - t * kTile;
        const __mmask16 valid = left >= kTile ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
        _mm512_storeu_ps(z_ + t * kTile, _mm512_mask_blend_ps(valid, _mm512_set1_ps(kNegInf), exact[c]));
        for (auto it = std::lower_bound(penalized_.begin(), penalized_.end(), std::make_pair(t, int64_t{-1}));
             it != penalized_.end() && it->first == t; ++it)
          z_[penalty_ids_[it->second]] = penalize(z_[penalty_ids_[it->second]], it->second);
        exact_[t] = 1;
        lane_bounds_[t] = 1;
        std::memset(bound_ + t * kTile, 0, kTile * sizeof(float));
        tile_hi_[t] = tile_lo_[t] = hmax(lanes(t));
      }
    }
    rescored_ += total;
    todo.clear();
  }

  const bool inner_;
  const kvserve::ScreenedArgmaxArgs& screen_;
  const kvserve::SamplerRow& p_;
  const GumbelKey key_;
  const int64_t n_;
  const int64_t tiles_;
  float* z_;
  float* bound_;  // per lane, where lane_bounds_ says computed (0 for exact tiles)
  const uint16_t* x_;
  const float* tile_max_;
  const float* tile_bound_;  // at least the largest lane bound of the tile
  const int groups_;
  const float* group_delta_;
  const float x_l1_;
  const float slack_;
  std::vector<uint8_t> exact_;
  std::vector<uint8_t> lane_bounds_;
  std::vector<float> tile_hi_;  // per tile: the largest upper bound of its lanes (exact: the largest value)
  std::vector<float> tile_lo_;  // the largest lower bound
  const int64_t* penalty_ids_;
  const int32_t* penalty_counts_;
  std::vector<std::pair<int64_t, int64_t>> penalized_;  // (tile, penalty entry), sorted
  float max_ = kNegInf;
  float inv_t_ = 1.f;
  int64_t rescored_ = 0;
};

#endif  // KVSERVE_HAS_SCREEN

}  // namespace

extern "C" {

// screen: the int8 screen of the lm_head and the hidden rows, as for kvserve_screened_argmax
// (argmax unused; rescored, if set, gets the tiles computed exactly per row). sample: the rows'
// sampling parameters (temperature > 0, no logprobs) and penalties; its logits are a float
// scratch [rows][stride >= ceil(n / 16) * 16] for the approximations, vocab = n; its tokens get
// the drawn token per row, or -1 where the full logits are needed.
int kvserve_screened_sample(const kvserve::ScreenedArgmaxArgs* screen, const kvserve::SamplerArgs* sample) {
#if KVSERVE_HAS_SCREEN
  const kvserve::ScreenedArgmaxArgs& a = *screen;
  const kvserve::SamplerArgs& s = *sample;
  const int64_t tiles = (a.n + kTile - 1) / kTile;
  if (a.n <= 0 || a.k <= 0 || a.k % 4 || a.group <= 0 || a.group % 4 || a.rows <= 0 || a.ldxq < a.k || a.ldx < a.k) return 1;
  if (check_layout(a.bf16_layout, a.k)) return 1;
  const int groups = (a.k + a.group - 1) / a.group;
  if (groups > kMaxGroups || s.rows != a.rows || s.vocab != a.n || s.stride < 2 * tiles * kTile || !s.logits || !s.tokens) return 1;
  for (int64_t r = 0; r < s.rows; ++r) {
    const kvserve::SamplerRow& p = s.params[r];
    if (!(p.temperature > 0.f) || !(p.top_p > 0.f && p.top_p <= 1.f) || !(p.min_p >= 0.f && p.min_p <= 1.f) || p.top_k < 0 ||
        p.num_logprobs >= 0 || p.penalty_begin > p.penalty_end)
      return 2;
    for (int64_t j = p.penalty_begin; j < p.penalty_end; ++j)
      if (!s.penalty_ids || !s.penalty_counts || s.penalty_ids[j] < 0 || s.penalty_ids[j] >= a.n) return 4;
  }
  std::vector<float> tile_max(static_cast<size_t>(s.rows) * tiles);
  screen_all(a, groups, s.logits, s.stride, tiles, tile_max.data());
  // a lone row has the threads to itself; several rows take a thread each
  auto one = [&](int64_t r, bool inner) {
    int64_t rescored = 0;
    s.tokens[r] = ScreenedRow(a, s, r, groups, tile_max.data(), inner).sample(&rescored);
    if (a.rescored) a.rescored[r] = rescored;
  };
  if (s.rows == 1) {
    one(0, true);
  } else {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t r = 0; r < s.rows; ++r) one(r, false);
  }
  return 0;
#else
  (void)screen;
  (void)sample;
  return 2;
#endif
}

}  // extern "C"
