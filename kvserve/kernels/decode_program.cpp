// A decode step's layers as one call: the ops (products, norms, K/V stores, attention) run in
// order, each the same kernel entry the per-op Python path calls, with argument structs built
// once per program. Only the step's fields (rows, positions, slots, block tables, KV lengths)
// are written before each call, so a step's bits are those of the per-op path, at one ctypes
// call for all layers instead of ~10 per layer.

#include <cstdint>
#include <cstring>

#include "args.h"
#include "simd.h"

using namespace kvserve;  // args.h's structs, simd.h's Elem and dtype codes

extern "C" {
int kvserve_gguf_matmul_parts(const GgufMatmulArgs* a, const GgufPart* parts, int count);
int kvserve_amx_matmul(const AmxMatmulArgs* a);
int kvserve_packed_matmul(const PackedMatmulArgs* a);
int kvserve_float_matmul(const FloatMatmulArgs* a);
int kvserve_qk_norm_rope(const QkNormRopeArgs* args);
int kvserve_kv_store(const KVStoreArgs* args);
int kvserve_paged_decode_attention(const DecodeAttentionArgs* args);
int kvserve_add_rms_norm(const AddRmsNormArgs* args);
int kvserve_gated_activation(const GatedActivationArgs* args);
int kvserve_hadamard(const HadamardArgs* args);
int kvserve_lora(const LoraArgs* args);
}

namespace {

// kvserve/kernels/program.py's OP_KINDS
enum OpKind : int32_t {
  kGgufProduct = 0,
  kAmxProduct = 1,
  kPackedProduct = 2,
  kFloatProduct = 3,
  kQkNormRope = 4,
  kKVCopy = 5,
  kKVStore = 6,
  kDecodeAttention = 7,
  kAddRmsNorm = 8,
  kGatedActivation = 9,
  kHadamard = 10,
  kBiasAdd = 11,
  kLora = 12,
};

int copy_kv(const KVCopyArgs& a) {
  for (int64_t t = 0; t < a.num_tokens; ++t)
    if (a.slots[t] < 0 || a.slots[t] >= a.num_slots) return 1;
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const int64_t at = a.slots[t] * a.token_bytes;
    std::memcpy(static_cast<char*>(a.key) + at, static_cast<const char*>(a.k) + t * a.k_stride, a.token_bytes);
    std::memcpy(static_cast<char*>(a.value) + at, static_cast<const char*>(a.v) + t * a.v_stride, a.token_bytes);
  }
  return 0;
}

template <int DT>
void add_bias(const BiasAddArgs& a) {
  using E = Elem<DT>;
  auto* out = static_cast<typename E::type*>(a.out);
  const auto* bias = static_cast<const typename E::type*>(a.bias);
  for (int64_t r = 0; r < a.rows; ++r)
    for (int64_t j = 0; j < a.width; ++j) out[r * a.ld + j] = E::store(E::load(out[r * a.ld + j]) + E::load(bias[j]));
}

// the kernels whose step fields are their row count alone: write it, then call
template <typename Args>
int with_rows(const DecodeOp& op, int64_t rows, int (*kernel)(const Args*)) {
  auto& a = *static_cast<Args*>(op.args);
  a.rows = static_cast<decltype(a.rows)>(rows);
  return kernel(&a);
}

int run_op(const DecodeOp& op, const DecodeStep& step) {
  const int64_t rows = step.rows;
  if (op.group < 0 || op.group >= kDecodeGroups) return 1;
  const int g = op.group;
  switch (op.kind) {
    case kGgufProduct: {
      auto& a = *static_cast<GgufMatmulArgs*>(op.args);
      a.rows = static_cast<int32_t>(rows);
      return kvserve_gguf_matmul_parts(&a, static_cast<const GgufPart*>(op.parts), op.count);
    }
    case kAmxProduct:
      return with_rows(op, rows, kvserve_amx_matmul);
    case kPackedProduct:
      return with_rows(op, rows, kvserve_packed_matmul);
    case kFloatProduct:
      return with_rows(op, rows, kvserve_float_matmul);
    case kQkNormRope: {
      auto& a = *static_cast<QkNormRopeArgs*>(op.args);
      a.tokens = rows;
      a.positions = step.positions;
      return kvserve_qk_norm_rope(&a);
    }
    case kKVCopy: {
      auto& a = *static_cast<KVCopyArgs*>(op.args);
      a.num_tokens = rows;
      a.slots = step.slots[g];
      return copy_kv(a);
    }
    case kKVStore: {
      auto& a = *static_cast<KVStoreArgs*>(op.args);
      a.num_tokens = rows;
      a.slots = step.slots[g];
      return kvserve_kv_store(&a);
    }
    case kDecodeAttention: {
      auto& a = *static_cast<DecodeAttentionArgs*>(op.args);
      a.num_seqs = rows;
      a.block_tables = step.block_tables[g];
      a.kv_lens = step.kv_lens[g];
      a.max_blocks = step.max_blocks[g];
      return kvserve_paged_decode_attention(&a);
    }
    case kAddRmsNorm:
      return with_rows(op, rows, kvserve_add_rms_norm);
    case kGatedActivation:
      return with_rows(op, rows, kvserve_gated_activation);
    case kHadamard: {
      auto& a = *static_cast<HadamardArgs*>(op.args);
      a.tokens = rows;
      return kvserve_hadamard(&a);
    }
    case kLora: {
      auto& a = *static_cast<LoraArgs*>(op.args);
      a.rows = rows;
      return a.adapters == 0 ? 0 : kvserve_lora(&a);
    }
    case kBiasAdd: {
      auto& a = *static_cast<BiasAddArgs*>(op.args);
      a.rows = rows;
      if (a.width <= 0 || a.ld < a.width) return 1;
      switch (a.dtype) {
        case kFloat32: add_bias<kFloat32>(a); return 0;
        case kBFloat16: add_bias<kBFloat16>(a); return 0;
        case kFloat16: add_bias<kFloat16>(a); return 0;
        default: return 1;
      }
    }
    default:
      return 1;
  }
}

}  // namespace

extern "C" {

// Runs ops[0 .. count) for this step. Returns 0, or the failing op's status with its index in
// *failed (the ops after it do not run).
int kvserve_decode_program_run(const DecodeOp* ops, int64_t count, const DecodeStep* step, int64_t* failed) {
  if (step->rows <= 0) return 1;
  for (int64_t i = 0; i < count; ++i) {
    const int status = run_op(ops[i], *step);
    if (status) {
      *failed = i;
      return status;
    }
  }
  return 0;
}

}  // extern "C"
