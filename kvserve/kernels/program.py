"""A decode step's kernel calls recorded once and replayed in one call (decode_program.cpp).

Each op is the argument struct of a kernel the per-op wrappers (kernels/attention.py, products.py,
fused.py, ...) call, built once over fixed buffers [capacity, width]; a step writes only its rows,
positions and each KV cache group's slots, block tables and lengths. The kernels are the same, so
are the bits; what goes is the Python around ~10 kernel calls per layer (about 1 ms of a one-row
Gemma 3 270M step).
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.kernels import args
from kvserve.kernels.fused import ACTIVATIONS, _float_weight
from kvserve.kernels.gguf import GgufProduct
from kvserve.kernels.hadamard import Hadamard
from kvserve.kernels.kv_formats import KV_FORMAT_CODES, SCALED_KV_FORMATS
from kvserve.kernels.library import _DTYPE_CODES, _require
from kvserve.kernels.products import AmxWeight, FloatPackedWeight, PackedWeight

OP_KINDS = {
    "gguf": 0, "amx": 1, "packed": 2, "float": 3, "qk_norm_rope": 4, "kv_copy": 5, "kv_store": 6, "decode_attention": 7,
    "add_rms_norm": 8, "gated_activation": 9, "hadamard": 10, "bias_add": 11, "lora": 12,
}  # fmt: skip
Product = GgufProduct | AmxWeight | PackedWeight | FloatPackedWeight


class DecodeProgram:
    """Ops appended in execution order over buffers whose first dimension is `capacity` rows; then
    run(...) once per step with that step's rows (at most `capacity`). The program keeps every
    tensor and struct its ops point into alive. One step at a time (the engine's loop)."""

    def __init__(self, capacity: int) -> None:
        self._library = _require()
        self.capacity = capacity
        self._ops: list[tuple[ctypes.Structure, int, int, int, int]] = []  # (args, parts address, kind, group, part count)
        self._keep: list[object] = []
        self._table: ctypes.Array | None = None
        self._step = args.DecodeStep()
        self._failed = ctypes.c_int64(-1)
        self.groups = 0

    def _buffer(self, tensor: torch.Tensor, width: int, dtype: torch.dtype | None = None) -> int:
        """The address of a [capacity, width] contiguous CPU buffer (checked), kept alive."""
        if tensor.dim() != 2 or tuple(tensor.shape) != (self.capacity, width) or not tensor.is_contiguous() or not tensor.is_cpu:
            raise ValueError(f"decode program: buffers are contiguous CPU [{self.capacity}, {width}], got {tuple(tensor.shape)}")
        if dtype is not None and tensor.dtype != dtype:
            raise ValueError(f"decode program: a {dtype} buffer was expected, got {tensor.dtype}")
        self._keep.append(tensor)
        return tensor.data_ptr()

    def _add(self, call: ctypes.Structure, kind: str, group: int = 0, parts: int = 0, count: int = 0) -> None:
        if self._table is not None:
            raise RuntimeError("decode program: finished; no more ops")
        self._keep.append(call)
        self._ops.append((call, parts, OP_KINDS[kind], group, count))

    def product(self, weight: Product, x: torch.Tensor, out: torch.Tensor) -> None:
        """out = x @ W^T on the kernel that holds W, in x's dtype (as Linear's native product)."""
        dtype = _DTYPE_CODES[x.dtype]
        x_ptr = self._buffer(x, weight.k)
        out_ptr = self._buffer(out, weight.n, x.dtype)
        self._keep.append(weight)
        if isinstance(weight, GgufProduct):
            call = args.GgufMatmulArgs(None, x_ptr, out_ptr, None, weight.n, weight.k, weight.n, weight.k, 0, 0, dtype, dtype,
                                      weight.parts[0].activations_code)  # fmt: skip
            self._add(call, "gguf", parts=ctypes.addressof(weight._parts), count=len(weight.parts))
        elif isinstance(weight, AmxWeight):
            self._require_bf16(x)
            self._add(args.AmxMatmulArgs(weight.data.data_ptr(), x_ptr, out_ptr, None, weight.n, weight.k, weight.k, 0, dtype, 0), "amx")
        elif isinstance(weight, PackedWeight):
            self._require_bf16(x)
            self._add(args.PackedMatmulArgs(weight.data.data_ptr(), x_ptr, out_ptr, None, weight.n, weight.k, weight.k, 0, dtype, 0), "packed")
        elif isinstance(weight, FloatPackedWeight):
            call = args.FloatMatmulArgs(
                weight.data.data_ptr(), x_ptr, out_ptr, None, weight.n, weight.k, weight.k, 0, _DTYPE_CODES[weight.dtype], dtype, dtype, 0
            )  # fmt: skip
            self._add(call, "float")
        else:
            raise TypeError(f"decode program: no product kernel for {type(weight).__name__}")

    def lora(self, x: torch.Tensor, out: torch.Tensor) -> args.LoraArgs:
        """out += each row's LoRA adapter product of x (kernels/lora.cpp), after the projection of x into
        out. The step's adapters are set on the returned arguments before each run (set_lora); none
        (adapters 0) makes it a no-op."""
        if x.dtype != out.dtype or x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("decode program: LoRA rows in float32 or bf16, x and out alike")
        call = args.LoraArgs()
        call.x, call.out = self._buffer(x, x.shape[1]), self._buffer(out, out.shape[1])
        call.x_stride, call.out_stride, call.k, call.n, call.dtype = x.stride(0), out.stride(0), x.shape[1], out.shape[1], _DTYPE_CODES[x.dtype]
        self._add(call, "lora")
        return call

    def bias_add(self, out: torch.Tensor, bias: torch.Tensor) -> None:
        """out[r] += bias ([width], out's dtype), as Linear adds its bias after the product."""
        width = out.shape[1]
        if bias.dtype != out.dtype or tuple(bias.shape) != (width,) or not bias.is_contiguous() or not bias.is_cpu:
            raise ValueError(f"decode program: a contiguous {out.dtype} bias [{width}]")
        self._keep.append(bias)
        self._add(args.BiasAddArgs(self._buffer(out, width), bias.data_ptr(), 0, width, width, _DTYPE_CODES[out.dtype], 0), "bias_add")

    @staticmethod
    def _require_bf16(x: torch.Tensor) -> None:
        if x.dtype != torch.bfloat16:
            raise ValueError("decode program: bf16 products take bf16 rows")

    def qk_norm_rope(
        self, qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
        q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
    ) -> None:  # fmt: skip
        """q, k [capacity, heads * head_dim] from qkv [capacity, width] as fused.qk_norm_rope makes them."""
        if cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()) or cos.shape[-1] != head_dim // 2:
            raise ValueError("decode program: the rotary tables are contiguous float32 [positions, head_dim / 2]")
        weights = [_float_weight(w) for w in (q_weight, k_weight) if w is not None]
        self._keep.extend([cos, sin, *weights])
        call = args.QkNormRopeArgs(
            self._buffer(q, num_heads * head_dim, qkv.dtype), self._buffer(k, num_kv_heads * head_dim, qkv.dtype),
            self._buffer(qkv, qkv.shape[1]), q_weight.data_ptr() if q_weight is not None else None,
            k_weight.data_ptr() if k_weight is not None else None, None, cos.data_ptr(), sin.data_ptr(), 0, qkv.shape[1],
            _DTYPE_CODES[qkv.dtype], num_heads, num_kv_heads, head_dim, eps, 0,
        )  # fmt: skip
        self._add(call, "qk_norm_rope")

    def kv_copy(self, group: int, key: torch.Tensor, value: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v rows ([capacity, kv_heads * head_dim] views, unit inner stride) into a float pool
        layer's key / value [slots, kv_heads, head_dim] of the rows' own dtype, at the group's slots."""
        if key.dtype != k.dtype or value.dtype != v.dtype or k.dtype != v.dtype or not (key.is_contiguous() and value.is_contiguous()):
            raise ValueError("decode program: a float pool of the activations' dtype, contiguous")
        width = key.shape[1] * key.shape[2]
        if k.shape != (self.capacity, width) or v.shape != k.shape or k.stride(1) != 1 or v.stride(1) != 1 or key.shape != value.shape:
            raise ValueError(f"decode program: K/V rows [{self.capacity}, {width}] with unit inner stride")
        self._keep.extend([key, value, k, v])
        size = k.element_size()
        call = args.KVCopyArgs(
            key.data_ptr(), value.data_ptr(), k.data_ptr(), v.data_ptr(), None, 0, k.stride(0) * size, v.stride(0) * size, width * size, key.shape[0]
        )  # fmt: skip
        self._add(call, "kv_copy", group=self._group(group))

    def kv_store(
        self, group: int, spec, records: torch.Tensor, x: torch.Tensor, head_scales: torch.Tensor | None, center: torch.Tensor | None
    ) -> None:
        """kv_formats.kv_store of rows x ([capacity, kv_heads * head_dim], unit inner stride) at the group's slots."""
        heads, dim = spec.num_kv_heads, spec.head_dim
        if spec.kv_dtype not in SCALED_KV_FORMATS or x.shape != (self.capacity, heads * dim) or x.stride(1) != 1:
            raise ValueError("decode program: an int8 or fp8 cache and K or V rows [capacity, kv_heads * head_dim]")
        if records.dtype != torch.uint8 or not records.is_contiguous():
            raise ValueError("decode program: contiguous uint8 records")
        scales = head_scales.float().contiguous() if head_scales is not None else None
        if center is not None and (center.dtype != torch.float32 or tuple(center.shape) != (heads, dim) or not center.is_contiguous()):
            raise ValueError(f"decode program: the center is a contiguous float32 [{heads}, {dim}] tensor")
        self._keep.extend([records, x, scales, center])
        call = args.KVStoreArgs(
            x.data_ptr(), None, records.data_ptr(), scales.data_ptr() if scales is not None else None,
            center.data_ptr() if center is not None else None, 0, x.stride(0), records.shape[0], records.shape[1], heads * dim,
            _DTYPE_CODES[x.dtype], KV_FORMAT_CODES[spec.kv_dtype], spec.block_size, heads, dim, 0,
        )  # fmt: skip
        self._add(call, "kv_store", group=self._group(group))

    def decode_attention(
        self, group: int, view: args.KVView, q: torch.Tensor, out: torch.Tensor, num_heads: int, window: int | None, scale: float
    ) -> None:
        """out = paged decode attention of q ([capacity, num_heads * head_dim]) over the layer's KV view."""
        width = num_heads * view.head_dim
        self._keep.append(view)
        call = args.DecodeAttentionArgs(
            self._buffer(out, width, q.dtype), self._buffer(q, width), ctypes.addressof(view), None, None, 0, 0,
            _DTYPE_CODES[q.dtype], num_heads, window or 0, scale,
        )  # fmt: skip
        self._add(call, "decode_attention", group=self._group(group))

    def add_rms_norm(
        self, residual: torch.Tensor, addend: torch.Tensor, out: torch.Tensor | None, addend_weight: torch.Tensor | None,
        weight: torch.Tensor | None, eps: float, scale_after_cast: bool,
    ) -> None:  # fmt: skip
        """fused.add_rms_norm: residual += (norm(addend) * addend_weight or addend); out = norm(residual) * weight."""
        dim = residual.shape[1]
        if (out is None) != (weight is None):
            raise ValueError("decode program: add_rms_norm writes out exactly when it has a weight")
        for w in (addend_weight, weight):
            if w is not None:
                self._keep.append(_float_weight(w))
        residual_ptr = self._buffer(residual, dim)
        call = args.AddRmsNormArgs(
            self._buffer(out, dim, residual.dtype) if out is not None else residual_ptr, residual_ptr,
            self._buffer(addend, dim, residual.dtype), addend_weight.data_ptr() if addend_weight is not None else None,
            weight.data_ptr() if weight is not None else None, 0, _DTYPE_CODES[residual.dtype], dim, eps, int(scale_after_cast),
        )  # fmt: skip
        self._add(call, "add_rms_norm")

    def gated_activation(self, gate_up: torch.Tensor, out: torch.Tensor, activation: str) -> None:
        inter = gate_up.shape[1] // 2
        call = args.GatedActivationArgs(
            self._buffer(out, inter, gate_up.dtype), self._buffer(gate_up, 2 * inter), 0, inter, _DTYPE_CODES[gate_up.dtype],
            ACTIVATIONS[activation],
        )  # fmt: skip
        self._add(call, "gated_activation")

    def hadamard(self, rotation: Hadamard, xs: tuple[torch.Tensor, ...], inverse: bool) -> None:
        """Rotate 1-3 row buffers ([capacity, heads * head_dim] views, unit inner stride) in place, as
        Hadamard does a layer's q, k, v (and R^T its attention output)."""
        dim = rotation.dim
        if not 0 < len(xs) <= 3 or any(x.dim() != 2 or x.shape[0] != self.capacity or x.shape[1] % dim or x.stride(1) != 1 for x in xs):
            raise ValueError(f"decode program: 1-3 buffers [{self.capacity}, heads * {dim}] to rotate")
        if len({x.dtype for x in xs}) != 1:
            raise ValueError("decode program: rotated buffers share one dtype")
        self._keep.extend([rotation.signs, *xs])
        call = args.HadamardArgs()
        call.signs, call.scale, call.dim = rotation.signs.data_ptr(), rotation.scale, dim
        for i, x in enumerate(xs):
            call.out[i] = call.x[i] = x.data_ptr()
            call.x_stride[i] = call.out_stride[i] = x.stride(0)
            call.heads[i] = x.shape[1] // dim
        call.count, call.dtype, call.inverse = len(xs), _DTYPE_CODES[xs[0].dtype], int(inverse)
        self._add(call, "hadamard")

    def _group(self, group: int) -> int:
        if not 0 <= group < args.DECODE_GROUPS:
            raise ValueError(f"decode program: at most {args.DECODE_GROUPS} KV cache groups")
        self.groups = max(self.groups, group + 1)
        return group

    def run(
        self, positions: torch.Tensor, slots: list[torch.Tensor], block_tables: list[torch.Tensor], kv_lens: list[torch.Tensor]
    ) -> None:
        """One step over positions.shape[0] rows (1 .. capacity); per group: slots [rows], block
        tables [rows, max_blocks] and KV lengths [rows], every one int64 and contiguous."""
        if self._table is None:
            self._table = (args.DecodeOp * len(self._ops))(*(args.DecodeOp(ctypes.addressof(c), p, k, g, n, 0) for c, p, k, g, n in self._ops))
        rows = positions.shape[0]
        if not 0 < rows <= self.capacity or len(slots) < self.groups or len(block_tables) < self.groups or len(kv_lens) < self.groups:
            raise ValueError(f"decode program: 1 to {self.capacity} rows and every KV cache group's tables")
        step = self._step
        for tensor, length in ((positions, rows), *((t, rows) for t in slots[: self.groups]), *((t, rows) for t in kv_lens[: self.groups])):
            if tensor.dtype != torch.int64 or tensor.shape != (length,) or not tensor.is_contiguous():
                raise ValueError("decode program: positions, slots and lengths are contiguous int64 [rows]")
        step.positions, step.rows = positions.data_ptr(), rows
        for g in range(self.groups):
            table = block_tables[g]
            if table.dtype != torch.int64 or table.dim() != 2 or table.shape[0] != rows or not table.is_contiguous():
                raise ValueError("decode program: block tables are contiguous int64 [rows, blocks]")
            step.slots[g], step.block_tables[g], step.kv_lens[g] = slots[g].data_ptr(), table.data_ptr(), kv_lens[g].data_ptr()
            step.max_blocks[g] = table.shape[1]
        status = self._library.kvserve_decode_program_run(self._table, len(self._ops), ctypes.byref(step), ctypes.byref(self._failed))
        if status:
            kind = next(name for name, code in OP_KINDS.items() if code == self._ops[self._failed.value][2])
            raise ValueError(f"decode program: op {self._failed.value} ({kind}) refused its arguments (status {status})")
