"""Engine configuration: frozen, validated dataclasses whose field names match the CLI flags."""

from __future__ import annotations

import functools
import reprlib
import time
from dataclasses import dataclass, fields

import torch

from kvserve.kernels.build import cpu_flags
from kvserve.engine.speculative import SpeculativeConfig
from kvserve.kv.conversation_pins import ConversationKVConfig
from kvserve.kv.eviction import EvictionPolicy
from kvserve.kv.rotation import is_power_of_two
from kvserve.kv.spec import KV_FORMATS, MAX_KV_QUANT_RESIDUAL, block_size_for, normalize_kv_dtype
from kvserve.model.registry import DEFAULT_MODEL

ATTENTION_BACKENDS = ("auto", "cpu_paged", "torch_sdpa")
PREFIX_CACHES = ("hash", "radix")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.lru_cache(maxsize=None)
def fastest_dtype(device: str) -> str:
    """`--dtype auto`: bf16 where the hardware multiplies it natively (CUDA, x86 with AVX512-BF16 or
    AMX), float32 on other x86 CPUs, whose bf16 GEMMs are emulated and ran 3-5x slower than fp32 on
    the AVX2 machines here. Elsewhere (Arm, say) the faster of the two in a timed matmul."""
    if torch.device(device).type == "cuda":
        return "bfloat16"
    flags = cpu_flags()
    if "sse2" in flags:  # x86: the flags say it (a timing flipped to float32 on a loaded AMX machine)
        return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"
    return _faster_in_a_timed_matmul()


def _faster_in_a_timed_matmul() -> str:
    best = {}
    for name in ("float32", "bfloat16"):
        x = torch.randn(64, 640, dtype=DTYPES[name])
        w = torch.randn(2048, 640, dtype=DTYPES[name])
        torch.nn.functional.linear(x, w)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)
            times.append(time.perf_counter() - start)
        best[name] = min(times)
    return min(best, key=best.get)


MAX_KV_QUANT_GROUP_SIZE = 256
DEFAULT_KV_OFFLOAD_DISK_GIB = 8.0
KV_ROLES = ("both", "producer", "consumer")  # --kv-role: disaggregated prefill through the remote tier
WEIGHT_DTYPES = ("auto", "gguf", "int8", "int4", "bfloat16", "float32")
GGUF_ACTIVATIONS = ("auto", "int8", "exact", "bf16")


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    weight_dtype: str = "auto"  # auto: a GGUF file's blocks with float32 activations on the CPU, else --dtype; gguf; int8 / int4 (any checkpoint, quantized at load); bfloat16; float32
    gguf_activations: str = "auto"  # products on GGUF / Q8_0 blocks: int8 rows (AVX512-VNNI), exact, or bf16 (AMX tiles on bf16-rounded values); auto: exact
    kv_cache_dtype: str = "auto"
    block_size: int | None = None  # 16; for int4/int2 the smallest multiple of kv_quant_group_size from 16
    kv_quant_group_size: int = 32  # int4/int2: tokens of a key channel, channels of a value, per scale
    kv_quant_residual: int = 128  # int4/int2: recent tokens kept in full precision
    kv_quant_sink_block: bool = True  # int4/int2: each sequence's first block kept in full precision (its attention sink)
    kv_cache_scales: str | None = None  # fp8: a JSON file of calibrated per-layer, per-head K and V scales
    kv_key_centering: bool = True  # int8 / fp8 without calibrated scales: keys stored minus a per-layer, per-head mean
    kv_hadamard: bool | None = None  # K/V stored in a Hadamard basis (kv/rotation.py); None: int8's default (rotates_kv)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_step_tokens: int = 1024  # a step's prompt tokens after which it takes no more prompts once one completes (0: none)
    max_model_len: int | None = None
    kv_cache_memory: float = 2.0  # GiB
    num_kv_blocks: int | None = None  # overrides kv_cache_memory (tests, planning)
    seed: int = 0
    device: str = "cpu"
    max_waiting_requests: int = 1024
    attention_backend: str = "auto"
    disable_hybrid_kv_cache_manager: bool = False  # every layer holds every block (sliding-window layers too)
    enable_prefix_caching: bool = True
    prefix_cache: str = "hash"  # hash: whole blocks by chained hash; radix: token-granular radix tree
    expose_salt_stats: bool = False  # other_salt misses and per-salt reuse: cross-tenant signals, for trusted callers only
    skip_tokenizer_init: bool = False  # token ids in and out only (automatic when the model has no tokenizer files)
    kv_compression: str = "none"  # none | snapkv | streaming | random: evict cached tokens (kv/eviction.py)
    kv_keep_ratio: float | None = None  # share of a sequence's tokens kept
    kv_budget: int | None = None  # tokens kept (instead of kv_keep_ratio)
    snapkv_window: int = 32
    snapkv_kernel: int = 7
    sink_tokens: int = 4
    snapkv_query: str = "both"  # window: the prompt's last tokens score (its question); generic: a generic question does; both
    snapkv_question_weight: float = 10.0  # snapkv both: the generic question's mean scores against the window's
    # stored conversations (the Responses API's store): their blocks pinned between turns (kv/conversation_pins.py)
    conversation_kv_share: float = 0.1  # of the pool, at most
    conversation_kv_ttl: float = 300.0  # seconds
    kv_offload_host_gib: float = 0.0  # a host-memory tier under the pool for blocks leaving it (0: none)
    kv_offload_disk_dir: str | None = None  # a local disk tier (survives restarts)
    kv_offload_disk_gib: float | None = None  # the disk tier's budget (8 GiB when a directory is given)
    kv_offload_policy: str = "write_back"  # write_back: blocks go down when evicted; write_through: when computed
    kv_remote_url: str | None = None  # redis://[:password@]host:port/db (rediss:// for TLS): a tier shared by engines
    kv_remote_timeout_ms: int = 200  # the deadline of every call to the remote tier
    kv_remote_ttl: int = 3600  # seconds every remote entry lives after it was last written or read
    kv_remote_ca_file: str | None = None  # rediss://: the CA certificate that signed the server's
    kv_remote_key_file: str | None = None  # the secret that signs KV records leaving the process (or KVSERVE_KV_REMOTE_KEY)
    kv_role: str = "both"  # both | producer (prefills, publishes to the remote tier) | consumer (reads it, never writes)
    # speculative decoding (engine/speculative.py): a SpeculativeConfig, or its dict / JSON object as vLLM takes it
    speculative_config: SpeculativeConfig | None = None
    threads: int | None = None  # CPU threads of the process's kernels (torch and ours); None: torch's default (all cores)
    # LoRA adapters (kvserve/lora/): requests name one with a LoRARequest; vLLM's flags
    enable_lora: bool = False
    max_loras: int = 1  # adapters resident as products (more in one step are held for that step)
    max_lora_rank: int = 16  # adapters of a higher rank are refused
    max_cpu_loras: int | None = None  # adapters kept as read (None: max_loras)

    def __post_init__(self) -> None:
        try:
            torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"device {self.device!r} is not a valid torch device") from exc
        dtype = fastest_dtype(self.device) if self.dtype == "auto" else {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(self.dtype, self.dtype)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}; got {self.weight_dtype!r}")
        if self.weight_dtype in DTYPES and self.weight_dtype != dtype:
            raise ValueError(f"--weight-dtype {self.weight_dtype} holds the weights in the activations' dtype: it needs --dtype "
                             f"{self.weight_dtype} (--dtype is {dtype})")  # fmt: skip
        if self.weight_dtype in ("gguf", "int8", "int4"):  # checked here too so that `kvserve eval` refuses a --config before loading
            if dtype not in ("float32", "bfloat16"):
                raise ValueError(f"--weight-dtype {self.weight_dtype} takes float32 or bfloat16 activations; --dtype is {dtype}")
            if torch.device(self.device).type != "cpu":
                raise ValueError(f"--weight-dtype {self.weight_dtype} computes with the CPU kernels: it needs --device cpu")
        if self.gguf_activations not in GGUF_ACTIVATIONS:
            raise ValueError(f"gguf_activations must be one of {', '.join(GGUF_ACTIVATIONS)}; got {self.gguf_activations!r}")
        if self.gguf_activations == "bf16" and dtype != "bfloat16":  # checked at load too; here so that `kvserve eval` refuses a --config first
            raise ValueError(f"--gguf-activations bf16 multiplies bf16 rows: it needs --dtype bfloat16 (--dtype is {dtype})")
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"prefix_cache must be one of {', '.join(PREFIX_CACHES)}; got {self.prefix_cache!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {self.attention_backend!r}")
        if self.kv_cache_dtype == "auto":
            object.__setattr__(self, "kv_cache_dtype", dtype)
        object.__setattr__(self, "kv_cache_dtype", normalize_kv_dtype(self.kv_cache_dtype))
        for name in ("kv_quant_group_size", "kv_quant_residual"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "kv_quant_group_size" else 0):
                raise ValueError(f"{name} must be a {'positive' if name == 'kv_quant_group_size' else 'non-negative'} integer, got {value!r}")
        if self.kv_quant_group_size > MAX_KV_QUANT_GROUP_SIZE:
            raise ValueError(f"kv_quant_group_size must be at most {MAX_KV_QUANT_GROUP_SIZE} (one scale per that many tokens "
                             f"of a key channel and channels of a value), got {self.kv_quant_group_size}")  # fmt: skip
        if self.kv_quant_residual > MAX_KV_QUANT_RESIDUAL:
            raise ValueError(f"kv_quant_residual must be at most {MAX_KV_QUANT_RESIDUAL} tokens, got {self.kv_quant_residual}")
        if self.block_size is None:
            object.__setattr__(self, "block_size", block_size_for(self.kv_cache_dtype, None, self.kv_quant_group_size))
        for name in ("kv_key_centering", "kv_quant_sink_block"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.kv_hadamard is not None and not isinstance(self.kv_hadamard, bool):
            raise ValueError(f"kv_hadamard must be true, false or None (auto), got {self.kv_hadamard!r}")
        if self.kv_cache_scales is not None and not self.kv_cache_dtype.startswith("fp8"):
            raise ValueError(f"kv_cache_scales calibrates fp8 caches; --kv-cache-dtype is {self.kv_cache_dtype}")
        if self.kv_hadamard and self.kv_cache_scales is not None:
            raise ValueError("--kv-hadamard (kv_hadamard) does not go with calibrated --kv-cache-scales (they were measured on unrotated K/V)")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        value = self.prefill_step_tokens
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"prefill_step_tokens must be 0 (prompts fill --max-num-batched-tokens) or a positive integer, got {value!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        memory = self.kv_cache_memory
        if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not 0 < memory < 2**50:
            raise ValueError(f"kv_cache_memory must be a positive, finite number of GiB, got {reprlib.repr(memory)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        self._validate_offload()
        ConversationKVConfig(self.conversation_kv_share, self.conversation_kv_ttl)  # its own checks
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be true or false, got {self.enable_lora!r}")
        for name, top in (("max_loras", 256), ("max_lora_rank", 512), ("max_cpu_loras", 4096)):
            value = getattr(self, name)
            if value is None and name == "max_cpu_loras":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top:
                raise ValueError(f"{name} must be an integer in [1, {top}], got {value!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.eviction.active and KV_FORMATS[self.kv_cache_dtype].kind == "kivi":  # self.eviction validates the fields
            raise ValueError(f"kv_compression does not work with --kv-cache-dtype {self.kv_cache_dtype} (KIVI keys are quantized "
                             "per channel across tokens); use a float, int8 or fp8 cache")

    @property
    def offloads_kv(self) -> bool:
        return self.kv_offload_host_gib > 0 or self.kv_offload_disk_dir is not None or self.kv_remote_url is not None

    def _validate_offload(self) -> None:
        host, disk_dir, disk = self.kv_offload_host_gib, self.kv_offload_disk_dir, self.kv_offload_disk_gib
        if isinstance(host, bool) or not isinstance(host, (int, float)) or not 0 <= host < float("inf"):
            raise ValueError(f"--kv-offload-host-gib (kv_offload_host_gib) must be a non-negative, finite number of GiB, 0 for no host tier; got {host!r}")
        if disk_dir is not None and (not isinstance(disk_dir, str) or not disk_dir.strip()):
            raise ValueError(f"--kv-offload-disk-dir (kv_offload_disk_dir) must name a directory, got {disk_dir!r}")
        if disk is not None:
            if disk_dir is None:
                raise ValueError("--kv-offload-disk-gib (kv_offload_disk_gib) sizes the disk tier: give --kv-offload-disk-dir too")
            if isinstance(disk, bool) or not isinstance(disk, (int, float)) or not 0 < disk < float("inf"):
                raise ValueError(f"--kv-offload-disk-gib (kv_offload_disk_gib) must be a positive, finite number of GiB, got {disk!r}")
        elif disk_dir is not None:
            object.__setattr__(self, "kv_offload_disk_gib", DEFAULT_KV_OFFLOAD_DISK_GIB)
        if self.kv_offload_policy not in ("write_back", "write_through"):
            raise ValueError(f"--kv-offload-policy (kv_offload_policy) must be write_back or write_through, got {self.kv_offload_policy!r}")
        for flag, gib in (("--kv-offload-host-gib (kv_offload_host_gib)", host), ("--kv-offload-disk-gib (kv_offload_disk_gib)", disk)):
            if gib and int(gib * 2**30) < 1 << 10:  # less than a KiB holds no record of any model
                raise ValueError(f"{flag} must be at least 1 KiB ({2**-20:g} GiB), got {gib!r}")
        self._validate_remote()
        if not self.offloads_kv:
            if self.kv_offload_policy != "write_back":
                raise ValueError("--kv-offload-policy (kv_offload_policy) says when blocks go down to a tier: give one "
                                 "(--kv-offload-host-gib, --kv-offload-disk-dir or --kv-remote-url)")  # fmt: skip
            return
        if not self.enable_prefix_caching:
            raise ValueError("--kv-offload-host-gib / --kv-offload-disk-dir / --kv-remote-url keep blocks by their prefix hashes: they need prefix caching "
                             "(drop --no-enable-prefix-caching)")  # fmt: skip

    def _validate_remote(self) -> None:
        url = self.kv_remote_url
        if url is not None and (not isinstance(url, str) or not url.startswith(("redis://", "rediss://"))):
            raise ValueError("--kv-remote-url (kv_remote_url) must be redis://[:password@]host:port/db or rediss://...")
        for name, low, high in (("kv_remote_timeout_ms", 1, 60_000), ("kv_remote_ttl", 1, 365 * 86400)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"--{name.replace('_', '-')} ({name}) must be an integer in [{low}, {high}], got {value!r}")
        if self.kv_remote_ca_file is not None and (url is None or not url.startswith("rediss://")):
            raise ValueError("--kv-remote-ca-file (kv_remote_ca_file) verifies a TLS server: give a rediss:// --kv-remote-url")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"--kv-role (kv_role) must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_role != "both" and url is None:
            raise ValueError(f"--kv-role {self.kv_role} hands blocks over through the remote tier: give --kv-remote-url")
        if self.threads is not None and (not isinstance(self.threads, int) or isinstance(self.threads, bool) or not 1 <= self.threads <= 4096):
            raise ValueError(f"--threads (threads) must be an integer in [1, 4096], got {self.threads!r}")

    @property
    def eviction(self) -> EvictionPolicy:
        return EvictionPolicy(self.kv_compression, self.kv_keep_ratio, self.kv_budget, self.snapkv_window, self.snapkv_kernel,
                              self.sink_tokens, self.snapkv_query, self.snapkv_question_weight)  # fmt: skip

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def centers_keys(self) -> bool:
        """Whether an int8 / fp8 cache stores centered keys (kv/centering.py)."""
        return self.kv_key_centering and self.kv_cache_scales is None and KV_FORMATS[normalize_kv_dtype(self.kv_cache_dtype)].kind == "scaled"

    def rotates_kv(self, head_dim: int) -> bool:
        """Whether K/V are stored Hadamard-rotated (kv/rotation.py): as asked, or by default for int8,
        where it lowered the cost on every model measured, when the head dim is a power of two. fp8
        and int4 gain on some models and lose badly on others (docs/kv-quantization.md), so they rotate only when asked."""
        if self.kv_hadamard is not None:
            return self.kv_hadamard
        return normalize_kv_dtype(self.kv_cache_dtype) == "int8" and is_power_of_two(head_dim)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
