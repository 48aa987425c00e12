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
    "paged_attention.cpp", "float_matmul.cpp", "packed_matmul.cpp", "screened_argmax.cpp", "screened_sampler.cpp", "fused_ops.cpp", "hadamard.cpp",
    "sampler.cpp", "kv_store.cpp", "abi.cpp",
]  # fmt: skip
HEADERS = ["simd.h", "args.h", "kv_formats.h", "gumbel.h", "int8_screen.h"]
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


@functools.lru_cache(maxsize=None)
def load_kernels() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it cannot be built here (logged once)."""
    if os.environ.get("KVSERVE_DISABLE_KERNELS"):
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C++ compiler found: CPU attention kernels disabled, using torch ops")
        return None
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((here / name).read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest.update("\0".join([compiler, version, *_flags(), _cpu_identity()]).encode())
    target = cache_root() / "kernels" / f"kvserve_kernels-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            partial = Path(tmp) / target.name
            cmd = [compiler, *_flags(), *(str(here / name) for name in SOURCES), "-o", str(partial)]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                logger.warning("building the CPU kernels failed, using torch ops:\n%s", result.stderr[-2000:])
                return None
            os.replace(partial, target)  # atomic: concurrent builders never see half a file
    library = ctypes.CDLL(str(target))
    library.path = target
    c_int, c_int64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    signatures = {
        # the compute kernels take one pointer to their argument struct (args.h / args.py)
        **{name: [ptr] for name in (
            "kvserve_paged_decode_attention", "kvserve_paged_prefill_attention", "kvserve_float_matmul", "kvserve_packed_matmul",
            "kvserve_screened_argmax", "kvserve_rms_norm", "kvserve_add_rms_norm", "kvserve_qk_norm_rope", "kvserve_gated_activation",
            "kvserve_sample", "kvserve_kv_store",
        )},  # fmt: skip
        "kvserve_struct_layout": [ctypes.c_char_p, ptr, c_int],
        "kvserve_has_bf16_dot": [],
        "kvserve_has_int8_screen": [],
        # weight, n, k, packed
        "kvserve_pack_bf16_weight": [ptr, c_int64, c_int, ptr],
        # weight, weight dtype, n, k, packed
        "kvserve_pack_float_weight": [ptr, c_int, c_int64, c_int, ptr],
        # weight, n, k, group, int8 packed, row scale, row error, row |q| per group
        "kvserve_pack_int8_weight": [ptr, c_int64, c_int, c_int, ptr, ptr, ptr, ptr],
        # the screen's arguments, the sampler's
        "kvserve_screened_sample": [ptr, ptr],
        # seed, position, n, out
        "kvserve_token_uniforms": [ctypes.c_uint64, ctypes.c_uint64, c_int64, ptr],
    }
    for name, argtypes in signatures.items():
        fn = getattr(library, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    mismatches = layout_mismatches(library)
    if mismatches:
        raise RuntimeError("the kernels' argument structs and their Python mirrors disagree: " + "; ".join(mismatches))
    return library


def report() -> None:
    """`make setup` builds the kernels ahead of the first start and says where they are."""
    built = load_kernels()
    print(f"kvserve CPU kernels: {built.path}" if built is not None else "kvserve CPU kernels: not built, torch ops will be used")
