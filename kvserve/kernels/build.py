"""Compiles the CPU kernels once per machine and loads them with ctypes.

The shared object is keyed by the source, the compiler and this CPU's feature flags (it is built
with -march=native), and cached under ~/.cache/kvserve/kernels. No torch headers are needed, so a
build takes about a second. When no compiler is present the engine falls back to torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  -- loads torch's OpenMP runtime first, so the kernels share its threads

from kvserve.cache_dir import cache_root
from kvserve.kernels.args import layout_mismatches

logger = logging.getLogger(__name__)

SOURCES = [
    "paged_attention.cpp", "float_matmul.cpp", "gguf_matmul.cpp", "packed_matmul.cpp", "screened_argmax.cpp", "screened_sampler.cpp", "fused_ops.cpp", "hadamard.cpp", "window_scores.cpp", "lora.cpp",
    "sampler.cpp", "kv_store.cpp", "amx_matmul.cpp", "decode_program.cpp", "abi.cpp",
]  # fmt: skip
HEADERS = [
    "simd.h", "float_tiles.h", "args.h", "kv_formats.h", "gumbel.h", "int8_screen.h", "amx_tiles.h", "amx_core.h", "gguf_dot.h", "gguf_int8.h", "gguf_screen.h", "gguf_amx.h",
    # paged_attention.cpp's paths, included into its one translation unit
    "attention_common.h", "attention_rows.h", "attention_tiles.h", "attention_int8.h", "attention_bf16.h", "attention_amx.h", "attention_amx_int8.h", "attention_kivi_bf16.h",
]  # fmt: skip
# test only: the AMX kernels (amx_matmul.cpp; gguf_matmul.cpp's bf16 tiles) with their tile
# instructions emulated in scalar C++ (amx_tiles.h)
AMX_EMULATION_SOURCES = ["amx_matmul.cpp", "gguf_matmul.cpp", "abi.cpp"]
AMX_EMULATION_FLAGS = ["-DKVSERVE_AMX_EMULATE", "-ffp-contract=off"]
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno", "-Wno-psabi"]


def _flags() -> list[str]:
    # KVSERVE_MARCH=haswell (say) builds for an older CPU than this one, e.g. to test the AVX2 code here
    return [f"-march={os.environ.get('KVSERVE_MARCH', 'native')}", *FLAGS]


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux's /proc/cpuinfo lists them (x86 "flags", Arm "Features");
    empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def _cpu_identity() -> str:
    import platform

    return " ".join(sorted(cpu_flags())) or platform.processor() or platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _build(sources: list[str], flags: list[str], stem: str) -> tuple[Path | None, str]:
    """The shared object for these sources and flags, compiled into the cache unless already there:
    (its path, or None when it cannot be built, and the compiler's complaint)."""
    compiler = _compiler()
    if compiler is None:
        return None, "no C++ compiler found"
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in sources + HEADERS:
        digest.update((here / name).read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest.update("\0".join([compiler, version, *flags, _cpu_identity()]).encode())
    target = cache_root() / "kernels" / f"{stem}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            partial = Path(tmp) / target.name
            cmd = [compiler, *flags, *(str(here / name) for name in sources), "-o", str(partial)]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                return None, result.stderr[-2000:]
            os.replace(partial, target)  # atomic: concurrent builders never see half a file
    return target, ""


_c_int, _c_int64, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
# the AMX kernels' entry points (amx_matmul.cpp, and gguf_matmul.cpp's whose bf16 tiles run on AMX), in the
# production library and the emulated one alike
_AMX_SIGNATURES = {
    "kvserve_amx_matmul": [_ptr],
    "kvserve_amx_compiled": [],
    "kvserve_amx_available": [],
    # weight, n, k, packed
    "kvserve_amx_pack_weight": [_ptr, _c_int64, _c_int, _ptr],
    "kvserve_struct_layout": [ctypes.c_char_p, _ptr, _c_int],
    "kvserve_gguf_matmul": [_ptr],
    # GgufMatmulArgs (x, out, rows), GgufPart[count], count
    "kvserve_gguf_matmul_parts": [_ptr, _ptr, _c_int],
}


def _open(target: Path, signatures: dict[str, list]) -> ctypes.CDLL:
    library = ctypes.CDLL(str(target))
    library.path = target
    for name, argtypes in signatures.items():
        fn = getattr(library, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    mismatches = layout_mismatches(library)
    if mismatches:
        raise RuntimeError("the kernels' argument structs and their Python mirrors disagree: " + "; ".join(mismatches))
    return library


@functools.lru_cache(maxsize=None)
def load_kernels() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it cannot be built here (logged once)."""
    if os.environ.get("KVSERVE_DISABLE_KERNELS"):
        return None
    target, complaint = _build(SOURCES, _flags(), "kvserve_kernels")
    if target is None:
        logger.warning(
            "building the CPU kernels failed, using torch ops (slower, and a request's tokens may then differ "
            "alone and batched):\n%s", complaint,
        )
        return None
    signatures = {
        # the compute kernels take one pointer to their argument struct (args.h / args.py)
        **{name: [_ptr] for name in (
            "kvserve_paged_decode_attention", "kvserve_paged_prefill_attention", "kvserve_float_matmul", "kvserve_gguf_matmul", "kvserve_packed_matmul",
            "kvserve_screened_argmax", "kvserve_rms_norm", "kvserve_add_rms_norm", "kvserve_qk_norm_rope", "kvserve_gated_activation",
            "kvserve_sample", "kvserve_kv_store", "kvserve_window_scores",
        )},  # fmt: skip
        **_AMX_SIGNATURES,
        "kvserve_gguf_screen_available": [],
        "kvserve_window_scores_available": [],
        "kvserve_gguf_int8_available": [],
        # Q8_0 blocks, n, k, block bounds (out), tile L1 norms (out)
        "kvserve_gguf_screen_bounds": [_ptr, _c_int64, _c_int, _ptr, _ptr],
        # GgufMatmulArgs (x, argmax, rows), block bounds, tile L1 norms, rescored tiles (out, nullable)
        "kvserve_gguf_screened_argmax": [_ptr, _ptr, _ptr, _ptr],
        # DecodeOp[count], count, DecodeStep, the failing op's index (out)
        "kvserve_decode_program_run": [_ptr, _c_int64, _ptr, _ptr],
        "kvserve_has_bf16_dot": [],
        "kvserve_has_int8_screen": [],
        "kvserve_set_attention_amx": [_c_int],
        "kvserve_attention_amx_int8": [],
        # weight, n, k, packed
        "kvserve_pack_bf16_weight": [_ptr, _c_int64, _c_int, _ptr],
        # blocks, type, n, k, row ids (or null), count, out
        "kvserve_gguf_dequantize": [_ptr, _c_int, _c_int64, _c_int, _ptr, _c_int64, _ptr],
        # weight, weight dtype, n, k, packed
        "kvserve_pack_float_weight": [_ptr, _c_int, _c_int64, _c_int, _ptr],
        # weight, n, k, group, int8 packed, row scale, row error, row |q| per group
        "kvserve_pack_int8_weight": [_ptr, _c_int64, _c_int, _c_int, _ptr, _ptr, _ptr, _ptr],
        # the screen's arguments, the sampler's
        "kvserve_screened_sample": [_ptr, _ptr],
        # seed, position, n, out
        "kvserve_token_uniforms": [ctypes.c_uint64, ctypes.c_uint64, _c_int64, _ptr],
    }
    return _open(target, signatures)


@functools.lru_cache(maxsize=None)
def build_amx_emulation() -> ctypes.CDLL:
    """Test only: the AMX kernels (amx_matmul.cpp, gguf_matmul.cpp) with their tile instructions
    emulated in scalar C++ (-DKVSERVE_AMX_EMULATE, see amx_tiles.h), exposing the AMX entry points
    of the production library (kvserve_amx_available is 1) and the GGUF products, so the kernels'
    layouts and staging can be checked on a CPU without AMX. Never loaded by the engine."""
    target, complaint = _build(AMX_EMULATION_SOURCES, [*_flags(), *AMX_EMULATION_FLAGS], "kvserve_amx_emulated")
    if target is None:
        raise RuntimeError(f"building the emulated AMX kernel failed:\n{complaint}")
    return _open(target, _AMX_SIGNATURES)


def report() -> None:
    """`make setup` builds the kernels ahead of the first start and says where they are."""
    built = load_kernels()
    print(f"kvserve CPU kernels: {built.path}" if built is not None else "kvserve CPU kernels: not built, torch ops will be used")
