// The draw of every sampled token, shared by sampler.cpp (full logits) and screened_sampler.cpp
// (an int8 screen of the lm_head): Gumbel-max over the kept tokens,
//   token = argmax over kept i of  s_i + g_i,   g_i = -log(-log(u_i)),
// with s_i the row's scores (float32, as the filters see them), the sum taken in double, ties to the
// lowest id. u_i = (x_i + 1/2) / 2^32 from one 32-bit word x_i of Philox-4x32-10 keyed by the
// request's seed, counter (position, block(i), 0): each token has its own noise, so the draw needs
// no ordering or total mass of the kept tokens (a screen that proves which tokens can still win
// draws exactly the same token), and a seeded row draws the same token whatever it is batched
// with. Token i takes word (i >> 4) & 3 of block (i >> 6) * 16 + (i & 15), so that 16 blocks
// computed side by side give 64 consecutive tokens. torch_sampler.py follows the same definition.
//
// g never exceeds -log(-log(1 - 2^-33)) < 22.9, so a token whose score is more than kMaxNoise
// below the best noisy score seen cannot win and needs no noise at all.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace kvserve {

constexpr float kMaxNoise = 23.f;

typedef uint64_t u64x8 __attribute__((vector_size(64)));

struct GumbelKey {
  uint64_t seed;
  uint64_t position;
};

// (a * m) >> 32 per 32-bit lane
inline u32x16 mulhi32(u32x16 a, uint32_t m) {
  u64x8 wide;
  std::memcpy(&wide, &a, sizeof(wide));
  const u64x8 even = (wide & 0xFFFFFFFFull) * static_cast<uint64_t>(m);
  const u64x8 odd = (wide >> 32) * static_cast<uint64_t>(m);
  const u64x8 hi = (even >> 32) | (odd & 0xFFFFFFFF00000000ull);
  u32x16 out;
  std::memcpy(&out, &hi, sizeof(out));
  return out;
}

// Philox-4x32-10 of the 16 blocks first_block .. first_block + 15: words[j][b] is word j of block b
inline void philox16(const GumbelKey& key, uint32_t first_block, u32x16 (&words)[4]) {
  u32x16 c0 = u32x16{} + static_cast<uint32_t>(key.position);
  u32x16 c1 = u32x16{} + static_cast<uint32_t>(key.position >> 32);
  u32x16 c2;
  for (int i = 0; i < 16; ++i) c2[i] = first_block + static_cast<uint32_t>(i);
  u32x16 c3{};
  uint32_t k0 = static_cast<uint32_t>(key.seed), k1 = static_cast<uint32_t>(key.seed >> 32);
  for (int round = 0; round < 10; ++round) {
    if (round) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const u32x16 lo0 = c0 * 0xD2511F53u, hi0 = mulhi32(c0, 0xD2511F53u);
    const u32x16 lo1 = c2 * 0xCD9E8D57u, hi1 = mulhi32(c2, 0xCD9E8D57u);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  words[0] = c0;
  words[1] = c1;
  words[2] = c2;
  words[3] = c3;
}

// The 64 random words of tokens first .. first + 63 (first % 64 == 0), in token order.
inline void token_words64(const GumbelKey& key, int64_t first, u32x16 (&words)[4]) {
  philox16(key, static_cast<uint32_t>((first >> 6) * 16), words);
}

// One token's random word (the scalar form of token_words64).
inline uint32_t token_word(const GumbelKey& key, int64_t id) {
  uint32_t c[4] = {static_cast<uint32_t>(key.position), static_cast<uint32_t>(key.position >> 32),
                   static_cast<uint32_t>((id >> 6) * 16 + (id & 15)), 0};
  uint32_t k[2] = {static_cast<uint32_t>(key.seed), static_cast<uint32_t>(key.seed >> 32)};
  for (int round = 0; round < 10; ++round) {
    if (round) {
      k[0] += 0x9E3779B9u;
      k[1] += 0xBB67AE85u;
    }
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c[0];
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c[2];
    const uint32_t next[4] = {static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k[0], static_cast<uint32_t>(p1),
                              static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k[1], static_cast<uint32_t>(p0)};
    std::memcpy(c, next, sizeof(c));
  }
  return c[(id >> 4) & 3];
}

inline double gumbel_of_word(uint32_t word) {
  const double u = (static_cast<double>(word) + 0.5) * 2.3283064365386963e-10;  // 2^-32
  return -std::log(-std::log(u));
}

// The token's noisy score, exactly as every path computes it.
inline double noisy_score(float s, uint32_t word) { return static_cast<double>(s) + gumbel_of_word(word); }

// Lanes whose word may give noise of at least `need` (per lane). g >= need iff -log(u) <= e^-need,
// and -log(u) >= 1 - u, so a lane with 1 - u > e^-need cannot qualify: one exp per 16 lanes, with
// 1 - u taken exactly from the word, and room for float rounding. Never drops a lane that
// qualifies (it keeps some that do not; the caller checks those in double).
inline uint32_t may_reach(u32x16 word, f32x16 need) {
  const f32x16 limit = exp16(1e-3f - need) * (1.f + 1e-5f);
  const f32x16 one_minus_u = (__builtin_convertvector(~word, f32x16) + 0.5f) * 2.3283064365386963e-10f;
  return mask_gt(limit - one_minus_u, 0.f);
}

// The best (noisy score, id) seen; ties to the lowest id.
struct GumbelBest {
  double score = -INFINITY;
  int64_t id = -1;

  void offer(double value, int64_t token) {
    if (id < 0 || value > score || (value == score && token < id)) {
      score = value;
      id = token;
    }
  }
};

}  // namespace kvserve
