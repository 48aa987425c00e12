// The draw of every sampled token, shared by sampler.cpp (full logits) and screened_sampler.cpp
// (an int8 screen of the lm_head): Gumbel-max over the kept tokens,
//   token = argmax over kept i of  s_i + g_i,   g_i = -log(-log(u_i)),
// with s_i the row's scores (float32, as the filters see them), the sum taken in double, ties to the
// lowest id, and u_i a uniform of its own per token from Philox-4x32-10 keyed by the request's
// seed and the token's position: the draw needs no ordering or total mass of the kept tokens (a
// screen that proves which tokens can still win draws exactly the same token), and a seeded row
// draws the same token whatever it is batched with. torch_sampler.py follows the same definition.
//
// Most tokens lie too far below the best noisy score to win, so the uniforms of a chunk of 64
// tokens (chunk c: tokens 64c .. 64c + 63) are made largest first: the chunk's header, Philox
// block (c, 1), gives V = (h0 + 1/2) / 2^32 and a lane h1 & 63; that lane's uniform is
// M = V^(1/64) (the largest of 64 uniforms; six square roots), every other lane's is M * (w + 1/2) / 2^32, w its
// word of block c * 16 + (lane & 15), word lane >> 4 (16 blocks side by side give a whole
// chunk). These are 64 independent uniforms, and a chunk whose M cannot reach the noise its best
// token needs costs one Philox word. g never exceeds -log(1 - M) < 27.1, so a token more than
// kMaxNoise below the best noisy score seen cannot win at all.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace kvserve {

constexpr float kMaxNoise = 28.f;

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

// Philox-4x32-10 of the 16 counters (position, first + b, tag): words[j][b] is word j of block b
inline void philox16(const GumbelKey& key, uint32_t first, uint32_t tag, u32x16 (&words)[4]) {
  u32x16 c0 = u32x16{} + static_cast<uint32_t>(key.position);
  u32x16 c1 = u32x16{} + static_cast<uint32_t>(key.position >> 32);
  u32x16 c2;
  for (int i = 0; i < 16; ++i) c2[i] = first + static_cast<uint32_t>(i);
  u32x16 c3 = u32x16{} + tag;
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

// one Philox-4x32-10 block, scalar
inline void philox(const GumbelKey& key, uint32_t c2, uint32_t c3, uint32_t (&out)[4]) {
  uint32_t c[4] = {static_cast<uint32_t>(key.position), static_cast<uint32_t>(key.position >> 32), c2, c3};
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
  std::memcpy(out, c, sizeof(out));
}

constexpr double kTwoPowMinus32 = 2.3283064365386963e-10;

// V^(1/64) by six square roots: correctly rounded at each step, so every library computes it alike
inline double root64(double v) {
  for (int i = 0; i < 6; ++i) v = std::sqrt(v);
  return v;
}

// The headers of chunks first .. first + 15: heads[0] holds each V's word, heads[1] its lane's.
inline void chunk_heads16(const GumbelKey& key, int64_t first_chunk, u32x16 (&heads)[4]) {
  philox16(key, static_cast<uint32_t>(first_chunk), 1u, heads);
}

// The 64 uniforms of one chunk, in token order, from its header words.
inline void chunk_uniforms(const GumbelKey& key, int64_t chunk, uint32_t v_word, uint32_t lane_word, double (&u)[64]) {
  u32x16 words[4];
  philox16(key, static_cast<uint32_t>(chunk * 16), 0u, words);
  const double largest = root64((static_cast<double>(v_word) + 0.5) * kTwoPowMinus32);
  for (int i = 0; i < 64; ++i) u[i] = largest * ((static_cast<double>(words[i >> 4][i & 15]) + 0.5) * kTwoPowMinus32);
  u[lane_word & 63] = largest;
}

// One token's uniform (the scalar form of chunk_uniforms).
inline double token_uniform(const GumbelKey& key, int64_t id) {
  uint32_t head[4], block[4];
  const int64_t chunk = id >> 6;
  philox(key, static_cast<uint32_t>(chunk), 1u, head);
  const double largest = root64((static_cast<double>(head[0]) + 0.5) * kTwoPowMinus32);
  if ((id & 63) == (head[1] & 63)) return largest;
  philox(key, static_cast<uint32_t>(chunk * 16 + (id & 15)), 0u, block);
  return largest * ((static_cast<double>(block[(id >> 4) & 3]) + 0.5) * kTwoPowMinus32);
}

inline double gumbel_of_uniform(double u) { return -std::log(-std::log(u)); }

// The token's noisy score, exactly as every path computes it.
inline double noisy_score(float s, double u) { return static_cast<double>(s) + gumbel_of_uniform(u); }

// Chunks (16 side by side, their V words) whose largest uniform may give noise of at least
// `need`: g >= need iff -log(u) <= e^-need; with u = V^(1/64), -log(u) = -log(V) / 64, and
// -log(V) >= 1 - V, so a chunk with 1 - V > 64 e^-need cannot qualify: one exp per 16 chunks, 1 - V
// taken exactly from the word, with room for float rounding. Never drops a chunk that qualifies.
inline uint32_t chunk_may_reach(u32x16 v_word, f32x16 need) {
  const f32x16 limit = exp16(1e-3f - need) * (64.f * (1.f + 1e-5f));
  const f32x16 one_minus_v = (__builtin_convertvector(~v_word, f32x16) + 0.5f) * 2.3283064365386963e-10f;
  return mask_gt(limit - one_minus_v, 0.f);
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
