"""ctypes mirrors of the kernels' argument structs (kernels/args.h), each declared once here.

`layout_mismatches()` compares every mirror's size and field offsets with what the compiled
library reports (abi.cpp), so a struct changed on one side only fails loudly.
"""

from __future__ import annotations

import ctypes

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_i32 = ctypes.c_int32
_f32 = ctypes.c_float


class KVView(ctypes.Structure):
    _fields_ = [
        ("key", _p), ("value", _p), ("residual_key", _p), ("residual_value", _p), ("block_stride", _i64), ("token_stride", _i64),
        ("residual_block_stride", _i64), ("residual_token_stride", _i64), ("first_residual", _i64), ("dtype", _i32),
        ("residual_dtype", _i32), ("block_size", _i32), ("num_kv_heads", _i32), ("head_dim", _i32), ("group_size", _i32),
        ("value_group", _i32), ("pad_", _i32), ("scratch_key", _p), ("scratch_value", _p),
    ]  # fmt: skip


class DecodeAttentionArgs(ctypes.Structure):
    _fields_ = [
        ("out", _p), ("query", _p), ("kv", _p), ("block_tables", _p), ("kv_lens", _p), ("num_seqs", _i64), ("max_blocks", _i64),
        ("query_dtype", _i32), ("num_heads", _i32), ("window", _i32), ("scale", _f32),
    ]  # fmt: skip


class PrefillAttentionArgs(ctypes.Structure):
    _fields_ = [
        ("out", _p), ("query", _p), ("kv", _p), ("block_table", _p), ("num_blocks", _i64), ("kv_start", _i64), ("num_tokens", _i64),
        ("query_dtype", _i32), ("num_heads", _i32), ("window", _i32), ("scale", _f32),
    ]  # fmt: skip


class FloatMatmulArgs(ctypes.Structure):
    _fields_ = [
        ("packed", _p), ("x", _p), ("out", _p), ("argmax", _p), ("n", _i64), ("ldx", _i64), ("k", _i32), ("rows", _i32),
        ("weight_dtype", _i32), ("x_dtype", _i32), ("out_dtype", _i32), ("pad_", _i32),
    ]  # fmt: skip


class GgufMatmulArgs(ctypes.Structure):
    _fields_ = [
        ("blocks", _p), ("x", _p), ("out", _p), ("argmax", _p), ("n", _i64), ("ldx", _i64), ("ldo", _i64), ("k", _i32), ("rows", _i32),
        ("type", _i32), ("x_dtype", _i32), ("out_dtype", _i32), ("activations", _i32),
    ]  # fmt: skip


class GgufPart(ctypes.Structure):
    _fields_ = [("blocks", _p), ("n", _i64), ("type", _i32), ("pad_", _i32)]


class PackedMatmulArgs(ctypes.Structure):
    _fields_ = [
        ("packed", _p), ("x", _p), ("out", _p), ("argmax", _p), ("n", _i64), ("ldx", _i64), ("k", _i32), ("rows", _i32),
        ("out_dtype", _i32), ("pad_", _i32),
    ]  # fmt: skip


class AmxMatmulArgs(ctypes.Structure):
    _fields_ = [
        ("packed", _p), ("x", _p), ("out", _p), ("argmax", _p), ("n", _i64), ("ldx", _i64), ("k", _i32), ("rows", _i32),
        ("out_dtype", _i32), ("pad_", _i32),
    ]  # fmt: skip


class ScreenedArgmaxArgs(ctypes.Structure):
    _fields_ = [
        ("qpacked", _p), ("row_scale", _p), ("row_error", _p), ("row_abs_q", _p), ("bf16_packed", _p), ("xq", _p), ("group_scale", _p),
        ("group_delta", _p), ("correction", _p), ("x_l1", _p), ("slack", _p), ("tile_bound", _p), ("x", _p), ("argmax", _p),
        ("rescored", _p), ("n", _i64), ("ldxq", _i64), ("ldx", _i64), ("k", _i32), ("group", _i32), ("rows", _i32),
        ("bf16_layout", _i32),
    ]  # fmt: skip


class RmsNormArgs(ctypes.Structure):
    _fields_ = [
        ("out", _p), ("x", _p), ("weight", _p), ("x_stride", _i64), ("rows", _i64), ("dtype", _i32), ("dim", _i32), ("eps", _f32),
        ("scale_after_cast", _i32),
    ]  # fmt: skip


class AddRmsNormArgs(ctypes.Structure):
    _fields_ = [
        ("out", _p), ("residual", _p), ("addend", _p), ("addend_weight", _p), ("weight", _p), ("rows", _i64), ("dtype", _i32),
        ("dim", _i32), ("eps", _f32), ("scale_after_cast", _i32),
    ]  # fmt: skip


class QkNormRopeArgs(ctypes.Structure):
    _fields_ = [
        ("q_out", _p), ("k_out", _p), ("qkv", _p), ("q_weight", _p), ("k_weight", _p), ("positions", _p), ("cos", _p), ("sin", _p),
        ("tokens", _i64), ("qkv_stride", _i64), ("dtype", _i32), ("num_heads", _i32), ("num_kv_heads", _i32), ("head_dim", _i32),
        ("eps", _f32), ("pad_", _i32),
    ]  # fmt: skip


class LoraArgs(ctypes.Structure):
    _fields_ = [
        ("out", _p), ("x", _p), ("out_stride", _i64), ("x_stride", _i64), ("rows", _i64), ("slots", _p), ("a", _p), ("bt", _p), ("parts", _p),
        ("adapters", _i32), ("k", _i32), ("n", _i32), ("dtype", _i32),
    ]  # fmt: skip


class HadamardArgs(ctypes.Structure):
    _fields_ = [
        ("out", _p * 3), ("x", _p * 3), ("x_stride", _i64 * 3), ("out_stride", _i64 * 3), ("heads", _i32 * 3), ("count", _i32), ("tokens", _i64), ("signs", _p),
        ("scale", _f32), ("dim", _i32), ("dtype", _i32), ("inverse", _i32),
    ]  # fmt: skip


class WindowScoresArgs(ctypes.Structure):
    _fields_ = [
        ("out", _p), ("q", _p), ("keys", _p), ("out_stride", _i64), ("q_stride", _i64), ("length", _i64), ("first_slot", _i64), ("columns", _i64),
        ("scale", _f32), ("weight", _f32), ("weighted_from", _i32), ("w", _i32), ("heads", _i32), ("kv_heads", _i32), ("dim", _i32),
        ("q_dtype", _i32), ("keys_dtype", _i32),
    ]  # fmt: skip


class GatedActivationArgs(ctypes.Structure):
    _fields_ = [("out", _p), ("gate_up", _p), ("rows", _i64), ("inter", _i64), ("dtype", _i32), ("activation", _i32)]


class SamplerRow(ctypes.Structure):
    """One row's sampling parameters."""

    _fields_ = [
        ("temperature", _f32), ("top_p", _f32), ("min_p", _f32), ("repetition_penalty", _f32), ("presence_penalty", _f32),
        ("frequency_penalty", _f32), ("top_k", _i32), ("num_logprobs", _i32), ("seed", ctypes.c_uint64), ("position", _i64),
        ("penalty_begin", _i64), ("penalty_end", _i64),
    ]  # fmt: skip


class SamplerArgs(ctypes.Structure):
    _fields_ = [
        ("logits", _p), ("stride", _i64), ("vocab", _i64), ("rows", _i64), ("params", _p), ("penalty_ids", _p), ("penalty_counts", _p),
        ("tokens", _p), ("token_logprobs", _p), ("top_ids", _p), ("top_logprobs", _p),
    ]  # fmt: skip


class KVStoreArgs(ctypes.Structure):
    _fields_ = [
        ("x", _p), ("slots", _p), ("records", _p), ("head_scales", _p), ("center", _p), ("num_tokens", _i64), ("x_token_stride", _i64), ("num_blocks", _i64),
        ("record_bytes", _i64), ("token_bytes", _i64), ("x_dtype", _i32), ("format", _i32), ("block_size", _i32), ("num_kv_heads", _i32),
        ("head_dim", _i32), ("pad_", _i32),
    ]  # fmt: skip


class KVCopyArgs(ctypes.Structure):
    _fields_ = [
        ("key", _p), ("value", _p), ("k", _p), ("v", _p), ("slots", _p), ("num_tokens", _i64), ("k_stride", _i64), ("v_stride", _i64),
        ("token_bytes", _i64), ("num_slots", _i64),
    ]  # fmt: skip


class BiasAddArgs(ctypes.Structure):
    _fields_ = [("out", _p), ("bias", _p), ("rows", _i64), ("width", _i64), ("ld", _i64), ("dtype", _i32), ("pad_", _i32)]


DECODE_GROUPS = 8


class DecodeStep(ctypes.Structure):
    _fields_ = [
        ("positions", _p), ("slots", _p * DECODE_GROUPS), ("block_tables", _p * DECODE_GROUPS), ("kv_lens", _p * DECODE_GROUPS),
        ("max_blocks", _i64 * DECODE_GROUPS), ("rows", _i64),
    ]  # fmt: skip


class DecodeOp(ctypes.Structure):
    _fields_ = [("args", _p), ("parts", _p), ("kind", _i32), ("group", _i32), ("count", _i32), ("pad_", _i32)]


STRUCTS = (
    KVView, DecodeAttentionArgs, PrefillAttentionArgs, FloatMatmulArgs, GgufMatmulArgs, GgufPart, PackedMatmulArgs, AmxMatmulArgs, ScreenedArgmaxArgs, RmsNormArgs,
    AddRmsNormArgs, QkNormRopeArgs, HadamardArgs, WindowScoresArgs, LoraArgs, GatedActivationArgs, SamplerRow, SamplerArgs, KVStoreArgs, KVCopyArgs, BiasAddArgs, DecodeStep, DecodeOp,
)  # fmt: skip


def layout_mismatches(library: ctypes.CDLL) -> list[str]:
    """Every struct whose size or field offsets differ between this file and the library."""
    problems = []
    for struct in STRUCTS:
        expected = [ctypes.sizeof(struct)] + [getattr(struct, name).offset for name, _ in struct._fields_]
        out = (ctypes.c_int64 * 64)()
        count = library.kvserve_struct_layout(struct.__name__.encode(), out, 64)
        if count < 0 or list(out[:count]) != expected:
            problems.append(f"{struct.__name__}: C {list(out[:max(count, 0)])} vs Python {expected}")
    return problems
