// Every kernel's arguments, declared once. kvserve/kernels/args.py mirrors each struct with
// ctypes; abi.cpp reports each struct's size and field offsets, and a test compares the two
// layouts field by field, so a mismatch fails loudly instead of reading garbage.
//
// Field order keeps every member naturally aligned (8-byte members first), so the layout is the
// same under every compiler the kernels build with.

#pragma once

#include <cstdint>

namespace kvserve {

// Where one layer's K and V live in the paged pool, as the pool lays them out (kv_formats.h
// reads every format). Blocks below first_residual: in `key` / `value`, format `dtype` (0 fp32,
// 1 bf16, 2 fp16, 3 int8, 4 fp8_e4m3, 5 fp8_e5m2, 6 int4, 7 int2). A float block b's token t,
// head h starts at element b * block_stride + t * token_stride + h * head_dim; a quantized
// block is a byte record from b * block_stride, its values token_stride bytes per token, then
// their scales. Blocks from first_residual on: full-precision (residual_dtype) blocks of a KIVI
// cache, block id - first_residual, in residual_key / residual_value. Negative ids: records of
// blocks quantized for reading only (KIVI rows that read a block quantized before the pool has
// quantized it, kvserve/attention/kivi_reads.py), id -1 - j at byte j * block_stride of
// scratch_key / scratch_value.
struct KVView {
  void* key;
  void* value;
  void* residual_key;
  void* residual_value;
  int64_t block_stride;
  int64_t token_stride;
  int64_t residual_block_stride;
  int64_t residual_token_stride;
  int64_t first_residual;
  int32_t dtype;
  int32_t residual_dtype;
  int32_t block_size;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t group_size;   // KIVI: tokens per key-channel scale
  int32_t value_group;  // KIVI: channels per value scale
  int32_t pad_;
  void* scratch_key;  // last, so that a view built without them is a valid prefix
  void* scratch_value;
};

// One query token per sequence (decode).
struct DecodeAttentionArgs {
  void* out;                    // [num_seqs, num_heads, head_dim] in query_dtype
  const void* query;            // [num_seqs, num_heads, head_dim] in query_dtype
  const KVView* kv;
  const int64_t* block_tables;  // [num_seqs, max_blocks]
  const int64_t* kv_lens;       // [num_seqs]: cached slots, the query's own included
  int64_t num_seqs;
  int64_t max_blocks;
  int32_t query_dtype;
  int32_t num_heads;
  int32_t window;  // > 0: only the last `window` slots
  float scale;
};

// One prefill chunk of one sequence: queries at slots kv_start .. kv_start + num_tokens - 1,
// whose K/V are in the pool already; causal.
struct PrefillAttentionArgs {
  void* out;                   // [num_tokens, num_heads, head_dim] in query_dtype
  const void* query;           // [num_tokens, num_heads, head_dim] in query_dtype
  const KVView* kv;
  const int64_t* block_table;  // covers every slot up to kv_start + num_tokens
  int64_t num_blocks;
  int64_t kv_start;
  int64_t num_tokens;
  int32_t query_dtype;
  int32_t num_heads;
  int32_t window;
  float scale;
};

// x @ weight^T in float32 on a weight packed by kvserve_pack_float_weight (float_matmul.cpp)
struct FloatMatmulArgs {
  const void* packed;  // [ceil(n/16)][k][16] in weight_dtype (float32 or bf16)
  const void* x;       // [rows, k] in x_dtype (float32 or bf16), row stride ldx
  void* out;           // [rows, n] in out_dtype, or null
  int64_t* argmax;     // [rows], or null
  int64_t n;
  int64_t ldx;
  int32_t k;
  int32_t rows;
  int32_t weight_dtype;
  int32_t x_dtype;
  int32_t out_dtype;
  int32_t pad_;
};

// x @ weight^T on a weight kept in its GGUF blocks (gguf_matmul.cpp)
struct GgufMatmulArgs {
  const uint8_t* blocks;  // the file's blocks interleaved by 16-row tiles (gguf_matmul.cpp)
  const void* x;          // [rows, k] in x_dtype (float32 or bf16), row stride ldx
  void* out;              // [rows, ldo] in out_dtype (columns 0..n-1 written), or null
  int64_t* argmax;        // [rows], or null
  int64_t n;
  int64_t ldx;
  int64_t ldo;
  int32_t k;
  int32_t rows;
  int32_t type;           // ggml's type code (GGMLQuantizationType)
  int32_t x_dtype;
  int32_t out_dtype;
  int32_t activations;    // 0: exact (float32 products, or bf16 dot products); 1: rows quantized to int8 (gguf_int8.h)
};

// one part of a fused projection for kvserve_gguf_matmul_parts: a weight in GGUF blocks
struct GgufPart {
  const uint8_t* blocks;
  int64_t n;
  int32_t type;
  int32_t pad_;
};

// x @ weight^T on a weight packed by kvserve_pack_bf16_weight (packed_matmul.cpp)
struct PackedMatmulArgs {
  const uint16_t* packed;  // bf16 [ceil(n/16) * 16 * k]
  const uint16_t* x;       // bf16 [rows, k], row stride ldx
  void* out;               // [rows, n] in out_dtype, or null
  int64_t* argmax;         // [rows], or null
  int64_t n;
  int64_t ldx;
  int32_t k;
  int32_t rows;
  int32_t out_dtype;
  int32_t pad_;
};

// x @ weight^T on AMX tiles, on a weight packed by kvserve_amx_pack_weight (amx_matmul.cpp)
struct AmxMatmulArgs {
  const uint16_t* packed;  // bf16 [ceil(n/16)][ceil(k/32)][16][16][2]
  const uint16_t* x;       // bf16 [rows, k], row stride ldx
  void* out;               // [rows, n] in out_dtype (0 float32, 1 bf16), or null
  int64_t* argmax;         // [rows], or null
  int64_t n;
  int64_t ldx;
  int32_t k;
  int32_t rows;
  int32_t out_dtype;
  int32_t pad_;
};

// The int8-screened exact greedy argmax (screened_argmax.cpp)
struct ScreenedArgmaxArgs {
  const uint8_t* qpacked;    // int8 weight, + 128, [tiles][k/4][16][4]
  const float* row_scale;    // [tiles * 16]
  const float* row_error;    // [tiles * 16]
  const float* row_abs_q;    // [tiles][groups][16]
  const uint16_t* bf16_packed;
  const int8_t* xq;          // [rows, k] int8 hidden rows, row stride ldxq
  const float* group_scale;  // [rows][groups]
  const float* group_delta;  // [rows][groups]
  const float* correction;   // [rows]
  const float* x_l1;         // [rows]
  const float* slack;        // [rows]
  const float* tile_bound;   // [rows][tiles]
  const uint16_t* x;         // bf16 [rows, k], row stride ldx
  int64_t* argmax;           // [rows]
  int64_t* rescored;         // [rows]: tiles recomputed exactly
  int64_t n;
  int64_t ldxq;
  int64_t ldx;
  int32_t k;
  int32_t group;
  int32_t rows;
  int32_t bf16_layout;       // bf16_packed is 0: packed_matmul's layout, 1: amx_matmul's B tiles
};

struct RmsNormArgs {
  void* out;            // [rows, dim]
  const void* x;        // rows with stride x_stride
  const float* weight;  // [dim]
  int64_t x_stride;
  int64_t rows;
  int32_t dtype;
  int32_t dim;
  float eps;
  int32_t scale_after_cast;
};

// residual += norm(addend) * addend_weight (or + addend); out = norm(residual) * weight
struct AddRmsNormArgs {
  void* out;                   // [rows, dim], or null without weight
  void* residual;              // [rows, dim], updated in place
  const void* addend;          // [rows, dim]
  const float* addend_weight;  // or null
  const float* weight;         // or null
  int64_t rows;
  int32_t dtype;
  int32_t dim;
  float eps;
  int32_t scale_after_cast;
};

struct QkNormRopeArgs {
  void* q_out;             // [tokens, num_heads, head_dim]
  void* k_out;             // [tokens, num_kv_heads, head_dim]
  const void* qkv;         // [tokens, width], row stride qkv_stride
  const float* q_weight;   // [head_dim], or null
  const float* k_weight;   // [head_dim], or null
  const int64_t* positions;
  const float* cos;        // [positions, head_dim / 2]
  const float* sin;
  int64_t tokens;
  int64_t qkv_stride;
  int32_t dtype;
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  float eps;
  int32_t pad_;
};

struct GatedActivationArgs {
  void* out;            // [rows, inter]
  const void* gate_up;  // [rows, 2 * inter]
  int64_t rows;
  int64_t inter;
  int32_t dtype;
  int32_t activation;   // 0 gelu_tanh, 1 silu
};

// LoRA products of one fused projection for a step's rows (lora.cpp): out[i] += B_s (A_s x[i]) for
// row i's adapter slot s = slots[i] (-1: none), in the activations' dtype. A_s is [rank, k], the
// parts' lora_A stacked; parts[s] = {count, then per part: its rank r, first column c, width w},
// and bt[s] holds each part's B^T [r, w] (scaling folded in) one after the other.
struct LoraArgs {
  void* out;              // [rows, n], row stride out_stride, accumulated
  const void* x;          // [rows, k], row stride x_stride
  int64_t out_stride;
  int64_t x_stride;
  int64_t rows;
  const int32_t* slots;   // [rows]
  const void* const* a;   // [adapters]
  const void* const* bt;  // [adapters]
  const int32_t* const* parts;  // [adapters]
  int32_t adapters;
  int32_t k;
  int32_t n;
  int32_t dtype;          // of x, out, A and B: float32 or bf16
};

struct HadamardArgs {
  void* out[3];           // [tokens, heads[i], dim], token stride out_stride[i], heads packed; may be x[i]
  const void* x[3];       // [tokens, heads[i], dim], token stride x_stride[i], heads packed
  int64_t x_stride[3];
  int64_t out_stride[3];
  int32_t heads[3];
  int32_t count;          // tensors used, <= 3
  int64_t tokens;
  const float* signs;     // [dim], +-1
  float scale;            // 1 / sqrt(dim)
  int32_t dim;
  int32_t dtype;
  int32_t inverse;        // 0: x R, 1: x R^T
};

// SnapKV's window scores (window_scores.cpp), added to out row after row
struct WindowScoresArgs {
  float* out;             // [kv_heads, >= columns], row stride out_stride: the running scores, added to
  const void* q;          // [w, heads, dim], token stride q_stride (elements), heads packed
  const void* keys;       // [length, kv_heads, dim], packed
  int64_t out_stride;
  int64_t q_stride;
  int64_t length;         // keys
  int64_t first_slot;     // query i sees keys 0 .. first_slot + i
  int64_t columns;        // only keys below this are added (a generic question's rows: its prompt's)
  float scale;
  float weight;           // the weight of rows weighted_from.. (the rows before count 1)
  int32_t weighted_from;
  int32_t w;
  int32_t heads;
  int32_t kv_heads;
  int32_t dim;
  int32_t q_dtype;
  int32_t keys_dtype;
};

// Sampling from full logits rows (sampler.cpp): one SamplerRow per row.
struct SamplerRow {
  float temperature;  // 0: greedy (argmax after penalties)
  float top_p;        // 1: off
  float min_p;        // 0: off
  float repetition_penalty;
  float presence_penalty;
  float frequency_penalty;
  int32_t top_k;         // 0: off
  int32_t num_logprobs;  // -1: none; else the raw top-N (N <= 20) and the token's raw logprob
  uint64_t seed;
  int64_t position;       // the sampled token's index in its sequence: the Philox counter
  int64_t penalty_begin;  // this row's entries in penalty_ids / penalty_counts
  int64_t penalty_end;
};

struct SamplerArgs {
  float* logits;  // [rows][stride], modified in place (penalties)
  int64_t stride;
  int64_t vocab;
  int64_t rows;
  const SamplerRow* params;
  const int64_t* penalty_ids;     // tokens seen in the prompt or the output
  const int32_t* penalty_counts;  // their count in the output (0: prompt only)
  int64_t* tokens;                // [rows]
  float* token_logprobs;          // [rows]
  int64_t* top_ids;               // [rows][20]
  float* top_logprobs;            // [rows][20]
};

// kv_store.cpp: tokens' K or V [num_tokens][num_kv_heads][head_dim] (x_dtype 0 fp32, 1 bf16, 2
// fp16; rows x_token_stride elements apart) written into a scaled format's records (format 3 int8,
// 4 fp8_e4m3, 5 fp8_e5m2) at their slots, values then fp16 scales, as KVView describes them.
struct KVStoreArgs {
  const void* x;
  const int64_t* slots;
  uint8_t* records;           // [num_blocks][record_bytes]
  const float* head_scales;   // fp8: calibrated scales [num_kv_heads], or null for each token's own
  const float* center;        // [num_kv_heads][head_dim] subtracted (in float) before quantizing, or null
  int64_t num_tokens;
  int64_t x_token_stride;
  int64_t num_blocks;
  int64_t record_bytes;
  int64_t token_bytes;        // values of one token, every head
  int32_t x_dtype;
  int32_t format;
  int32_t block_size;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t pad_;
};

// decode_program.cpp: a float pool's K/V write, tokens' rows (k_stride / v_stride bytes apart) copied
// into key / value at their slots; the pool holds the activations' dtype, token_bytes per token.
struct KVCopyArgs {
  void* key;
  void* value;
  const void* k;
  const void* v;
  const int64_t* slots;
  int64_t num_tokens;
  int64_t k_stride;
  int64_t v_stride;
  int64_t token_bytes;
  int64_t num_slots;
};

// decode_program.cpp: out[r] += bias for rows of `width` elements `ld` apart (dtype 0 fp32, 1 bf16,
// 2 fp16; the float sum rounded once to dtype, as torch's add).
struct BiasAddArgs {
  void* out;
  const void* bias;
  int64_t rows;
  int64_t width;
  int64_t ld;
  int32_t dtype;
  int32_t pad_;
};

// decode_program.cpp: what changes from one decode step to the next. Every op of a program reads
// its rows, positions and its KV cache group's slots, block tables and lengths from here.
constexpr int kDecodeGroups = 8;
struct DecodeStep {
  const int64_t* positions;                       // [rows]
  const int64_t* slots[kDecodeGroups];            // [rows] per group
  const int64_t* block_tables[kDecodeGroups];     // [rows, max_blocks[g]] per group
  const int64_t* kv_lens[kDecodeGroups];          // [rows] per group
  int64_t max_blocks[kDecodeGroups];
  int64_t rows;
};

// One kernel call of a decode program: `args` is that kernel's argument struct, built once with
// every pointer to the program's buffers and weights; the step's fields are written before the call.
struct DecodeOp {
  void* args;
  const void* parts;  // GGUF products: the GgufPart array
  int32_t kind;       // decode_program.cpp's OpKind
  int32_t group;      // stores and attention: the KV cache group
  int32_t count;      // GGUF products: the number of parts
  int32_t pad_;
};

}  // namespace kvserve
