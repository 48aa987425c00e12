// Sampling from full rows of logits, one row per task: repetition / presence / frequency
// penalties, temperature, top-k, min-p, top-p, raw top-N logprobs and the draw, exact, without
// sorting the vocabulary.
//
// After the penalties, s = (logit - max) / T. One pass takes exp(s) of every token and files the
// tokens with s > -16 into bins of 1/8 nat (count and mass); the rest only add to a tail mass
// (on Gemma 3 270M, 0.05-10% of the 262K tokens lie within 16 nats of the top at T = 1). Bins
// are ordered by value, so each filter keeps whole bins above one boundary bin and part of that
// one: only the boundary bin's tokens are gathered (a compare-only pass over a row still in
// cache) and sorted. A boundary that falls below -16 files the tail into deeper bins first (one
// more pass; rare). The draw is Gumbel-max over the kept tokens (gumbel.h): each token's noise
// comes from Philox keyed by the request's seed, the token's position and its id, so a seeded row
// draws the same token whatever it is batched with, and the screened path (screened_sampler.cpp)
// draws the same token without full logits. The torch fallback (torch_sampler.py) follows the
// same definition.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "args.h"
#include "gumbel.h"
#include "simd.h"

namespace {

using namespace kvserve;

constexpr int kBinsPerNat = 8;
constexpr float kBandFloor = -16.f;  // tokens above it are filed by the first pass
constexpr int kBandBins = 16 * kBinsPerNat;
constexpr float kMassFloor = -88.f;  // exp underflows below; such tokens (and -inf, NaN) have no mass
constexpr int kLastBin = 88 * kBinsPerNat;
constexpr int kMaxLogprobs = 20;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Entry {
  float s;
  float mass;
  int64_t id;
};

inline bool before(const Entry& a, const Entry& b) { return a.s > b.s || (a.s == b.s && a.id < b.id); }

// 16 logits starting at v, lanes past the row's end as -inf
inline f32x16 load_logits(const float* row, int64_t v, int64_t vocab) {
  f32x16 x;
  if (v + 16 <= vocab) {
    std::memcpy(&x, row + v, sizeof(x));
  } else {
    for (int i = 0; i < 16; ++i) x[i] = v + i < vocab ? row[v + i] : kNegInf;
  }
  return x;
}

// A place in a bin's order: the tokens before it, and their mass.
struct Cut {
  int group;
  int64_t index;
  double mass;
};

// The tokens of one bin in the order (s descending, id ascending), sorted lazily: they are
// counted into value groups (1/2048 nat each) and a group is sorted only when a walk stops in it,
// so a dense bin (tens of thousands of tokens at a high temperature) costs one counting pass.
class OrderedBin {
 public:
  static constexpr int kGroups = 256;

  // tokens of the bin whose scores lie in (hi - 1/8, hi], in id order
  void build(const std::vector<Entry>& tokens, float hi) {
    hi_ = hi;
    int64_t count[kGroups] = {};
    for (const Entry& e : tokens) ++count[group_of(e.s)];
    begin_[0] = 0;
    for (int g = 0; g < kGroups; ++g) begin_[g + 1] = begin_[g] + count[g];
    entries_.resize(tokens.size());
    int64_t next[kGroups];
    std::memcpy(next, begin_, sizeof(next));
    for (const Entry& e : tokens) entries_[next[group_of(e.s)]++] = e;  // stable: id order within a group
    prefix_[0] = 0.0;
    for (int g = 0; g < kGroups; ++g) {
      double m = 0.0;
      for (int64_t i = begin_[g]; i < begin_[g + 1]; ++i) m += entries_[i].mass;
      prefix_[g + 1] = prefix_[g] + m;
      sorted_[g] = begin_[g + 1] - begin_[g] < 2;
    }
  }

  Cut whole() const { return Cut{kGroups, static_cast<int64_t>(entries_.size()), prefix_[kGroups]}; }
  static Cut none() { return Cut{0, 0, 0.0}; }

  // s of the token at place k (0-based)
  float at(int64_t k) {
    int g = 0;
    while (begin_[g + 1] <= k) ++g;
    sort_group(g);
    return entries_[k].s;
  }

  // the first place whose s is below threshold
  Cut cut_below(float threshold) {
    const int g = group_of(threshold);
    sort_group(g);
    double m = prefix_[g];
    int64_t i = begin_[g];
    while (i < begin_[g + 1] && entries_[i].s >= threshold) m += entries_[i++].mass;
    return Cut{g, i, m};
  }

  // Walks from the bin's start, which has `start` mass before it, up to `limit`: a token stays
  // while the mass before it is below target.
  Cut cut_at_mass(double start, double target, const Cut& limit) {
    for (int g = 0; g < kGroups; ++g) {
      const int64_t end = g < limit.group ? begin_[g + 1] : (g == limit.group ? limit.index : begin_[g]);
      const double c = start + prefix_[g];
      if (c >= target || g > limit.group || (g == limit.group && begin_[g] >= end)) return Cut{g, begin_[g], prefix_[g]};
      if (begin_[g] >= end || (g < limit.group && c + (prefix_[g + 1] - prefix_[g]) < target)) continue;
      sort_group(g);
      double m = prefix_[g];
      int64_t i = begin_[g];
      while (i < end && start + m < target) m += entries_[i++].mass;
      if (i < begin_[g + 1] || g == limit.group) return Cut{g, i, m};
    }
    return limit;
  }

  // every token before `end`, in no particular order
  template <class F>
  void for_each_before(const Cut& end, F&& f) const {
    const int64_t stop = end.group >= kGroups ? static_cast<int64_t>(entries_.size()) : end.index;
    for (int64_t i = 0; i < stop; ++i) f(entries_[i]);
  }

 private:
  int group_of(float s) const {
    const int g = static_cast<int>((hi_ - s) * static_cast<float>(kGroups * kBinsPerNat));
    return std::min(std::max(g, 0), kGroups - 1);
  }

  void sort_group(int g) {
    if (sorted_[g]) return;
    const auto first = entries_.begin() + begin_[g];
    const auto last = entries_.begin() + begin_[g + 1];
    if (!std::is_sorted(first, last, before)) std::sort(first, last, before);
    sorted_[g] = true;
  }

  float hi_ = 0.f;
  std::vector<Entry> entries_;
  int64_t begin_[kGroups + 1] = {};
  double prefix_[kGroups + 1] = {};  // mass of the groups before each
  bool sorted_[kGroups] = {};
};

class RowSampler {
 public:
  RowSampler(const float* row, int64_t vocab, float max, float inv_t, std::vector<Entry>& scratch)
      : row_(row), vocab_(vocab), max_(max), inv_t_(inv_t), scratch_(scratch) {}

  inline f32x16 scores(int64_t v) const { return (load_logits(row_, v, vocab_) - max_) * inv_t_; }

  static inline f32x16 masses(f32x16 s) {
    const f32x16 e = exp16(s);
    return s > kMassFloor ? e : f32x16{};
  }

  // The first pass: every token's mass, the band filed into bins, the rest summed as the tail.
  void file_band() {
    f32x16 tail{};
    for (int64_t v = 0; v < vocab_; v += 16) {
      const f32x16 s = scores(v);
      const f32x16 e = masses(s);
      tail += s > kBandFloor ? f32x16{} : e;
      for (uint32_t band = mask_gt(s, kBandFloor); band; band &= band - 1) {
        const int lane = __builtin_ctz(band);
        const int b = static_cast<int>(-s[lane] * kBinsPerNat);
        ++count_[b];
        mass_[b] += e[lane];
      }
    }
    for (int i = 0; i < 16; ++i) tail_mass_ += tail[i];
  }

  // Files the tail into bins kBandBins .. kLastBin - 1 (once).
  void file_tail() {
    if (tail_filed_) return;
    tail_filed_ = true;
    for (int64_t v = 0; v < vocab_; v += 16) {
      const f32x16 s = scores(v);
      uint32_t deep = mask_gt(s, kMassFloor) & ~mask_gt(s, kBandFloor);
      if (!deep) continue;
      const f32x16 e = masses(s);
      for (; deep; deep &= deep - 1) {
        const int lane = __builtin_ctz(deep);
        const int b = static_cast<int>(-s[lane] * kBinsPerNat);
        ++count_[b];
        mass_[b] += e[lane];
      }
    }
  }

  int64_t count(int b) {
    if (b >= kBandBins) file_tail();
    return count_[b];
  }

  double mass(int b) {
    if (b >= kBandBins) file_tail();
    return mass_[b];
  }

  // Mass of every token: the band's bins and the tail (summed whole until it is filed).
  double total_mass() const {
    double total = tail_filed_ ? 0.0 : tail_mass_;
    for (int b = 0; b < kLastBin; ++b) total += (b < kBandBins || tail_filed_) ? mass_[b] : 0.0;
    return total;
  }

  // The tokens of bin b (scores in (-(b+1)/8, -b/8]) into `out`, ordered.
  void gather(int b, OrderedBin& out) const {
    scratch_.clear();
    const float hi = -static_cast<float>(b) / kBinsPerNat;
    const float lo = -static_cast<float>(b + 1) / kBinsPerNat;
    for (int64_t v = 0; v < vocab_; v += 16) {
      const f32x16 s = scores(v);
      uint32_t inside = mask_gt(s, lo) & ~mask_gt(s, hi);
      if (!inside) continue;
      const f32x16 e = masses(s);
      for (; inside; inside &= inside - 1) {
        const int lane = __builtin_ctz(inside);
        scratch_.push_back(Entry{s[lane], e[lane], v + lane});
      }
    }
    out.build(scratch_, hi);
  }

  // The k-th largest s (ties at it all stay, as torch.topk's threshold keeps them); -inf when k
  // reaches into the tokens without mass.
  float top_k_threshold(int64_t k) {
    int64_t above = 0;
    for (int b = 0; b < kLastBin; ++b) {
      const int64_t c = count(b);
      if (above + c >= k) {
        gather(b, view_);
        return view_.at(k - above - 1);
      }
      above += c;
    }
    return kNegInf;
  }

  // Keeps the tokens with s >= threshold: whole bins above the threshold's bin, part of that one.
  void keep_at_least(float threshold) {
    if (!(threshold > kMassFloor)) return;
    partial_bin_ = static_cast<int>(-threshold * kBinsPerNat);
    gather(partial_bin_, partial_);
    partial_end_ = partial_.cut_below(threshold);
  }

  double kept_mass(int b) {
    if (b < partial_bin_) return mass(b);
    return b == partial_bin_ ? partial_end_.mass : 0.0;
  }

  double kept_total() {
    if (partial_bin_ == kLastBin) return total_mass();
    double total = 0.0;
    for (int b = 0; b <= partial_bin_; ++b) total += kept_mass(b);
    return total;
  }

  // Top-p over the kept tokens in order: a token stays while the mass before it is below
  // top_p times the kept mass.
  void keep_top_p(float top_p) {
    const double target = static_cast<double>(top_p) * kept_total();
    double before_bin = 0.0;
    for (int b = 0; b <= std::min(partial_bin_, kLastBin - 1); ++b) {
      if (before_bin >= target) {
        partial_bin_ = b;
        partial_end_ = OrderedBin::none();
        return;
      }
      const double m = kept_mass(b);
      if (before_bin + m < target) {
        before_bin += m;
        continue;
      }
      if (b != partial_bin_) {
        gather(b, partial_);
        partial_end_ = partial_.whole();
      }
      partial_end_ = partial_.cut_at_mass(before_bin, target, partial_end_);
      partial_bin_ = b;
      return;
    }
  }

  // Gumbel-max over the kept tokens (gumbel.h); -1 only for a row without mass. The top token
  // (always kept) sets the first bar; then a chunk of 64 tokens whose largest uniform cannot lift
  // its best token to the best noisy score so far is passed over on one Philox word.
  int64_t draw(const GumbelKey& key, int64_t top_token) {
    GumbelBest best;
    const float top_s = scores(top_token & ~int64_t{15})[top_token & 15];
    if (top_s > kMassFloor) best.offer(noisy_score(top_s, token_uniform(key, top_token)), top_token);
    if (partial_bin_ < kLastBin)
      partial_.for_each_before(partial_end_, [&](const Entry& e) {
        if (e.mass > 0.f) best.offer(noisy_score(e.s, token_uniform(key, e.id)), e.id);
      });
    // tokens of the bins above the partial one (all tokens with mass when there is none)
    const float whole_above = partial_bin_ < kLastBin ? -static_cast<float>(partial_bin_) / kBinsPerNat : kMassFloor;
    const int64_t chunks = (vocab_ + 63) / 64;
    for (int64_t c0 = 0; c0 < chunks; c0 += 16) {
      const float floor = static_cast<float>(best.score) - kMaxNoise;
      f32x16 top;
      uint32_t any = 0;
      for (int c = 0; c < 16; ++c) {
        top[c] = -INFINITY;
        if (c0 + c >= chunks) continue;
        f32x16 most = f32x16{} - INFINITY;
        for (int j = 0; j < 4; ++j) {
          const f32x16 s = scores((c0 + c) * 64 + 16 * j);
          most = (s > whole_above) & (s > floor) & (s > most) ? s : most;
        }
        top[c] = hmax(most);
        if (top[c] > -INFINITY) any |= 1u << c;
      }
      if (!any) continue;
      u32x16 heads[4];
      chunk_heads16(key, c0, heads);
      for (any &= chunk_may_reach(heads[0], static_cast<float>(best.score) - top); any; any &= any - 1) {
        const int c = __builtin_ctz(any);
        double u[64];
        chunk_uniforms(key, c0 + c, heads[0][c], heads[1][c], u);
        for (int j = 0; j < 4; ++j) {
          const int64_t v = (c0 + c) * 64 + 16 * j;
          const f32x16 s = scores(v);
          for (uint32_t bits = mask_gt(s, whole_above) & mask_gt(s, static_cast<float>(best.score) - kMaxNoise); bits; bits &= bits - 1) {
            const int lane = __builtin_ctz(bits);
            best.offer(noisy_score(s[lane], u[16 * j + lane]), v + lane);
          }
        }
      }
    }
    return best.id;
  }

 private:
  const float* row_;
  int64_t vocab_;
  float max_;
  float inv_t_;
  std::vector<Entry>& scratch_;
  int32_t count_[kLastBin] = {};
  double mass_[kLastBin] = {};
  double tail_mass_ = 0.0;
  bool tail_filed_ = false;
  OrderedBin view_;             // a bin looked at once (a threshold, a draw)
  int partial_bin_ = kLastBin;  // kLastBin: every token with mass is kept
  OrderedBin partial_;          // the bin in which the kept tokens end
  Cut partial_end_{};
};

// The largest logit and the first index holding it; NaN never wins.
inline void row_argmax(const float* row, int64_t vocab, float* max, int64_t* index) {
  f32x16 best;
  i32x16 at{};
  i32x16 lane;
  for (int i = 0; i < 16; ++i) {
    best[i] = kNegInf;
    lane[i] = i;
  }
  for (int64_t v = 0; v < vocab; v += 16) {
    const f32x16 x = load_logits(row, v, vocab);
    const i32x16 better = x > best;
    best = better ? x : best;
    at = better ? lane + static_cast<int32_t>(v) : at;
  }
  const float top = hmax(best);
  int64_t first = 0;
  bool found = false;
  for (int i = 0; i < 16; ++i)
    if (best[i] == top && (!found || at[i] < first)) {
      first = at[i];
      found = true;
    }
  *max = top;
  *index = first;
}

struct TopN {
  int n;
  int have = 0;
  float value[kMaxLogprobs];
  int64_t id[kMaxLogprobs];

  explicit TopN(int n) : n(n) {}

  float floor() const { return have < n ? kNegInf : value[n - 1]; }

  void offer(float v, int64_t i) {
    if (have == n && !(v > value[n - 1])) return;
    int at = have < n ? have++ : n - 1;
    while (at > 0 && v > value[at - 1]) {
      value[at] = value[at - 1];
      id[at] = id[at - 1];
      --at;
    }
    value[at] = v;
    id[at] = i;
  }
};

// log-sum-exp of a row and its top n logits, for logprobs of the raw (unpenalized) logits
inline float raw_logprob_stats(const float* row, int64_t vocab, TopN& top) {
  f32x16 best;
  for (int i = 0; i < 16; ++i) best[i] = kNegInf;
  for (int64_t v = 0; v < vocab; v += 16) {
    const f32x16 x = load_logits(row, v, vocab);
    best = x > best ? x : best;
    if (top.n)
      for (uint32_t bits = mask_gt(x, top.floor()); bits; bits &= bits - 1) {
        const int lane = __builtin_ctz(bits);
        top.offer(x[lane], v + lane);
      }
  }
  const float max = hmax(best);
  if (!std::isfinite(max)) return max;
  f32x16 sum{};
  for (int64_t v = 0; v < vocab; v += 16) sum += RowSampler::masses(load_logits(row, v, vocab) - max);
  double total = 0.0;
  for (int i = 0; i < 16; ++i) total += sum[i];
  return max + static_cast<float>(std::log(total));
}

void apply_penalties(float* row, const SamplerRow& p, const int64_t* ids, const int32_t* counts) {
  for (int64_t j = p.penalty_begin; j < p.penalty_end; ++j) {
    float& x = row[ids[j]];
    if (p.repetition_penalty != 1.f) x = x > 0.f ? x / p.repetition_penalty : x * p.repetition_penalty;
    if (counts[j] > 0) x -= p.frequency_penalty * static_cast<float>(counts[j]) + p.presence_penalty;
  }
}

void sample_row(const SamplerArgs& a, int64_t r, std::vector<Entry>& scratch) {
  const SamplerRow& p = a.params[r];
  float* row = a.logits + r * a.stride;
  const int64_t vocab = a.vocab;
  const bool logprobs = p.num_logprobs >= 0;
  TopN top(logprobs ? std::min(p.num_logprobs, kMaxLogprobs) : 0);
  float lse = 0.f;
  std::vector<float> raw_penalized;
  if (logprobs) {
    lse = raw_logprob_stats(row, vocab, top);
    for (int64_t j = p.penalty_begin; j < p.penalty_end; ++j) raw_penalized.push_back(row[a.penalty_ids[j]]);
  }
  apply_penalties(row, p, a.penalty_ids, a.penalty_counts);

  float max;
  int64_t token;
  row_argmax(row, vocab, &max, &token);
  if (p.temperature > 0.f && std::isfinite(max)) {
    RowSampler sampler(row, vocab, max, 1.f / p.temperature, scratch);
    sampler.file_band();
    float threshold = kNegInf;
    if (p.top_k > 0 && p.top_k < vocab) threshold = sampler.top_k_threshold(p.top_k);
    if (p.min_p > 0.f) threshold = std::max(threshold, static_cast<float>(std::log(static_cast<double>(p.min_p))));
    sampler.keep_at_least(threshold);
    if (p.top_p < 1.f) sampler.keep_top_p(p.top_p);
    const int64_t drawn = sampler.draw(GumbelKey{p.seed, static_cast<uint64_t>(p.position)}, token);
    if (drawn >= 0) token = drawn;
  }

  a.tokens[r] = token;
  if (logprobs) {
    float raw = row[token];
    for (int64_t j = p.penalty_begin; j < p.penalty_end; ++j)
      if (a.penalty_ids[j] == token) raw = raw_penalized[j - p.penalty_begin];
    a.token_logprobs[r] = raw - lse;
    for (int i = 0; i < top.have; ++i) {
      a.top_ids[r * kMaxLogprobs + i] = top.id[i];
      a.top_logprobs[r * kMaxLogprobs + i] = top.value[i] - lse;
    }
  }
}

}  // namespace

extern "C" {

// Each token's uniform for (seed, position), tokens 0 .. n-1: whole chunks as the draw makes
// them, the rest one token at a time (tests compare both with torch_sampler.py).
int kvserve_token_uniforms(uint64_t seed, uint64_t position, int64_t n, double* out) {
  if (n < 0 || (n && !out)) return 1;
  const GumbelKey key{seed, position};
  int64_t v = 0;
  for (; v + 64 <= n; v += 64) {
    u32x16 heads[4];
    chunk_heads16(key, v / 64, heads);
    double u[64];
    chunk_uniforms(key, v / 64, heads[0][0], heads[1][0], u);
    std::memcpy(out + v, u, sizeof(u));
  }
  for (; v < n; ++v) out[v] = token_uniform(key, v);
  return 0;
}

int kvserve_sample(const SamplerArgs* args) {
  const SamplerArgs& a = *args;
  if (a.rows <= 0 || a.vocab <= 0 || a.stride < a.vocab || !a.logits || !a.params || !a.tokens) return 1;
  for (int64_t r = 0; r < a.rows; ++r) {
    const SamplerRow& p = a.params[r];
    if (!(p.temperature >= 0.f) || !(p.top_p > 0.f && p.top_p <= 1.f) || !(p.min_p >= 0.f && p.min_p <= 1.f) ||
        p.top_k < 0 || p.num_logprobs > kMaxLogprobs || p.penalty_begin > p.penalty_end)
      return 2;
    if (p.num_logprobs >= 0 && (!a.token_logprobs || !a.top_ids || !a.top_logprobs)) return 3;
    if (p.penalty_end > p.penalty_begin && (!a.penalty_ids || !a.penalty_counts)) return 3;
    for (int64_t j = p.penalty_begin; j < p.penalty_end; ++j)
      if (a.penalty_ids[j] < 0 || a.penalty_ids[j] >= a.vocab) return 4;
  }
#pragma omp parallel
  {
    std::vector<Entry> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < a.rows; ++r) sample_row(a, r, scratch);
  }
  return 0;
}

}  // extern "C"
