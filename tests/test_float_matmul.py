"""float_matmul: float32 arithmetic on a packed float32/bf16 weight whose result for a row is the
same bits whatever rows ride with it, on AVX-512 and on AVX2."""

import os
import subprocess
import sys

import pytest
import torch

from kvserve.kernels import products

DTYPES = [torch.float32, torch.bfloat16]
# (n, k): n off the 16-row tiles, k odd and small, and a layer-sized one
SHAPES = [(37, 5), (100, 96), (33, 1), (250, 131)]


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.double() @ weight.double().t()


@pytest.mark.parametrize("weight_dtype", DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_float_matmul_matches_a_float64_reference(weight_dtype, x_dtype, rows, shape):
    n, k = shape
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = torch.randn(n, k, generator=g).to(weight_dtype)
    x = torch.randn(rows, k, generator=g).to(x_dtype)
    packed = products.pack_float_weight(weight)
    assert packed.dtype == weight_dtype and torch.equal(products.unpack_float_weight(packed), weight)
    out, argmax = products.float_matmul(x, packed, out_dtype=torch.float32, want_argmax=True)
    ref = reference(x, weight)
    assert out.dtype == torch.float32 and (out.double() - ref).abs().max().item() < 1e-5 * (k**0.5 + 1)
    assert torch.equal(argmax, out.argmax(dim=1))
    bf16_out, _ = products.float_matmul(x, packed, out_dtype=torch.bfloat16)
    assert torch.equal(bf16_out, out.bfloat16())  # rounded to nearest even, like torch
    default, _ = products.float_matmul(x, packed)
    assert default.dtype == x_dtype


def test_float_matmul_reads_strided_rows():
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(50, 40, generator=g)
    wide = torch.randn(9, 100, generator=g)
    x = wide[:, 10:50]  # row stride 100
    packed = products.pack_float_weight(weight)
    out, _ = products.float_matmul(x, packed)
    assert torch.equal(out, products.float_matmul(x.contiguous(), packed)[0])


def test_float_matmul_argmax_breaks_ties_toward_the_lowest_index():
    weight = torch.zeros(5000, 32)
    weight[[70, 4100, 4999]] = 1.0  # equal logits, in different tiles, blocks and threads' ranges
    packed = products.pack_float_weight(weight)
    _, argmax = products.float_matmul(torch.ones(11, 32), packed, want_output=False, want_argmax=True)
    assert argmax.tolist() == [70] * 11
    negative = torch.full((37, 8), -1.0)  # every logit < 0: the zero rows padding 37 to 48 must not win
    _, argmax = products.float_matmul(torch.ones(2, 8), products.pack_float_weight(negative), want_output=False, want_argmax=True)
    assert argmax.tolist() == [0, 0]


@pytest.mark.parametrize("weight_dtype", DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
def test_a_rows_result_does_not_depend_on_the_batch(weight_dtype, x_dtype):
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(300, 200, generator=g).to(weight_dtype)
    x = torch.randn(64, 200, generator=g).to(x_dtype)
    packed = products.pack_float_weight(weight)
    everything, argmax = products.float_matmul(x, packed, out_dtype=torch.float32, want_argmax=True)
    for size in (1, 7, 8, 9):
        for start in range(0, 64, size):
            part, part_argmax = products.float_matmul(x[start : start + size], packed, out_dtype=torch.float32, want_argmax=True)
            assert torch.equal(part, everything[start : start + size]), f"rows {start}..{start + size}"
            assert torch.equal(part_argmax, argmax[start : start + size])


def test_float_matmul_rejects_what_it_cannot_take():
    packed = products.pack_float_weight(torch.randn(20, 8))
    for bad in (torch.randn(3, 9), torch.randn(0, 8), torch.randn(3, 8).half(), torch.randn(8, 3).t(), torch.randn(2, 3, 8)):
        with pytest.raises(ValueError, match="float_matmul"):
            products.float_matmul(bad, packed)
    with pytest.raises(ValueError, match="output"):
        products.float_matmul(torch.randn(3, 8), packed, out=torch.empty(3, 21))
    for bad in (torch.randn(4, 4).half(), torch.randn(4), torch.empty(0, 4)):
        with pytest.raises(ValueError, match="pack_float_weight"):
            products.pack_float_weight(bad)


HASWELL_CHECK = """
import sys, torch
from kvserve.kernels import products
g = torch.Generator().manual_seed(3)
x = torch.randn(19, 83, generator=g)
out = []
for dtype in (torch.float32, torch.bfloat16):
    packed = products.pack_float_weight(torch.randn(70, 83, generator=g).to(dtype))
    logits, argmax = products.float_matmul(x, packed, out_dtype=torch.float32, want_argmax=True)
    out += [logits, argmax]
torch.save(out, sys.argv[1])
"""


def test_the_avx2_build_gives_the_same_bits(tmp_path):
    """KVSERVE_MARCH=haswell builds the AVX2 kernel (8-lane halves, smaller register blocks): every
    output is the same FMA chain, so the bits match this CPU's build."""
    results = {}
    for march in ("haswell", None):
        env = {key: value for key, value in os.environ.items() if key != "KVSERVE_MARCH"}
        if march:
            env["KVSERVE_MARCH"] = march
        path = tmp_path / f"{march or 'native'}.pt"
        subprocess.run([sys.executable, "-c", HASWELL_CHECK, str(path)], env=env, check=True, capture_output=True)
        results[march] = torch.load(path)
    for avx2, native in zip(results["haswell"], results[None]):
        assert torch.equal(avx2, native)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_runs_every_row_count_on_the_float_kernel(dtype, monkeypatch):
    """A float32 weight, or a bf16 one on a CPU without AVX512-BF16, is packed for float_matmul and its
    row-major copy freed; inputs the kernel does not take unpack it on demand."""
    import torch.nn.functional as F

    from kvserve.model.layers import Linear

    monkeypatch.setattr(products, "bf16_dot_available", lambda: False)
    torch.manual_seed(0)
    layer = Linear(40, 70, bias=True).to(dtype)
    x = torch.randn(33, 40).to(dtype)
    with torch.no_grad():
        ref = F.linear(x.double(), layer.weight.double(), layer.bias.double())
        layer.enable_native()
        assert layer.packed is None and layer.float_packed is not None and layer.weight.numel() == 0
        out = layer(x)
        assert torch.equal(layer(x[5:6]), out[5:6]) and torch.equal(layer(x[:9]), out[:9])
        fallback = layer(x[None])[0]  # 3-D: the unpacked weight through F.linear
    tolerance = 1e-5 if dtype == torch.float32 else 0.05
    assert out.dtype == dtype and (out.double() - ref).abs().max().item() < tolerance
    assert (fallback.double() - ref).abs().max().item() < tolerance
