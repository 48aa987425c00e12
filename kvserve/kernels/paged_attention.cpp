// Decode attention straight from the paged KV pool, for CPUs.
//
// One query token per sequence attends to its context through the block table: no gather of the
// sequence's K/V into contiguous memory, no padding to the batch's longest context, and sliding-
// window layers read only their window. Each (sequence, kv head) pair is one task; a task loads
// its group of query heads once, scores every visible key, takes the softmax in float32 and
// accumulates the values. Memory traffic is one read of each visible K and V row.
//
// Built by kvserve/kernels/build.py with -O3 -march=native -fopenmp and called through ctypes;
// the OpenMP runtime is the one torch already loaded (same soname), so threads are shared.
//
// The paths are headers this file includes into its one translation unit (as gguf_matmul.cpp does
// gguf_dot.h), so the compiler sees them as before: attention_common.h (what they share),
// attention_rows.h (a row at a time in float: any layout, KIVI records), attention_tiles.h (a tile
// of query rows; float queries), attention_bf16.h (bf16 tiles on AVX512-BF16), attention_amx.h
// (bf16 tiles on AMX), attention_amx_int8.h (int8 K/V on AMX, attention_int8.h's bits),
// attention_kivi_bf16.h (KIVI records, bf16 queries). Here: which path each
// row takes, long contexts split and merged, and the entry points for decode and prefill.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "args.h"
#include "kv_formats.h"
#include "simd.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KVSERVE_DECODE_BF16_DOT 1
#else
#define KVSERVE_DECODE_BF16_DOT 0
#endif

#if KVSERVE_DECODE_BF16_DOT && KVSERVE_AMX_SUPPORTED && !defined(KVSERVE_AMX_EMULATE)
#define KVSERVE_ATTENTION_AMX 1
#include <cpuid.h>
#else
#define KVSERVE_ATTENTION_AMX 0
#endif

extern "C" int kvserve_amx_available();

namespace {

using namespace kvserve;

#include "attention_common.h"
#include "attention_rows.h"
#include "attention_tiles.h"
#include "attention_int8.h"
#include "attention_bf16.h"
#include "attention_amx.h"
#include "attention_amx_int8.h"
#include "attention_kivi_bf16.h"

inline bool plain_float_view(const KVView& kv) { return is_float_format(kv.dtype) && kv.first_residual >= (int64_t{1} << 62); }

// Which context each query row attends to. A decode batch's rows are sequences, each with its own
// block table and length; a prefill chunk's rows are consecutive tokens of one sequence, sharing
// its table, the row r seeing first_len + r slots. Both run the same code per row below, so a
// token's attention has the same bits whether it was decoded, prefilled in any chunk, or recomputed
// after a prefix hit or a preemption.
struct QueryRows {
  int64_t count;
  const int64_t* tables;  // count tables of max_blocks entries, or one shared table (table_stride 0)
  int64_t table_stride;
  int64_t max_blocks;
  const int64_t* kv_lens;  // per row, or null: row r's context is first_len + r
  int64_t first_len;
  int64_t context(int64_t r) const { return kv_lens ? kv_lens[r] : first_len + r; }
  const int64_t* table(int64_t r) const { return tables + r * table_stride; }
};

// Each query row attends to slots max(0, len - window) .. len - 1 of its context. A task is one
// row's KV head (its group of query heads). A context of at least 2 * kSplitTokens slots is split
// at the multiples of kSplitTokens into parts that threads compute apart (flash-decoding: one long
// sequence, a model with one KV head, keep every thread busy); each part's output and log-sum-exp
// are merged after. The parts depend on the row's own context alone, never on the other rows or
// the thread count.
int attend_rows(const QueryRows& rows, const KVView& kv, void* out, const void* query, int query_dtype, int num_heads, int window,
                float scale, int max_tile_tokens) {
  constexpr int64_t kSplitTokens = 512;
  const int num_kv_heads = kv.num_kv_heads, head_dim = kv.head_dim;
  const int kv_dtype = kv.dtype;
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || kv.block_size <= 0 || kv_dtype < 0 || kv_dtype > 7 ||
      head_dim > 512) return 1;
  const int group = num_heads / num_kv_heads;
  const bool plain = plain_float_view(kv);
  bool bf16_tiles = false;
#if KVSERVE_DECODE_BF16_DOT
  bf16_tiles = query_dtype == kBFloat16 && ((kv_dtype == kBFloat16 && plain) || is_scaled_format(kv_dtype)) && head_dim % 32 == 0;
#endif
  const bool float_tiles = !bf16_tiles && (plain || is_scaled_format(kv_dtype)) && head_dim % 16 == 0;
  int tile_tokens = bf16_tiles || float_tiles ? std::max(1, max_tile_tokens) : 1;
  bool amx_tiles = false;
#if KVSERVE_ATTENTION_AMX
  amx_tiles = bf16_tiles && kv_dtype == kBFloat16 && kv.block_size % 16 == 0 && group <= kAmxTileRowsMax && attention_amx_enabled();
  if (amx_tiles) tile_tokens = std::min(tile_tokens, kAmxTileRowsMax / group);
#endif
  bool amx_int8_tiles = false;
#if KVSERVE_ATTENTION_AMX_INT8
  amx_int8_tiles = bf16_tiles && kv_dtype == kInt8 && amx_int8_layout(kv) && group <= kAmxTileRowsMax && attention_amx_int8_enabled();
  if (amx_int8_tiles) tile_tokens = std::min(tile_tokens, kAmxTileRowsMax / group);
#endif

  // each token's visible slots [first, context); one of at least 2 * kSplitTokens is split at the
  // multiples of kSplitTokens into parts (q0 .. q1), merged after by log-sum-exp
  struct Span {
    int64_t first, context;
    bool split() const { return context - first >= 2 * kSplitTokens; }
    int64_t q0() const { return split() ? first / kSplitTokens : -1; }
    int64_t q1() const { return split() ? (context - 1) / kSplitTokens : -1; }
    int parts() const { return split() ? static_cast<int>(q1() - q0() + 1) : 1; }
    int64_t part_first(int p) const { return split() ? std::max(first, (q0() + p) * kSplitTokens) : first; }
    int64_t part_end(int p) const { return split() ? std::min(context, (q0() + p + 1) * kSplitTokens) : context; }
  };
  std::vector<Span> spans(static_cast<size_t>(rows.count));
  for (int64_t t = 0; t < rows.count; ++t) {
    const int64_t context = rows.context(t);
    spans[t] = {window > 0 ? std::max<int64_t>(0, context - window) : 0, context};
    if (context <= 0 || (context + kv.block_size - 1) / kv.block_size > rows.max_blocks) return 2;
  }
  // tiles: runs of up to tile_tokens consecutive tokens whose contexts split alike
  struct Work {
    int64_t token;
    int tokens, kv_head, part;
  };
  std::vector<Work> work;
  std::vector<int64_t> part_base(static_cast<size_t>(rows.count), -1);
  int64_t split_parts = 0;
  for (int64_t t = 0; t < rows.count;) {
    int tokens = 1;
    while (tokens < tile_tokens && t + tokens < rows.count && spans[t + tokens].split() == spans[t].split() &&
           spans[t + tokens].q0() == spans[t].q0() && spans[t + tokens].q1() == spans[t].q1())
      ++tokens;
    const int parts = spans[t].parts();
    if (parts > 1)
      for (int i = 0; i < tokens; ++i, split_parts += parts) part_base[t + i] = split_parts;
    for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head)
      for (int p = 0; p < parts; ++p) work.push_back({t, tokens, kv_head, p});
    t += tokens;
  }
  // split tokens' parts: outputs [part][kv head][group][head_dim], log-sum-exps [part][kv head][group]
  const int64_t part_rows = static_cast<int64_t>(num_kv_heads) * group;
  std::vector<float> part_out(static_cast<size_t>(split_parts * part_rows * head_dim)), part_lse(static_cast<size_t>(split_parts * part_rows));
  auto query_offset = [&](int64_t token, int kv_head) { return (token * num_heads + kv_head * group) * head_dim; };
  auto store_rows = [&](int64_t token, int kv_head, const float* values) {
    for (int g = 0; g < group; ++g)
      store_row(out, query_dtype, query_offset(token, kv_head) + g * head_dim, head_dim, values + static_cast<size_t>(g) * head_dim, 1.f);
  };

#pragma omp parallel
  {
    TileScratch scratch;
    std::vector<float> queries, result, lse, row(head_dim);
    std::vector<uint16_t> queries_bf16;
    std::vector<int64_t> firsts, ends;

    // one tile's rows (tokens x group), for the part p of each token: result and lse [rows]
    auto attend = [&](const Work& w) {
      const int count = w.tokens * group;
      const int64_t* table = rows.table(w.token);
      firsts.resize(count);
      ends.resize(count);
      for (int i = 0; i < w.tokens; ++i)
        for (int g = 0; g < group; ++g) {
          firsts[i * group + g] = spans[w.token + i].part_first(w.part);
          ends[i * group + g] = spans[w.token + i].part_end(w.part);
        }
      const TileRows tile{count, firsts.data(), ends.data()};
      result.resize(static_cast<size_t>(count) * head_dim);
      lse.resize(count);
#if KVSERVE_DECODE_BF16_DOT
      if (bf16_tiles) {
        queries_bf16.resize(static_cast<size_t>(count) * head_dim);
        for (int i = 0; i < w.tokens; ++i)
          std::memcpy(queries_bf16.data() + static_cast<size_t>(i) * group * head_dim,
                      static_cast<const uint16_t*>(query) + query_offset(w.token + i, w.kv_head), sizeof(uint16_t) * group * head_dim);
#if KVSERVE_ATTENTION_AMX
        if (amx_tiles) {
          attend_tile_amx(result.data(), lse.data(), queries_bf16.data(), tile, kv, table, w.kv_head, scale, scratch);
          return;
        }
#endif
#if KVSERVE_ATTENTION_AMX_INT8
        if (amx_int8_tiles) {
          attend_tile_amx_int8(result.data(), lse.data(), queries_bf16.data(), tile, kv, table, w.kv_head, scale, scratch);
          return;
        }
#endif
        with_kv_dtype(kv_dtype, [&](auto dtype) {
          constexpr int DT = decltype(dtype)::value;
          if constexpr (DT == kBFloat16 || DT == kInt8 || DT == kFp8E4m3 || DT == kFp8E5m2)
            attend_tile_bf16<DT>(result.data(), lse.data(), queries_bf16.data(), tile, kv, table, w.kv_head, scale, scratch);
          return true;
        });
        return;
      }
#endif
      queries.resize(static_cast<size_t>(count) * head_dim);
      for (int i = 0; i < w.tokens; ++i)
        load_row(query, query_dtype, query_offset(w.token + i, w.kv_head), group * head_dim, queries.data() + static_cast<size_t>(i) * group * head_dim);
      if (float_tiles) {
        with_kv_dtype(kv_dtype, [&](auto dtype) {
          attend_tile_float<decltype(dtype)::value>(result.data(), lse.data(), queries.data(), tile, kv, table, w.kv_head, scale, scratch);
          return true;
        });
        return;
      }
      // one token (tile_tokens is 1 here): KIVI records take their own loops, any other shape a row at a time
      const int64_t first = firsts[0], count_slots = ends[0] - firsts[0];
#if KVSERVE_DECODE_BF16_DOT
      if (query_dtype == kBFloat16 && (kv_dtype == kInt4 || kv_dtype == kInt2)) {
        const uint16_t* group_queries = static_cast<const uint16_t*>(query) + query_offset(w.token, w.kv_head);
        if (decode_task_kivi_bf16_dispatch(group, group_queries, result.data(), kv, table, first, count_slots, w.kv_head, scale,
                                           scratch.scores, scratch.probs, scratch.acc, lse.data()))
          return;
      }
#endif
      if (decode_task_kivi_dispatch(group, result.data(), queries.data(), kv, table, first, count_slots, w.kv_head, scale, scratch.scores,
                                    scratch.acc, lse.data()))
        return;
      decode_task_rows(result.data(), queries.data(), group, kv, table, first, count_slots, w.kv_head, scale, scratch.scores, scratch.acc,
                       row, lse.data());
    };

#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < static_cast<int64_t>(work.size()); ++i) {
      const Work& w = work[i];
      attend(w);
      for (int t = 0; t < w.tokens; ++t) {
        const float* values = result.data() + static_cast<size_t>(t) * group * head_dim;
        if (part_base[w.token + t] < 0) {
          store_rows(w.token + t, w.kv_head, values);
          continue;
        }
        const int64_t at = (part_base[w.token + t] + w.part) * part_rows + static_cast<int64_t>(w.kv_head) * group;
        std::memcpy(part_out.data() + at * head_dim, values, sizeof(float) * group * head_dim);
        std::memcpy(part_lse.data() + at, lse.data() + t * group, sizeof(float) * group);
      }
    }

    // merge: out = sum over parts of exp(lse_p - total) * out_p, total the log of the whole sum
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < rows.count * num_kv_heads; ++task) {
      const int64_t token = task / num_kv_heads;
      const int kv_head = static_cast<int>(task % num_kv_heads);
      if (part_base[token] < 0) continue;
      const int parts = spans[token].parts();
      auto at = [&](int p, int g) { return (part_base[token] + p) * part_rows + static_cast<int64_t>(kv_head) * group + g; };
      result.resize(static_cast<size_t>(group) * head_dim);
      for (int g = 0; g < group; ++g) {
        float peak = -INFINITY;
        for (int p = 0; p < parts; ++p) peak = std::max(peak, part_lse[at(p, g)]);
        float total = 0.f;
        for (int p = 0; p < parts; ++p) total += std::exp(part_lse[at(p, g)] - peak);
        float* merged = result.data() + static_cast<size_t>(g) * head_dim;
        std::fill(merged, merged + head_dim, 0.f);
        for (int p = 0; p < parts; ++p) {
          const float weight = std::exp(part_lse[at(p, g)] - peak) / total;
          const float* values = part_out.data() + at(p, g) * head_dim;
          for (int d = 0; d < head_dim; ++d) merged[d] += weight * values[d];
        }
      }
      store_rows(token, kv_head, result.data());
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// 0: bf16 and int8 attention leave AMX tiles for the AVX512 paths (the engine's AMX self-check
// failed); 1: back to the default. Returns whether AMX attention is on now.
int kvserve_set_attention_amx(int on) {
#if KVSERVE_ATTENTION_AMX
  g_attention_amx = -1;
  if (!on) g_attention_amx = 0;
  return attention_amx_enabled() ? 1 : 0;
#else
  (void)on;
  return 0;
#endif
}

// 1 where int8 K/V take AMX tiles now (attention_amx_int8.h: the build has them, the CPU has
// AMX-INT8 and AMX attention is on), for the layouts amx_int8_layout accepts
int kvserve_attention_amx_int8() {
#if KVSERVE_ATTENTION_AMX_INT8
  return attention_amx_int8_enabled() ? 1 : 0;
#else
  return 0;
#endif
}

// Decode: see DecodeAttentionArgs.
int kvserve_paged_decode_attention(const DecodeAttentionArgs* args) {
  const DecodeAttentionArgs& a = *args;
  const QueryRows rows{a.num_seqs, a.block_tables, a.max_blocks, a.max_blocks, a.kv_lens, 0};
  return attend_rows(rows, *a.kv, a.out, a.query, a.query_dtype, a.num_heads, a.window, a.scale, 1);
}

// One prefill chunk of one sequence (see PrefillAttentionArgs): each token attends exactly as it
// would decode, in batches of kPrefillRows tokens (which bounds the split contexts' part buffers).
int kvserve_paged_prefill_attention(const PrefillAttentionArgs* args) {
  constexpr int64_t kPrefillRows = 256;
  constexpr int kTileRows = 64;  // query rows (tokens x group) that share each key and value load
  const PrefillAttentionArgs& a = *args;
  const KVView& kv = *a.kv;
  if (a.num_tokens <= 0 || a.kv_start < 0 || a.num_heads <= 0 || kv.num_kv_heads <= 0 || a.query_dtype < 0 || a.query_dtype > 2 || kv.block_size <= 0) return 1;
  if ((a.kv_start + a.num_tokens + kv.block_size - 1) / kv.block_size > a.num_blocks) return 2;
  const int64_t row_bytes = static_cast<int64_t>(a.num_heads) * kv.head_dim * (a.query_dtype == kFloat32 ? 4 : 2);
  for (int64_t start = 0; start < a.num_tokens; start += kPrefillRows) {
    const QueryRows rows{std::min(kPrefillRows, a.num_tokens - start), a.block_table, 0, a.num_blocks, nullptr, a.kv_start + start + 1};
    const int status = attend_rows(rows, kv, static_cast<char*>(a.out) + start * row_bytes,
                                   static_cast<const char*>(a.query) + start * row_bytes, a.query_dtype, a.num_heads, a.window, a.scale, kTileRows * kv.num_kv_heads / a.num_heads);
    if (status) return status;
  }
  return 0;
}

}  // extern "C"