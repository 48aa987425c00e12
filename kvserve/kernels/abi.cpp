// Sizes and field offsets of the argument structs in args.h, for the layout test against their
// ctypes mirrors (kvserve/kernels/args.py).

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "args.h"

using namespace kvserve;

#define KVSERVE_FIELD(S, f) static_cast<int64_t>(offsetof(S, f))

extern "C" {

// out: sizeof(name), then the offset of each field in declaration order. Returns the count
// written, or -1 for an unknown struct or too little room.
int kvserve_struct_layout(const char* name, int64_t* out, int capacity) {
  if (!std::strcmp(name, "KVView")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(KVView)), KVSERVE_FIELD(KVView, key), KVSERVE_FIELD(KVView, value), KVSERVE_FIELD(KVView, residual_key), KVSERVE_FIELD(KVView, residual_value), KVSERVE_FIELD(KVView, block_stride), KVSERVE_FIELD(KVView, token_stride), KVSERVE_FIELD(KVView, residual_block_stride), KVSERVE_FIELD(KVView, residual_token_stride), KVSERVE_FIELD(KVView, first_residual), KVSERVE_FIELD(KVView, dtype), KVSERVE_FIELD(KVView, residual_dtype), KVSERVE_FIELD(KVView, block_size), KVSERVE_FIELD(KVView, num_kv_heads), KVSERVE_FIELD(KVView, head_dim), KVSERVE_FIELD(KVView, group_size), KVSERVE_FIELD(KVView, value_group), KVSERVE_FIELD(KVView, pad_), KVSERVE_FIELD(KVView, scratch_key), KVSERVE_FIELD(KVView, scratch_value)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "DecodeAttentionArgs")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(DecodeAttentionArgs)), KVSERVE_FIELD(DecodeAttentionArgs, out), KVSERVE_FIELD(DecodeAttentionArgs, query), KVSERVE_FIELD(DecodeAttentionArgs, kv), KVSERVE_FIELD(DecodeAttentionArgs, block_tables), KVSERVE_FIELD(DecodeAttentionArgs, kv_lens), KVSERVE_FIELD(DecodeAttentionArgs, num_seqs), KVSERVE_FIELD(DecodeAttentionArgs, max_blocks), KVSERVE_FIELD(DecodeAttentionArgs, query_dtype), KVSERVE_FIELD(DecodeAttentionArgs, num_heads), KVSERVE_FIELD(DecodeAttentionArgs, window), KVSERVE_FIELD(DecodeAttentionArgs, scale)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "PrefillAttentionArgs")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(PrefillAttentionArgs)), KVSERVE_FIELD(PrefillAttentionArgs, out), KVSERVE_FIELD(PrefillAttentionArgs, query), KVSERVE_FIELD(PrefillAttentionArgs, kv), KVSERVE_FIELD(PrefillAttentionArgs, block_table), KVSERVE_FIELD(PrefillAttentionArgs, num_blocks), KVSERVE_FIELD(PrefillAttentionArgs, kv_start), KVSERVE_FIELD(PrefillAttentionArgs, num_tokens), KVSERVE_FIELD(PrefillAttentionArgs, query_dtype), KVSERVE_FIELD(PrefillAttentionArgs, num_heads), KVSERVE_FIELD(PrefillAttentionArgs, window), KVSERVE_FIELD(PrefillAttentionArgs, scale)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "FloatMatmulArgs")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(FloatMatmulArgs)), KVSERVE_FIELD(FloatMatmulArgs, packed), KVSERVE_FIELD(FloatMatmulArgs, x), KVSERVE_FIELD(FloatMatmulArgs, out), KVSERVE_FIELD(FloatMatmulArgs, argmax), KVSERVE_FIELD(FloatMatmulArgs, n), KVSERVE_FIELD(FloatMatmulArgs, ldx), KVSERVE_FIELD(FloatMatmulArgs, k), KVSERVE_FIELD(FloatMatmulArgs, rows), KVSERVE_FIELD(FloatMatmulArgs, weight_dtype), KVSERVE_FIELD(FloatMatmulArgs, x_dtype), KVSERVE_FIELD(FloatMatmulArgs, out_dtype), KVSERVE_FIELD(FloatMatmulArgs, pad_)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "GgufMatmulArgs")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(GgufMatmulArgs)), KVSERVE_FIELD(GgufMatmulArgs, blocks), KVSERVE_FIELD(GgufMatmulArgs, x), KVSERVE_FIELD(GgufMatmulArgs, out), KVSERVE_FIELD(GgufMatmulArgs, argmax), KVSERVE_FIELD(GgufMatmulArgs, n), KVSERVE_FIELD(GgufMatmulArgs, ldx), KVSERVE_FIELD(GgufMatmulArgs, ldo), KVSERVE_FIELD(GgufMatmulArgs, k), KVSERVE_FIELD(GgufMatmulArgs, rows), KVSERVE_FIELD(GgufMatmulArgs, type), KVSERVE_FIELD(GgufMatmulArgs, x_dtype), KVSERVE_FIELD(GgufMatmulArgs, out_dtype), KVSERVE_FIELD(GgufMatmulArgs, activations)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "PackedMatmulArgs")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(PackedMatmulArgs)), KVSERVE_FIELD(PackedMatmulArgs, packed), KVSERVE_FIELD(PackedMatmulArgs, x), KVSERVE_FIELD(PackedMatmulArgs, out), KVSERVE_FIELD(PackedMatmulArgs, argmax), KVSERVE_FIELD(PackedMatmulArgs, n), KVSERVE_FIELD(PackedMatmulArgs, ldx), KVSERVE_FIELD(PackedMatmulArgs, k), KVSERVE_FIELD(PackedMatmulArgs, rows), KVSERVE_FIELD(PackedMatmulArgs, out_dtype), KVSERVE_FIELD(PackedMatmulArgs, pad_)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "AmxMatmulArgs")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(AmxMatmulArgs)), KVSERVE_FIELD(AmxMatmulArgs, packed), KVSERVE_FIELD(AmxMatmulArgs, x), KVSERVE_FIELD(AmxMatmulArgs, out), KVSERVE_FIELD(AmxMatmulArgs, argmax), KVSERVE_FIELD(AmxMatmulArgs, n), KVSERVE_FIELD(AmxMatmulArgs, ldx), KVSERVE_FIELD(AmxMatmulArgs, k), KVSERVE_FIELD(AmxMatmulArgs, rows), KVSERVE_FIELD(AmxMatmulArgs, out_dtype), KVSERVE_FIELD(AmxMatmulArgs, pad_)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "ScreenedArgmaxArgs")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(ScreenedArgmaxArgs)), KVSERVE_FIELD(ScreenedArgmaxArgs, qpacked), KVSERVE_FIELD(ScreenedArgmaxArgs, row_scale), KVSERVE_FIELD(ScreenedArgmaxArgs, row_error), KVSERVE_FIELD(ScreenedArgmaxArgs, row_abs_q), KVSERVE_FIELD(ScreenedArgmaxArgs, bf16_packed), KVSERVE_FIELD(ScreenedArgmaxArgs, xq), KVSERVE_FIELD(ScreenedArgmaxArgs, group_scale), KVSERVE_FIELD(ScreenedArgmaxArgs, group_delta), KVSERVE_FIELD(ScreenedArgmaxArgs, correction), KVSERVE_FIELD(ScreenedArgmaxArgs, x_l1), KVSERVE_FIELD(ScreenedArgmaxArgs, slack), KVSERVE_FIELD(ScreenedArgmaxArgs, tile_bound), KVSERVE_FIELD(ScreenedArgmaxArgs, x), KVSERVE_FIELD(ScreenedArgmaxArgs, argmax), KVSERVE_FIELD(ScreenedArgmaxArgs, rescored), KVSERVE_FIELD(ScreenedArgmaxArgs, n), KVSERVE_FIELD(ScreenedArgmaxArgs, ldxq), KVSERVE_FIELD(ScreenedArgmaxArgs, ldx), KVSERVE_FIELD(ScreenedArgmaxArgs, k), KVSERVE_FIELD(ScreenedArgmaxArgs, group), KVSERVE_FIELD(ScreenedArgmaxArgs, rows), KVSERVE_FIELD(ScreenedArgmaxArgs, bf16_layout)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "RmsNormArgs")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(RmsNormArgs)), KVSERVE_FIELD(RmsNormArgs, out), KVSERVE_FIELD(RmsNormArgs, x), KVSERVE_FIELD(RmsNormArgs, weight), KVSERVE_FIELD(RmsNormArgs, x_stride), KVSERVE_FIELD(RmsNormArgs, rows), KVSERVE_FIELD(RmsNormArgs, dtype), KVSERVE_FIELD(RmsNormArgs, dim), KVSERVE_FIELD(RmsNormArgs, eps), KVSERVE_FIELD(RmsNormArgs, scale_after_cast)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "AddRmsNormArgs")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(AddRmsNormArgs)), KVSERVE_FIELD(AddRmsNormArgs, out), KVSERVE_FIELD(AddRmsNormArgs, residual), KVSERVE_FIELD(AddRmsNormArgs, addend), KVSERVE_FIELD(AddRmsNormArgs, addend_weight), KVSERVE_FIELD(AddRmsNormArgs, weight), KVSERVE_FIELD(AddRmsNormArgs, rows), KVSERVE_FIELD(AddRmsNormArgs, dtype), KVSERVE_FIELD(AddRmsNormArgs, dim), KVSERVE_FIELD(AddRmsNormArgs, eps), KVSERVE_FIELD(AddRmsNormArgs, scale_after_cast)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "QkNormRopeArgs")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(QkNormRopeArgs)), KVSERVE_FIELD(QkNormRopeArgs, q_out), KVSERVE_FIELD(QkNormRopeArgs, k_out), KVSERVE_FIELD(QkNormRopeArgs, qkv), KVSERVE_FIELD(QkNormRopeArgs, q_weight), KVSERVE_FIELD(QkNormRopeArgs, k_weight), KVSERVE_FIELD(QkNormRopeArgs, positions), KVSERVE_FIELD(QkNormRopeArgs, cos), KVSERVE_FIELD(QkNormRopeArgs, sin), KVSERVE_FIELD(QkNormRopeArgs, tokens), KVSERVE_FIELD(QkNormRopeArgs, qkv_stride), KVSERVE_FIELD(QkNormRopeArgs, dtype), KVSERVE_FIELD(QkNormRopeArgs, num_heads), KVSERVE_FIELD(QkNormRopeArgs, num_kv_heads), KVSERVE_FIELD(QkNormRopeArgs, head_dim), KVSERVE_FIELD(QkNormRopeArgs, eps), KVSERVE_FIELD(QkNormRopeArgs, pad_)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "LoraArgs")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(LoraArgs)), KVSERVE_FIELD(LoraArgs, out), KVSERVE_FIELD(LoraArgs, x), KVSERVE_FIELD(LoraArgs, out_stride), KVSERVE_FIELD(LoraArgs, x_stride), KVSERVE_FIELD(LoraArgs, rows), KVSERVE_FIELD(LoraArgs, slots), KVSERVE_FIELD(LoraArgs, a), KVSERVE_FIELD(LoraArgs, bt), KVSERVE_FIELD(LoraArgs, parts), KVSERVE_FIELD(LoraArgs, adapters), KVSERVE_FIELD(LoraArgs, k), KVSERVE_FIELD(LoraArgs, n), KVSERVE_FIELD(LoraArgs, dtype)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "HadamardArgs")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(HadamardArgs)), KVSERVE_FIELD(HadamardArgs, out), KVSERVE_FIELD(HadamardArgs, x), KVSERVE_FIELD(HadamardArgs, x_stride), KVSERVE_FIELD(HadamardArgs, out_stride), KVSERVE_FIELD(HadamardArgs, heads), KVSERVE_FIELD(HadamardArgs, count), KVSERVE_FIELD(HadamardArgs, tokens), KVSERVE_FIELD(HadamardArgs, signs), KVSERVE_FIELD(HadamardArgs, scale), KVSERVE_FIELD(HadamardArgs, dim), KVSERVE_FIELD(HadamardArgs, dtype), KVSERVE_FIELD(HadamardArgs, inverse)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "WindowScoresArgs")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(WindowScoresArgs)), KVSERVE_FIELD(WindowScoresArgs, out), KVSERVE_FIELD(WindowScoresArgs, q), KVSERVE_FIELD(WindowScoresArgs, keys), KVSERVE_FIELD(WindowScoresArgs, out_stride), KVSERVE_FIELD(WindowScoresArgs, q_stride), KVSERVE_FIELD(WindowScoresArgs, length), KVSERVE_FIELD(WindowScoresArgs, first_slot), KVSERVE_FIELD(WindowScoresArgs, columns), KVSERVE_FIELD(WindowScoresArgs, scale), KVSERVE_FIELD(WindowScoresArgs, weight), KVSERVE_FIELD(WindowScoresArgs, weighted_from), KVSERVE_FIELD(WindowScoresArgs, w), KVSERVE_FIELD(WindowScoresArgs, heads), KVSERVE_FIELD(WindowScoresArgs, kv_heads), KVSERVE_FIELD(WindowScoresArgs, dim), KVSERVE_FIELD(WindowScoresArgs, q_dtype), KVSERVE_FIELD(WindowScoresArgs, keys_dtype)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "GatedActivationArgs")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(GatedActivationArgs)), KVSERVE_FIELD(GatedActivationArgs, out), KVSERVE_FIELD(GatedActivationArgs, gate_up), KVSERVE_FIELD(GatedActivationArgs, rows), KVSERVE_FIELD(GatedActivationArgs, inter), KVSERVE_FIELD(GatedActivationArgs, dtype), KVSERVE_FIELD(GatedActivationArgs, activation)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "SamplerRow")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(SamplerRow)), KVSERVE_FIELD(SamplerRow, temperature), KVSERVE_FIELD(SamplerRow, top_p), KVSERVE_FIELD(SamplerRow, min_p), KVSERVE_FIELD(SamplerRow, repetition_penalty), KVSERVE_FIELD(SamplerRow, presence_penalty), KVSERVE_FIELD(SamplerRow, frequency_penalty), KVSERVE_FIELD(SamplerRow, top_k), KVSERVE_FIELD(SamplerRow, num_logprobs), KVSERVE_FIELD(SamplerRow, seed), KVSERVE_FIELD(SamplerRow, position), KVSERVE_FIELD(SamplerRow, penalty_begin), KVSERVE_FIELD(SamplerRow, penalty_end)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "KVStoreArgs")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(KVStoreArgs)), KVSERVE_FIELD(KVStoreArgs, x), KVSERVE_FIELD(KVStoreArgs, slots), KVSERVE_FIELD(KVStoreArgs, records), KVSERVE_FIELD(KVStoreArgs, head_scales), KVSERVE_FIELD(KVStoreArgs, center), KVSERVE_FIELD(KVStoreArgs, num_tokens), KVSERVE_FIELD(KVStoreArgs, x_token_stride), KVSERVE_FIELD(KVStoreArgs, num_blocks), KVSERVE_FIELD(KVStoreArgs, record_bytes), KVSERVE_FIELD(KVStoreArgs, token_bytes), KVSERVE_FIELD(KVStoreArgs, x_dtype), KVSERVE_FIELD(KVStoreArgs, format), KVSERVE_FIELD(KVStoreArgs, block_size), KVSERVE_FIELD(KVStoreArgs, num_kv_heads), KVSERVE_FIELD(KVStoreArgs, head_dim), KVSERVE_FIELD(KVStoreArgs, pad_)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "SamplerArgs")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(SamplerArgs)), KVSERVE_FIELD(SamplerArgs, logits), KVSERVE_FIELD(SamplerArgs, stride), KVSERVE_FIELD(SamplerArgs, vocab), KVSERVE_FIELD(SamplerArgs, rows), KVSERVE_FIELD(SamplerArgs, params), KVSERVE_FIELD(SamplerArgs, penalty_ids), KVSERVE_FIELD(SamplerArgs, penalty_counts), KVSERVE_FIELD(SamplerArgs, tokens), KVSERVE_FIELD(SamplerArgs, token_logprobs), KVSERVE_FIELD(SamplerArgs, top_ids), KVSERVE_FIELD(SamplerArgs, top_logprobs)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "KVCopyArgs")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(KVCopyArgs)), KVSERVE_FIELD(KVCopyArgs, key), KVSERVE_FIELD(KVCopyArgs, value), KVSERVE_FIELD(KVCopyArgs, k), KVSERVE_FIELD(KVCopyArgs, v), KVSERVE_FIELD(KVCopyArgs, slots), KVSERVE_FIELD(KVCopyArgs, num_tokens), KVSERVE_FIELD(KVCopyArgs, k_stride), KVSERVE_FIELD(KVCopyArgs, v_stride), KVSERVE_FIELD(KVCopyArgs, token_bytes), KVSERVE_FIELD(KVCopyArgs, num_slots)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "DecodeStep")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(DecodeStep)), KVSERVE_FIELD(DecodeStep, positions), KVSERVE_FIELD(DecodeStep, slots), KVSERVE_FIELD(DecodeStep, block_tables), KVSERVE_FIELD(DecodeStep, kv_lens), KVSERVE_FIELD(DecodeStep, max_blocks), KVSERVE_FIELD(DecodeStep, rows)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "DecodeOp")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(DecodeOp)), KVSERVE_FIELD(DecodeOp, args), KVSERVE_FIELD(DecodeOp, parts), KVSERVE_FIELD(DecodeOp, kind), KVSERVE_FIELD(DecodeOp, group), KVSERVE_FIELD(DecodeOp, count), KVSERVE_FIELD(DecodeOp, pad_)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "GgufPart")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(GgufPart)), KVSERVE_FIELD(GgufPart, blocks), KVSERVE_FIELD(GgufPart, n), KVSERVE_FIELD(GgufPart, type), KVSERVE_FIELD(GgufPart, pad_)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  if (!std::strcmp(name, "BiasAddArgs")) {
    const int64_t layout[] = {static_cast<int64_t>(sizeof(BiasAddArgs)), KVSERVE_FIELD(BiasAddArgs, out), KVSERVE_FIELD(BiasAddArgs, bias), KVSERVE_FIELD(BiasAddArgs, rows), KVSERVE_FIELD(BiasAddArgs, width), KVSERVE_FIELD(BiasAddArgs, ld), KVSERVE_FIELD(BiasAddArgs, dtype), KVSERVE_FIELD(BiasAddArgs, pad_)};
    const int n = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
    if (n > capacity) return -1;
    std::memcpy(out, layout, sizeof(layout));
    return n;
  }
  return -1;
}

}  // extern "C"
