"""The AMX bf16 GEMM (kernels/amx_matmul.cpp): its packing, its results against a float64
reference, and a row's result never depending on the other rows of its batch.

Everything runs on the emulated build (tile instructions in scalar C++, build_amx_emulation),
which checks the layouts, the staging of partial tiles and the outputs on any CPU; the same checks
run on the production build where the CPU has AMX."""

import pytest
import torch

from kvserve.kernels import products
from kvserve.kernels.build import build_amx_emulation, cpu_flags

ROWS = [1, 15, 16, 17, 33]
KS = [40, 64, 72, 640]
NS = [8, 17, 48, 100]

REAL_AMX = pytest.mark.skipif(not products.amx_available(), reason="needs a CPU with AMX-BF16 (and Linux granting tile data)")


@pytest.fixture(scope="module")
def emulated():
    return build_amx_emulation()


def random_bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def reference_relayout(weight):
    """The packed layout by torch: [n/16][k/32][16 pairs][16 columns][2], zero-padded."""
    n, k = weight.shape
    blocks, steps = -(-n // 16), -(-k // 32)
    padded = torch.zeros(blocks * 16, steps * 32, dtype=weight.dtype)
    padded[:n, :k] = weight
    return padded.view(blocks, 16, steps, 16, 2).permute(0, 2, 3, 1, 4).reshape(-1)


def assert_close_to_float64(x, weight, out):
    """Within the float32 summation bound of the exact product (bf16 products are exact in float32)."""
    exact = x.double() @ weight.double().T
    bound = 2 * x.shape[1] * 2.0**-24 * (x.double().abs() @ weight.double().abs().T)
    if out.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * exact.abs()
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("n, k", [(1, 1), (17, 40), (48, 72), (100, 640), (33, 33)])
def test_packing_matches_a_torch_relayout(emulated, n, k):
    weight = random_bf16(n, k)
    packed = products.amx_pack_weight(weight, library=emulated)
    assert (packed.n, packed.k) == (n, k)
    assert torch.equal(packed.data, reference_relayout(weight))
    # the production library packs the same bytes (packing needs no AMX)
    assert torch.equal(products.amx_pack_weight(weight).data, packed.data)


def check_against_float64(library, rows, k, n):
    x, weight = random_bf16(rows, k, seed=1), random_bf16(n, k, seed=2)
    packed = products.amx_pack_weight(weight, library=library)
    out, argmax = products.amx_matmul(x, packed, out_dtype=torch.float32, want_argmax=True, library=library)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    assert_close_to_float64(x, weight, out)
    assert torch.equal(argmax, out.argmax(1))
    rounded, none = products.amx_matmul(x, packed, library=library)
    assert none is None and rounded.dtype == torch.bfloat16
    assert torch.equal(rounded, out.to(torch.bfloat16))  # round to nearest even, like torch
    assert_close_to_float64(x, weight, rounded)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", NS)
def test_emulated_matches_float64(emulated, rows, k, n):
    check_against_float64(emulated, rows, k, n)


def check_ties_go_to_the_lowest_index(library):
    weight = -random_bf16(100, 64).abs() - 1
    weight[[20, 22, 70, 99]] = 1  # ties inside a column block and across blocks
    packed = products.amx_pack_weight(weight, library=library)
    x = torch.ones(17, 64, dtype=torch.bfloat16)
    out, argmax = products.amx_matmul(x, packed, want_output=False, want_argmax=True, library=library)
    assert out is None and argmax.tolist() == [20] * 17


def test_emulated_argmax_breaks_ties_toward_the_lowest_index(emulated):
    check_ties_go_to_the_lowest_index(emulated)


def check_rows_do_not_depend_on_the_batch(library, k):
    """64 rows at once, each row alone and slices starting inside and across 16-row tiles: the same
    bits. A strided x (row stride > k) and the thread count change nothing either."""
    wide = random_bf16(64, k + 24, seed=3)
    x = wide[:, :k]
    packed = products.amx_pack_weight(random_bf16(100, k, seed=4), library=library)
    full, full_argmax = products.amx_matmul(x, packed, out_dtype=torch.float32, want_argmax=True, library=library)
    full_bf16, _ = products.amx_matmul(x.contiguous(), packed, library=library)
    for row in range(64):
        alone, argmax = products.amx_matmul(x[row : row + 1], packed, out_dtype=torch.float32, want_argmax=True, library=library)
        assert torch.equal(alone, full[row : row + 1]) and argmax.item() == full_argmax[row].item()
    for start, count in [(0, 1), (7, 1), (0, 15), (3, 15), (0, 16), (5, 16), (0, 17), (30, 17), (47, 17), (1, 63)]:
        part = slice(start, start + count)
        assert torch.equal(products.amx_matmul(x[part], packed, out_dtype=torch.float32, library=library)[0], full[part])
        assert torch.equal(products.amx_matmul(x[part], packed, library=library)[0], full_bf16[part])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(products.amx_matmul(x, packed, out_dtype=torch.float32, library=library)[0], full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("k", [72, 640])
def test_emulated_rows_do_not_depend_on_the_batch(emulated, k):
    check_rows_do_not_depend_on_the_batch(emulated, k)


def test_bad_inputs_are_refused(emulated):
    packed = products.amx_pack_weight(random_bf16(16, 64), library=emulated)
    with pytest.raises(ValueError, match="amx_matmul"):
        products.amx_matmul(random_bf16(2, 62), packed, library=emulated)
    with pytest.raises(ValueError, match="amx_matmul"):
        products.amx_matmul(random_bf16(2, 64).float(), packed, library=emulated)
    with pytest.raises(ValueError, match="amx_matmul"):
        products.amx_matmul(random_bf16(2, 64), packed, out_dtype=torch.float16, library=emulated)
    with pytest.raises(ValueError, match="amx_matmul"):
        products.amx_matmul(random_bf16(0, 64), packed, library=emulated)
    with pytest.raises(ValueError):
        products.amx_matmul(random_bf16(2, 64), packed, out=torch.empty(2, 15), library=emulated)
    with pytest.raises(ValueError, match="amx_pack_weight"):
        products.amx_pack_weight(random_bf16(64), library=emulated)
    with pytest.raises(ValueError, match="amx_pack_weight"):
        products.amx_pack_weight(random_bf16(4, 64).float(), library=emulated)


def test_the_production_build_reports_amx_as_the_cpu_does(monkeypatch):
    assert products.amx_available() == ("amx_bf16" in cpu_flags())
    monkeypatch.setenv("KVSERVE_DISABLE_AMX", "1")
    assert not products.amx_available()


@pytest.mark.skipif(products.amx_available(), reason="checks the refusal on a CPU without AMX")
def test_without_amx_the_kernel_refuses_instead_of_faulting():
    packed = products.amx_pack_weight(random_bf16(16, 64))
    with pytest.raises(RuntimeError, match="not available"):
        products.amx_matmul(random_bf16(2, 64), packed)


@REAL_AMX
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", NS)
def test_real_amx_matches_float64(rows, k, n):
    check_against_float64(None, rows, k, n)


@REAL_AMX
@pytest.mark.parametrize("k", [72, 640])
def test_real_amx_rows_do_not_depend_on_the_batch(k):
    check_rows_do_not_depend_on_the_batch(None, k)


@REAL_AMX
def test_real_amx_argmax_breaks_ties_toward_the_lowest_index():
    check_ties_go_to_the_lowest_index(None)


@REAL_AMX
def test_real_amx_agrees_with_the_emulation(emulated):
    """The same tiles on hardware and in emulation: equal up to the hardware's internal rounding."""
    x, weight = random_bf16(33, 640, seed=5), random_bf16(100, 640, seed=6)
    real, _ = products.amx_matmul(x, products.amx_pack_weight(weight), out_dtype=torch.float32)
    emulated_weight = products.amx_pack_weight(weight, library=emulated)
    emul, _ = products.amx_matmul(x, emulated_weight, out_dtype=torch.float32, library=emulated)
    assert torch.allclose(real, emul, rtol=1e-4, atol=1e-4)
