"""LLMEngine: model, KV pool, scheduler and sampler wired into one step loop."""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import Future
import itertools
import json
import logging
import random
import time
from pathlib import Path
from collections.abc import Callable, Sequence as Seq

import torch
import xxhash

from kvserve.kernels import library
from kvserve.attention.backend import create_backend
from kvserve.cache_dir import file_digest, tree_digest
from kvserve.config import DTYPES, EngineConfig
from kvserve.device_memory import device_memory_bytes, fitting
from kvserve.engine.migration import MAX_STATE_BYTES, RequestState
from kvserve.engine.runner import ModelRunner, SimulatedRunner
from kvserve.engine.output_text import OutputText
from kvserve.engine.sampler import Sampler
from kvserve.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from kvserve.engine.sequence import Sequence, SequenceStatus
from kvserve.kv.centering import CALIBRATION_TOKENS, calibration_tokens, key_centers
from kvserve.kv.eviction import GENERIC_QUESTION, EvictionPolicy, sink_and_recent, top_positions
from kvserve.kv.rotation import is_power_of_two
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pool import PagedKVPool
from kvserve.kv.hashing import CacheIdentity, root_hash, validate_cache_salt
from kvserve.kv.prefix import HashPrefixCache
from kvserve.kv.radix import RadixPrefixCache
from kvserve.kv.tiers import DiskStore, HostStore
from kvserve.kv.tiers.offload import KVOffloader
from kvserve.kv.tiers.record import BlockRecord, CorruptRecord, decode_record, encode_record, record_head, record_key, record_overhead
from kvserve.kv.tiers.remote import RemoteStore
from kvserve.kv.spec import GIB, KVCacheSpec, blocks_for_tokens
from kvserve.model.config import ModelConfig
from kvserve.model.loader import build_model, load_checkpoint, resolve_weight_format
from kvserve.model.weight_bytes import weight_bytes
from kvserve.model.registry import resolve_model_path
from kvserve.model.tokenizer import load_tokenizer
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.structured.compiler import GrammarCompiler

log = logging.getLogger(__name__)


def resolve_attention_backend(requested: str, device: torch.device, kv_dtype: torch.dtype) -> str:
    """`--attention-backend auto` takes the native paged kernel wherever it runs (CPU, a compiler present)."""
    native = library.supports(device, kv_dtype)
    if requested == "cpu_paged" and not native:
        raise ValueError("attention_backend 'cpu_paged' needs a CPU device, a C++ compiler and a float KV cache; use 'torch_sdpa'")
    if requested == "auto":
        return "cpu_paged" if native else "torch_sdpa"
    return requested


def kv_cache_spec(config: EngineConfig, model_config: ModelConfig) -> KVCacheSpec:
    """The engine's KV layout for a model: what the planner computes with, too."""
    windows = tuple(model_config.layer_window(i) for i in range(model_config.num_layers))
    return KVCacheSpec(
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        kv_dtype=config.kv_cache_dtype,
        block_size=config.block_size,
        layer_windows=windows if any(w is not None for w in windows) else (),
        hybrid=not config.disable_hybrid_kv_cache_manager,
        group_size=config.kv_quant_group_size,
        residual=config.kv_quant_residual,
        residual_dtype=config.dtype,
        sink_block=config.kv_quant_sink_block,
    )


KV_SCALE_RANGE = (1e-6, 1e6)  # an fp8 scale outside it turns every value into 0 or into the format's largest


def kv_scales(config: EngineConfig, spec: KVCacheSpec) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Calibrated fp8 scales, (K, V) per layer of [kv_heads], from the JSON file --kv-cache-scales."""
    if config.kv_cache_scales is None:
        return None
    path = Path(config.kv_cache_scales)
    shape = f"k_scale and v_scale, each {spec.num_layers} layers x {spec.num_kv_heads} heads of positive numbers"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--kv-cache-scales {path}: {exc} (a JSON file of {shape})") from None
    if not isinstance(raw, dict) or not all(isinstance(raw.get(name), list) for name in ("k_scale", "v_scale")):
        raise ValueError(f"--kv-cache-scales {path}: expected an object with {shape}")

    def rows(name: str) -> list[torch.Tensor]:
        layers = raw[name]
        ok = len(layers) == spec.num_layers and all(
            isinstance(row, list) and len(row) == spec.num_kv_heads
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in row) for row in layers
        )  # fmt: skip
        if not ok:
            raise ValueError(f"--kv-cache-scales {path}: {name} must be {spec.num_layers} layers x {spec.num_kv_heads} heads of numbers")
        return [torch.tensor(row, dtype=torch.float32) for row in layers]

    pairs = list(zip(rows("k_scale"), rows("v_scale")))
    low, high = KV_SCALE_RANGE
    if any(not bool(torch.all((t >= low) & (t <= high))) for pair in pairs for t in pair):
        raise ValueError(f"--kv-cache-scales {path}: scales must be finite numbers in [{low:g}, {high:g}]")
    return pairs


def checkpoint_digests(path: Path) -> tuple[str, str]:
    """(weights, tokenizer) content digests of a GGUF file (both inside it) or an HF directory."""
    if path.is_file():
        digest = file_digest(path)
        return digest, digest
    weights = [p for p in path.iterdir() if p.suffix in (".safetensors", ".json") and not p.name.startswith("tokenizer")]
    tokenizer = [p for p in path.iterdir() if p.name.startswith(("tokenizer", "special_tokens")) or p.suffix in (".model", ".jinja")]
    return tree_digest(weights), tree_digest(tokenizer)


NO_TOKENIZER = "this engine has no tokenizer (--skip-tokenizer-init, or no tokenizer files beside the weights): send token ids, not text"


def kv_asked(config: EngineConfig) -> str:
    """The flag that sized the pool, as errors name it."""
    return f"num_kv_blocks={config.num_kv_blocks}" if config.num_kv_blocks else f"kv_cache_memory={config.kv_cache_memory:g} GiB"


def kv_capacity(config: EngineConfig, model_config: ModelConfig, spec: KVCacheSpec) -> tuple[int, int]:
    """(blocks in the pool, longest sequence): the engine's refusals of a pool and lengths that
    cannot work, from configs alone (`kvserve eval` checks every configuration before running one)."""
    device = torch.device(config.device)
    flag = "num_kv_blocks" if config.num_kv_blocks else "kv_cache_memory"
    num_blocks = config.num_kv_blocks or spec.num_blocks_for_memory(config.kv_cache_memory * GIB)
    if num_blocks <= 0:
        raise ValueError(f"kv_cache_memory={config.kv_cache_memory} GiB holds no block of {spec.bytes_per_block} bytes")
    available = device_memory_bytes(device)
    if available is not None and num_blocks * spec.bytes_per_block > available:
        raise ValueError(f"{kv_asked(config)} is more than this {device.type} device gives this process in all ({available / GIB:.1f} GiB); "
                         "`kvserve plan` says what fits beside the weights")  # fmt: skip
    limit = model_config.max_position_embeddings
    capacity = spec.max_tokens(num_blocks, config.max_num_batched_tokens, limit)
    max_model_len = capacity if config.max_model_len is None else config.max_model_len
    if config.max_model_len is not None:
        if max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context length {limit}")
        if max_model_len > capacity:
            raise ValueError(f"max_model_len={max_model_len} exceeds the KV cache capacity of {capacity} tokens for one sequence "
                             f"({num_blocks} blocks); raise {flag} or lower max_model_len")  # fmt: skip
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2 (a prompt token and a generated one), got {max_model_len}")
    if max_model_len < 2:
        raise ValueError(f"the KV cache ({num_blocks} blocks) cannot hold a sequence of two tokens; raise {flag}")
    return num_blocks, max_model_len


class LLMEngine:
    # tests only: called with each step's batch before the forward pass, to raise inside a step
    step_fault_hook: Callable[[ScheduledBatch], None] | None = None

    def __init__(self, config: EngineConfig) -> None:
        if config.threads is not None:
            torch.set_num_threads(config.threads)  # torch's OpenMP runtime, which the native kernels share (kernels/build.py)
        path = resolve_model_path(config.model)
        checkpoint = load_checkpoint(path, resolve_weight_format(path, config.weight_dtype, config.device, config.dtype))
        tokenizer = None if config.skip_tokenizer_init else load_tokenizer(path, checkpoint.config.architecture)
        backend = resolve_attention_backend(config.attention_backend, torch.device(config.device), DTYPES[config.kv_cache_dtype]
                                            if config.kv_cache_dtype in DTYPES else config.torch_dtype)  # fmt: skip
        weights, tokenizer_digest = checkpoint_digests(path)
        self._setup(config, checkpoint.config, tokenizer,
                    CacheIdentity(model=weights, tokenizer=tokenizer_digest, **self._identity_fields(config, checkpoint.config, backend,
                                                                                                    checkpoint.weight_format)))  # fmt: skip
        with fitting(self.device, kv_asked(config)):
            self.model = build_model(checkpoint, config.torch_dtype, self.device, self.max_model_len)
            self.weight_format = checkpoint.weight_format  # "gguf": the file's blocks; "float": --dtype copies
            self.pool = PagedKVPool(self.kv_spec, self.kv.num_blocks, self.device, kv_scales(config, self.kv_spec),
                                    key_centering=config.centers_keys, rotate=self.rotates_kv)  # fmt: skip
            if backend == "cpu_paged":
                self.model.enable_native_kernels()
        if config.centers_keys:
            self._center_keys(checkpoint.config.vocab_size)
        self._attach_tiers(config)
        attention = create_backend(backend, self.pool)
        self.runner = ModelRunner(self.model, attention, self.kv, self.device, Sampler(native=backend == "cpu_paged"))

    def weights_description(self) -> str:
        """How the weights are held, for start-up lines: "GGUF blocks", "int8 (Q8_0 blocks)" or the dtype of their copies."""
        return {"gguf": "GGUF blocks", "int8": "int8 (Q8_0 blocks)"}.get(getattr(self, "weight_format", "float"), self.config.dtype)

    def _center_keys(self, vocab_size: int) -> None:
        """Calibrate the int8 / fp8 key centers (kv/centering.py) before anything is stored. They
        depend on max_model_len, the tokenizer and the calibration text's version, so their digest
        joins the cache identity: no block moves between caches centered differently."""
        count = min(CALIBRATION_TOKENS, self.max_model_len)
        tokens = calibration_tokens(self.tokenizer, vocab_size, count)
        centers = key_centers(self.model, tokens, self.device, self.max_model_len, self.kv_spec.kv_dtype)
        if self.pool.rotation is not None:  # measured on the model's keys: stored keys are rotated
            centers = [self.pool.rotation.forward(c.float()) for c in centers]
        self.pool.set_key_centers(centers)
        digest = xxhash.xxh3_64_hexdigest(self.pool.key_centers.cpu().numpy().tobytes())
        self.cache_identity = dataclasses.replace(
            self.cache_identity, kv_quantization=f"{self.cache_identity.kv_quantization} {digest}"
        )  # fmt: skip
        if self.kv.prefix_cache is not None:
            self.kv.prefix_cache.root = root_hash(self.cache_identity)  # nothing is cached yet
        if self.kv.offloader is not None:
            self.kv.offloader.identity = root_hash(self.cache_identity)

    def _attach_tiers(self, config: EngineConfig) -> None:
        """The host and disk tiers under the pool (kv/tiers/), keyed by this cache's identity."""
        stores: list = []
        if config.kv_offload_host_gib > 0:
            stores.append(HostStore(int(config.kv_offload_host_gib * GIB)))
        if config.kv_offload_disk_dir is not None:
            stores.append(DiskStore(config.kv_offload_disk_dir, int(config.kv_offload_disk_gib * GIB)))
        if config.kv_remote_url is not None:
            stores.append(RemoteStore(config.kv_remote_url, config.kv_remote_timeout_ms, config.kv_remote_ttl, config.kv_remote_ca_file))
        if stores:
            self.kv.offloader = KVOffloader(stores, root_hash(self.cache_identity), self.pool.block_bytes, self.pool.write_block_bytes,
                                            config.kv_offload_policy, write_remote=config.kv_role != "consumer")  # fmt: skip

    def tiers_description(self) -> str:
        """', KV tiers: host 4 GiB, disk /var/kv 50 GiB (write_back)', or '' without tiers (the serve banner)."""
        offloader = self.kv.offloader
        if offloader is None:
            return ""
        parts = [f"{s.name} {s.usage().capacity_bytes / GIB:g} GiB" if s.name == "host" else
                 f"remote {s.url}" if s.shared else
                 f"{s.name} {getattr(s, 'directory', '')} {s.usage().capacity_bytes / GIB:g} GiB" for s in offloader.stores]  # fmt: skip
        return f", KV tiers: {', '.join(parts)} ({offloader.policy})"

    @classmethod
    def simulated(cls, config: EngineConfig, model_config: ModelConfig) -> "LLMEngine":
        """The same scheduler and block manager with no model: every step "samples" a fixed token.

        `kvserve plan --replay` drives this, so whatever the cache manager and scheduler learn
        (prefix reuse, quantized dtypes, sliding-window groups) shows up in the replay as well.
        """
        engine = cls.__new__(cls)
        identity = CacheIdentity(model=config.model, **cls._identity_fields(config, model_config, "simulated"))
        engine._setup(config, model_config, None, identity)
        engine.model = engine.pool = None
        engine.runner = SimulatedRunner()
        return engine

    @staticmethod
    def _identity_fields(config: EngineConfig, model_config: ModelConfig, backend: str, weight_format: str = "float") -> dict:
        return {
            # GGUF blocks compute in float32 from the exact dequantized values: other K/V than --dtype weights
            "dtype": config.dtype if weight_format == "float" else f"{config.dtype}/weights {weight_format}",
            "kv_cache_dtype": config.kv_cache_dtype,
            "attention": f"{backend}/block {config.block_size}/hybrid {not config.disable_hybrid_kv_cache_manager}",
            "kv_quantization": f"group {config.kv_quant_group_size}/residual {config.kv_quant_residual}/sink {config.kv_quant_sink_block}"
                               f"/scales {config.kv_cache_scales}"
                               + ("/keys centered" if config.centers_keys else "") + f"/hadamard {config.rotates_kv(model_config.head_dim)}",
        }  # fmt: skip

    def _setup(self, config: EngineConfig, model_config: ModelConfig, tokenizer, identity: CacheIdentity) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.model_config = model_config
        self.tokenizer = tokenizer
        self._generic_question = tokenizer.encode(GENERIC_QUESTION, add_special_tokens=False) if tokenizer is not None else []
        self.kv_spec = kv_cache_spec(config, model_config)
        self.rotates_kv = config.rotates_kv(self.kv_spec.head_dim)
        if self.rotates_kv and not is_power_of_two(self.kv_spec.head_dim):
            raise ValueError(f"--kv-hadamard needs a power-of-two head dim; {config.model} has {self.kv_spec.head_dim}")
        num_blocks, self.max_model_len = kv_capacity(config, model_config, self.kv_spec)
        self.cache_identity = identity
        prefix_cache = None
        if config.enable_prefix_caching:
            kind = RadixPrefixCache if config.prefix_cache == "radix" else HashPrefixCache
            prefix_cache = kind(self.kv_spec.groups, config.block_size, root_hash(identity))
        self.kv = KVCacheManager(self.kv_spec, num_blocks, blocks_for_tokens(self.max_model_len, config.block_size), prefix_cache)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len), self.kv
        )
        eos = set(model_config.eos_token_ids)
        if tokenizer is not None:
            eos |= set(tokenizer.extra_stop_token_ids())
            if tokenizer.eos_token_id is not None:
                eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.grammars = None if tokenizer is None else GrammarCompiler(tokenizer.hf_tokenizer, model_config.vocab_size, self.eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._seeds = random.Random(config.seed)  # seeds of requests that bring none
        self.num_steps = 0
        self._handing_over: list[tuple[Future, RequestOutput]] = []  # a producer's finished requests, until their blocks are stored
        self.handovers_published = 0
        self.migrations = {"out": 0, "in": 0, "failed": 0, "records_rejected": 0}
        self.num_evicted_tokens = 0
        self.num_probe_tokens = 0  # snapkv's generic question: tokens computed to score prompts, then dropped
        self.num_compactions = 0
        self.eviction_policy(SamplingParams())  # refuses an engine-wide --kv-compression the model cannot take
        self.peak_num_blocks_used = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        stream: bool = False,
        queue: bool = True,
        compress_at: int | None = None,
    ) -> Sequence:
        """Queue a request. With ``stream``, step() hands out an output for it every step holding
        only what is new; otherwise only its finished output. A compressing request compresses its
        first `compress_at` prompt tokens before it computes the rest (None: the whole prompt), so
        what follows, a question say, is read against the compressed cache."""
        validate_cache_salt(cache_salt)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError(NO_TOKENIZER)
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("prompt holds an unpaired surrogate (\\ud800-\\udfff): not valid Unicode text") from None
            prompt_text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            prompt_text, token_ids = None, list(prompt)
        self.validate_prompt_tokens(token_ids)
        if compress_at is not None and (isinstance(compress_at, bool) or not isinstance(compress_at, int)
                                        or not 1 <= compress_at <= len(token_ids)):  # fmt: skip
            raise ValueError(f"compress_at must be a number of prompt tokens in [1, {len(token_ids)}], got {compress_at!r}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(64)
        text = None
        if self.tokenizer is not None:
            text = OutputText(self.tokenizer.incremental_detokenizer(), params.stop, params.include_stop_str_in_output)
        seq = Sequence(request_id, token_ids, params, prompt=prompt_text, cache_salt=cache_salt, seed=seed, text=text, stream=stream,
                       eviction=self.eviction_policy(params), compress_at=compress_at, grammar=self._grammar(params))  # fmt: skip
        self.requests[request_id] = seq
        if queue:
            self.scheduler.add(seq)
        return seq

    def _grammar(self, params: SamplingParams, output_token_ids: Seq[int] = ()):
        """A matcher of the request's structured outputs (None without), past the output tokens given."""
        if params.structured_outputs is None:
            return None
        if self.grammars is None:
            raise ValueError("structured outputs need the model's tokenizer: this model has none (token ids only)")
        matcher = self.grammars.matcher(params.structured_outputs)
        for token in output_token_ids:
            if not matcher.accept_token(token):
                raise ValueError(f"the output so far does not follow the request's {params.structured_outputs.description} (token {token})")
        return matcher

    def add_request_group(
        self, prompt: str | list[int], params: Seq[SamplingParams], request_ids: Seq[str] | None = None, cache_salt: str | None = None,
        stream: bool = False,
    ) -> list[Sequence]:
        """n samples of one prompt (parallel sampling): the prompt is computed once, by the first;
        the others share its blocks from there, the partly filled last block copied per sample."""
        if not params:
            raise ValueError("a request group needs at least one SamplingParams")
        ids = list(request_ids) if request_ids is not None else [None] * len(params)
        if len(ids) != len(params):
            raise ValueError(f"got {len(ids)} request ids for {len(params)} samples")
        first = self.add_request(prompt, params[0], ids[0], cache_salt, stream)
        seqs = [first]
        for sp, rid in zip(params[1:], ids[1:]):
            seq = self.add_request(first.prompt_token_ids, sp, rid, cache_salt, stream, queue=False)
            seq.prompt = first.prompt
            if first.eviction is not None:  # each sample compacts its own blocks in place: none are shared
                self.scheduler.add(seq)
            else:
                self.scheduler.add_fork(first, seq)
            seqs.append(seq)
        return seqs

    def score(self, token_ids: list[int], cache_salt: str | None = None, chunk: int | None = None,
              compress_at: int | None = None) -> torch.Tensor:  # fmt: skip
        """The last layer's hidden state at every position of token_ids [T, hidden] (the logits of
        position i, model.compute_logits of row i, predict token i + 1), computed through the KV
        cache as a prompt is: in chunks of --max-num-batched-tokens (or `chunk`, when smaller),
        each reading the cache of the ones before. Small chunks score the text as decoding reads
        it: a KIVI cache quantizes the tokens that leave its residual window between steps.
        With `compress_at`, an engine with --kv-compression compresses the first compress_at
        tokens before it computes the rest (a streaming cache keeps evicting as the rest goes by),
        so the positions after it are scored against the compressed cache; without, nothing is
        compressed. Steps the engine until done; other requests step along."""
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk must be at least 1, got {chunk}")
        if isinstance(compress_at, int) and not isinstance(compress_at, bool) and compress_at >= len(token_ids):  # else add_request says why
            raise ValueError(f"compress_at {compress_at} leaves none of the {len(token_ids)} tokens to score after it")
        seq = self.add_request(list(token_ids), SamplingParams(max_tokens=1, temperature=0), cache_salt=cache_salt,
                               compress_at=compress_at)  # fmt: skip
        seq.captured = []
        seq.max_chunk = chunk
        if compress_at is None:
            seq.eviction = None  # compression follows a prefill, and scoring ends with it
        if seq.num_computed_tokens:
            raise ValueError("score() needs the whole text computed")
        while not seq.is_finished:
            self.step()
        hidden = torch.cat(seq.captured)
        if hidden.shape[0] != len(token_ids):
            raise RuntimeError(f"scored {hidden.shape[0]} of {len(token_ids)} positions (a prefix-cache hit skips positions: "
                               "score with prefix caching off, or another cache_salt)")  # fmt: skip
        return hidden

    # ------------------------------------------------------------------ live migration
    def export_request(self, request_id: str, with_records: bool = True) -> RequestState:
        """A running or waiting request's state (engine/migration.py), after which it leaves this
        engine (no output): its blocks stay in the prefix cache, so importing the state here again
        resumes it cheaply. With `with_records`, the KV of its cached blocks travels in the state;
        with a remote tier it is there already (this waits until what was sent has landed)."""
        seq = self.requests.get(request_id)
        if seq is None:
            raise KeyError(request_id)
        if seq.eviction is not None or seq.captured is not None:
            raise ValueError("a request with kv_compression (or a scoring one) cannot migrate: its cache is not a prefix chain")
        if seq.params.prompt_logprobs is not None:
            raise ValueError("a request with prompt logprobs (echo with logprobs) cannot migrate: its scores stay here")
        identity = root_hash(self.cache_identity)
        records = []
        if with_records and self.pool is not None:
            records = [encode_record(BlockRecord(b.block_hash, b.group, b.token_ids, self.pool.block_bytes(b.block_id)), identity)
                       for b in self.kv.published_blocks(request_id)]  # fmt: skip
        state = RequestState(list(seq.prompt_token_ids), list(seq.output_token_ids), seq.params, seq.seed, identity, seq.cache_salt,
                             seq.prompt, seq.stream, list(seq.logprobs), seq.num_cached_tokens, records)  # fmt: skip
        self.requests.pop(request_id)
        self.scheduler.finish(seq)
        if self.kv.offloader is not None and self.kv.offloader.writes_remote:
            self.kv.offloader.flushed().result(timeout=60)
        self.migrations["out"] += 1
        return state

    def check_import(self, state: RequestState) -> None:
        """Whether this engine can continue the request exactly (ValueError saying why not); changes nothing."""
        if state.identity != root_hash(self.cache_identity):
            raise ValueError("the request was exported by an engine with another model, dtype or KV settings")
        validate_cache_salt(state.cache_salt)
        self.validate_prompt_tokens(state.prompt_token_ids)
        tokens = [*state.prompt_token_ids, *state.output_token_ids]
        if any(t >= self.model_config.vocab_size for t in state.output_token_ids):
            raise ValueError(f"output token ids must be in [0, {self.model_config.vocab_size})")
        if len(tokens) >= self.max_model_len or len(state.output_token_ids) >= state.params.max_tokens:
            raise ValueError("the request has no tokens left to generate")
        if len(state.logprobs) != (len(state.output_token_ids) if state.params.logprobs is not None else 0):
            raise ValueError("the request's logprobs do not match its output tokens")
        if self.eviction_policy(state.params) is not None:
            raise ValueError("this engine compresses the request's cache (--kv-compression): it cannot continue it exactly")
        if len(state.prompt_token_ids) + state.params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens={state.params.max_tokens} plus the prompt's {len(state.prompt_token_ids)} tokens exceeds "
                             f"max_model_len={self.max_model_len}")  # fmt: skip
        if len(state.records) > self.max_migrated_records(len(tokens)):
            raise ValueError(f"{len(state.records)} KV records are more than {len(tokens)} tokens have blocks")

    def max_migrated_records(self, num_tokens: int) -> int:
        """The most block records a migrated request of num_tokens tokens can carry (one per group per block)."""
        return (num_tokens // self.kv.block_size + 1) * len(self.kv.groups)

    def max_migration_bytes(self) -> int:
        """The largest state (engine/migration.py) a request can need here: its JSON and its records."""
        records, spec = self.max_migrated_records(self.max_model_len), self.kv_spec
        # a KIVI cache's sink blocks travel in full precision: up to residual_units quantized blocks' bytes
        sink_bytes = spec.quant_sink_blocks * len(self.kv.groups) * max(spec.residual_units - 1, 0) * spec.bytes_per_block
        return MAX_STATE_BYTES + records * (4 + spec.bytes_per_block + record_overhead(self.kv.block_size)) + sink_bytes

    def decode_records(self, state: RequestState) -> list[BlockRecord]:
        """The state's KV records that pass their checks (the others are counted, then recomputed);
        pure, so a server runs it off the engine thread."""
        records = []
        for data in state.records:
            try:
                records.append(decode_record(data, state.identity, record_key(*record_head(data))))
            except (CorruptRecord, ValueError):
                self.migrations["records_rejected"] += 1
        return records

    def import_request(self, state: RequestState, request_id: str | None = None, records: list[BlockRecord] | None = None,
                       returning: bool = False) -> Sequence:  # fmt: skip
        """Continue a request exported by an engine with the same model and KV settings: its blocks
        (the records in the state, else the tiers, else recomputed) and its draws go on where they
        were, so it produces the tokens it would have produced there. Its outputs hold what is new."""
        self.check_import(state)
        tokens = [*state.prompt_token_ids, *state.output_token_ids]
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if records is None:
            records = self.decode_records(state)
        if records and self.pool is not None:
            self.kv.adopt_blocks(tokens, state.cache_salt, records, self.pool.write_block_bytes)
        text = None
        if self.tokenizer is not None:
            text = OutputText(self.tokenizer.incremental_detokenizer(), state.params.stop, state.params.include_stop_str_in_output)
            for token in state.output_token_ids:
                text.add(token)
            text.take_new()  # handed out at the source
        seq = Sequence(request_id, list(state.prompt_token_ids), state.params, prompt=state.prompt, cache_salt=state.cache_salt,
                       seed=state.seed, text=text, stream=state.stream, migrated=True,
                       grammar=self._grammar(state.params, state.output_token_ids))  # fmt: skip
        for token in state.output_token_ids:
            seq.append_token(token)
        seq.logprobs = list(state.logprobs)
        seq.num_sent_tokens = len(state.output_token_ids)
        seq.num_cached_tokens = state.num_cached_tokens
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        if not returning:  # a request back from a failed migration counts as failed, not as in
            self.migrations["in"] += 1
        return seq

    def validate_prompt_tokens(self, token_ids: Seq[int]) -> None:
        if len(token_ids) == 0:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            got = f"{type(bad).__name__} {bad!r}" if not isinstance(bad, int) or isinstance(bad, bool) else repr(bad)
            raise ValueError(f"prompt token ids must be Python ints in [0, {vocab}), got {got}"
                             + (" (numpy ids: pass .tolist())" if type(bad).__module__ == "numpy" else ""))  # fmt: skip
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}; "
                "it must leave room for at least one generated token"
            )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        seq.finished_time = time.monotonic()
        return self._output(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._handing_over)

    @property
    def hands_over(self) -> bool:
        """A producer (--kv-role): a finished request is answered once its blocks are in the remote tier."""
        return self.config.kv_role == "producer" and self.kv.offloader is not None and self.kv.offloader.writes_remote

    def _handed_over(self) -> list[RequestOutput]:
        """The producer's finished requests whose blocks the remote tier now holds."""
        if not self._handing_over:
            return []
        done = [output for stored, output in self._handing_over if stored.done()]
        self._handing_over = [(stored, output) for stored, output in self._handing_over if not stored.done()]
        if self.kv.offloader.remote.up:  # during an outage the blocks did not get there: the consumer recomputes
            self.handovers_published += len(done)
        return done

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """One scheduler step and one forward pass; returns the outputs of streamed sequences that got
        a token and of every sequence that finished. An exception inside the step fails that step's
        sequences alone (finish_reason "error", blocks freed); the engine goes on."""
        handed_over = self._handed_over()
        batch = self.scheduler.schedule()
        if not batch:
            pending = self.scheduler.pending_loads() + [stored for stored, _ in self._handing_over]
            if pending and not handed_over:  # only requests waiting for a tier: wait a little for one
                self.kv.offloader.wait(pending, 0.005)
            elif not pending and self.scheduler.waiting and not self.scheduler.running and self.kv.num_free_blocks == self.kv.num_blocks:
                return handed_over + self._refuse_head()
            return handed_over
        try:
            return handed_over + self._run_batch(batch)
        except Exception as exc:  # noqa: BLE001 - isolated to this step's requests
            return handed_over + self._fail_batch(batch, exc)

    def _refuse_head(self) -> list[RequestOutput]:
        """The first waiting request is not admitted into an empty pool, so it never would be: it
        fails (finish_reason "error") instead of the engine spinning with every request behind it.
        --max-model-len is sized so this should not happen; this is the backstop."""
        seq = self.scheduler.waiting[0]
        log.error("request %s (%d tokens) does not fit the empty KV pool; failing it", seq.request_id, seq.num_tokens)
        self.requests.pop(seq.request_id, None)
        self.scheduler.finish(seq)
        seq.finish_reason, seq.finished_time = "error", time.monotonic()
        out = self._output(seq)
        out.error = f"the KV cache ({self.kv.num_blocks} blocks) cannot hold this request's {seq.num_tokens} tokens even alone"
        return [out]

    def _fail_batch(self, batch: ScheduledBatch, exc: Exception) -> list[RequestOutput]:
        log.error("engine step %d failed (%s: %s); failing its %d requests", self.num_steps, type(exc).__name__, exc,
                  len(batch.entries), exc_info=exc)  # fmt: skip
        now = time.monotonic()
        outputs = []
        for seq, _ in batch.entries:
            self.requests.pop(seq.request_id, None)
            if not seq.is_finished:
                self.scheduler.finish(seq)
            seq.finish_reason, seq.finished_time = "error", now
            out = self._output(seq)
            out.error = f"{type(exc).__name__}: {exc}"
            outputs.append(out)
        return outputs

    def _run_batch(self, batch: ScheduledBatch) -> list[RequestOutput]:
        self.num_steps += 1
        self.peak_num_blocks_used = max(self.peak_num_blocks_used, self.kv.num_blocks - self.kv.num_free_blocks)
        now = time.monotonic()
        for seq, _ in batch.entries:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                self.prompt_tokens_total += seq.prompt_len
        copies = self.kv.take_copies()
        try:
            if copies and self.pool is not None:
                for source, target, slots in copies:
                    self.pool.copy_slots(source.block_id, target.block_id, slots)
        finally:
            self.kv.release_copy_sources(copies)
        if self.step_fault_hook is not None:
            self.step_fault_hook(batch)
        started = time.perf_counter()
        sampled = self.runner.execute(batch)
        if self.kv.offloader is not None:
            prefill = sum(n for _, n in batch.entries if n > 1)
            if prefill >= 64 and prefill >= 0.9 * batch.num_tokens:
                self.kv.offloader.observe_prefill(prefill, time.perf_counter() - started)
        for seq, n in batch.entries:
            seq.num_computed_tokens += n
            self.kv.publish_full_precision(seq.request_id, seq.token_ids, seq.num_computed_tokens)
            self.kv.plan_quantization(seq.request_id, seq.num_computed_tokens)
        pairs = self.kv.take_quantization()
        if pairs and self.pool is not None:
            self.pool.quantize([(residual.block_id, target.block_id) for residual, target in pairs])
        self.kv.release_quantized(pairs)
        for seq, _ in batch.entries:
            if seq.eviction is None:
                self.kv.cache_blocks(seq.request_id, seq.token_ids, seq.num_computed_tokens)
            else:
                self._evict(seq)
            self.kv.free_unreachable(seq.request_id, seq.num_computed_tokens if seq.probe is None else seq.probe_from)
        outputs = []
        if sampled:
            now = time.monotonic()
            for seq, result in sampled:
                if seq.status is SequenceStatus.FORKING:
                    self.scheduler.start_fork(seq)
                if result.token_id is None:  # its grammar allows no token
                    self._finish(seq, "stop", now, stop_reason="grammar")
                else:
                    self._append_token(seq, result.token_id, now)
                if result.logprobs is not None:
                    seq.logprobs.append(result.logprobs)
                if seq.is_finished:
                    self.requests.pop(seq.request_id, None)
                    if self.hands_over:
                        self._handing_over.append((self.kv.offloader.flushed(), self._output(seq)))
                        continue
                if seq.stream or seq.is_finished:
                    outputs.append(self._output(seq))
        return outputs

    # ------------------------------------------------------------------ KV eviction
    def eviction_policy(self, params: SamplingParams) -> EvictionPolicy | None:
        """The engine's --kv-compression with the request's overrides; None when it evicts nothing."""
        policy = self.config.eviction
        if params.snapkv_query is not None:
            if (params.kv_compression or policy.method) != "snapkv":
                raise ValueError(f"snapkv_query needs kv_compression snapkv (this request's is {params.kv_compression or policy.method})")
            policy = dataclasses.replace(policy, query=params.snapkv_query)
        if params.kv_compression is not None or params.kv_keep_ratio is not None:
            method = params.kv_compression or policy.method
            if method == "none" and params.kv_keep_ratio is not None:
                raise ValueError("kv_keep_ratio needs kv_compression (snapkv, streaming or random): the engine compresses nothing")
            if method != "none" and params.kv_keep_ratio is None and policy.keep_ratio is None and policy.budget is None:
                raise ValueError(f"kv_compression {method} needs kv_keep_ratio (the engine has no --kv-keep-ratio or --kv-budget)")
            ratio, budget = (params.kv_keep_ratio, None) if params.kv_keep_ratio is not None else (policy.keep_ratio, policy.budget)
            policy = dataclasses.replace(policy, method=method, keep_ratio=ratio, budget=budget)
        if not policy.active:
            return None
        if self.kv_spec.layer_windows and all(w is not None for w in self.kv_spec.layer_windows):
            raise ValueError(f"kv_compression {policy.method}: every layer of {self.config.model} has a sliding window, and "
                             "compression applies to full-attention layers (a sliding window already bounds the others)")  # fmt: skip
        if policy.asks_generic_question and self.tokenizer is None:
            raise ValueError(f"snapkv_query {policy.query} writes its generic question with the tokenizer, and this engine has "
                             "none (--skip-tokenizer-init, or no tokenizer files beside the weights): use snapkv_query window "
                             "(--snapkv-query window; both is --snapkv-query's default)")  # fmt: skip
        if self.kv_spec.format.kind == "kivi":
            raise ValueError(f"kv_compression does not work with --kv-cache-dtype {self.kv_spec.kv_dtype}")
        return policy

    def _evict(self, seq: Sequence) -> None:
        """Compress a prompt computed up to its compression point (its end, or `compress_at`); a
        streaming sequence again each time it holds a block more than its budget."""
        policy, n = seq.eviction, seq.num_computed_tokens
        if self.pool is None:
            return
        if seq.probe is not None:  # the generic question is computed: drop it, compress with its scores
            if n < seq.num_tokens:
                return
            self.kv.truncate(seq.request_id, seq.probe_from)
            self.num_probe_tokens += len(seq.probe)
            seq.num_computed_tokens = n = seq.probe_from
            seq.probe = None
        elif not seq.eviction_started:
            if n < seq.compression_point:
                return
            if policy.asks_generic_question and policy.tokens_kept(n) < n:
                probe = self._generic_question[: self.max_model_len - n]  # its positions stay below max_model_len
                if seq.window_scores is None:  # "both" adds the question's scores to the window's
                    seq.window_scores = torch.zeros(self.kv_spec.num_layers, self.kv_spec.num_kv_heads, n, device=self.device)
                if probe:
                    seq.probe, seq.probe_from = probe, n
                    return
        held = n - self.kv.num_evicted(seq.request_id)
        kept = policy.tokens_kept(n)
        scores = None
        if not seq.eviction_started:
            seq.eviction_started = True
            scores, seq.window_scores = seq.window_scores, None
        elif policy.method != "streaming" or held < kept + self.kv.block_size:
            return
        if kept >= held:
            return
        spec = self.kv_spec
        if policy.method == "streaming":
            keep = sink_and_recent(held, kept, policy.sinks).expand(spec.num_layers, spec.num_kv_heads, kept)
        else:
            if policy.method == "random":
                draws = torch.Generator().manual_seed(seq.seed % 2**63)
                scores = torch.rand(held, generator=draws).expand(spec.num_layers, spec.num_kv_heads, held)
            keep = top_positions(scores[..., :held], kept, policy.window, policy.kernel)
        targets = {}
        for g, group in enumerate(self.kv.groups):
            if group.window is not None:
                continue  # a sliding window already keeps only the recent tokens; its slots stay positions
            slices = [spec.layer_slots[layer][1] for layer in group.layers]
            targets[g] = self.kv.compaction_targets(seq.request_id, g, kept)
            self.pool.compact(self.kv.block_table(seq.request_id, g), slices, keep[list(group.layers)], [b.block_id for b in targets[g]])
        self.kv.evict(seq.request_id, n, kept, targets)
        self.num_evicted_tokens += held - kept
        self.num_compactions += 1

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        seq.append_token(token)
        self.generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        params = seq.params
        reason = None
        if seq.grammar is not None and not seq.grammar.accept_token(token):
            raise RuntimeError(f"request {seq.request_id} drew token {token}, which its grammar forbids")
        if not params.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif token in params.stop_token_ids:
            reason, seq.stop_reason = "stop", token
        elif seq.grammar is not None and seq.grammar.is_terminated():
            reason = "stop"
        if seq.text is not None:
            stop = seq.text.add(token)
            if reason is None and stop is not None:
                reason, seq.stop_reason = "stop", stop
        if reason is None and (seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len):
            reason = "length"
        if reason is not None:
            self._finish(seq, reason, now)

    def _finish(self, seq: Sequence, reason: str, now: float, stop_reason: str | int | None = None) -> None:
        seq.finish_reason = reason
        if stop_reason is not None:
            seq.stop_reason = stop_reason
        seq.finished_time = now
        self.scheduler.finish(seq)

    def _output(self, seq: Sequence) -> RequestOutput:
        finished = seq.is_finished
        if finished and seq.text is not None:
            seq.text.finish()
        if seq.stream:
            token_ids = seq.token_ids[seq.prompt_len + seq.num_sent_tokens :]
            logprobs = seq.logprobs[seq.num_sent_tokens :] if seq.params.logprobs is not None else None
            text = seq.text.take_new() if seq.text is not None else ""
            seq.num_sent_tokens = seq.num_output_tokens
        else:
            token_ids = seq.output_token_ids
            logprobs = list(seq.logprobs) if seq.params.logprobs is not None else None
            text = seq.text.text if seq.text is not None else ""
        metrics = {"arrival_time": seq.arrival_time}
        for name in ("first_scheduled_time", "first_token_time", "last_token_time", "finished_time"):
            value = getattr(seq, name)
            if value is not None:
                metrics[name] = value
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=token_ids,
            text=text,
            finished=finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=logprobs,
            prompt_logprobs=seq.prompt_logprobs,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=metrics,
            num_output_tokens=seq.num_output_tokens,
            delta=seq.stream,
        )

    # ------------------------------------------------------------------ introspection
    def prefix_cache_stats(self) -> dict:
        p = self.kv.prefix_stats
        return {
            "prefix_cache": self.kv.prefix_cache.name if self.kv.prefix_cache is not None else None,
            "prefix_cache_queries_total": p.queries,
            "prefix_cache_hits_total": p.hits,
            "prefix_cache_eligible_tokens_total": p.eligible,
            "prefix_cache_requests_total": p.requests,
            "prefix_cache_requests_hit_total": p.requests_hit,
            "prefix_cache_request_hit_rate": p.requests_hit / p.requests if p.requests else 0.0,
            "prefix_cache_reused_token_ratio": p.hits / p.eligible if p.eligible else 0.0,
            "prefix_cache_misses_total": dict(p.misses),
            "prefix_cache_evictions_total": self.kv.pool.num_evictions,
        }

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (running requests keep their blocks); returns the blocks forgotten."""
        return self.kv.reset_prefix_cache()

    @property
    def weight_dtype(self) -> str:
        """How the weights are held: "gguf" (the file's blocks), "int8" (Q8_0 blocks) or the --dtype of their copies."""
        held = getattr(self, "weight_format", "float")
        return self.config.dtype if held == "float" else held

    @functools.cached_property
    def weight_bytes(self) -> int:
        """The bytes the model's weights take as held (0 for a simulated engine): read once, they never change."""
        return weight_bytes(self.model) if self.model is not None else 0

    def stats(self) -> dict:
        return {
            "model": self.config.model,
            "dtype": self.config.dtype,
            "weight_dtype": self.weight_dtype,
            "weight_bytes": self.weight_bytes,
            "num_blocks": self.kv.num_blocks,
            "num_free_blocks": self.kv.num_free_blocks,
            "kv_cache_groups": [
                {"layers": list(group.layers), "attention": group.attention, "num_blocks": self.kv.num_blocks,
                 "num_free_blocks": self.kv.num_free_blocks, "num_used_blocks": used}
                for group, used in zip(self.kv.groups, self.kv.num_used_blocks)
            ],  # fmt: skip
            "block_size": self.kv_spec.block_size,
            "bytes_per_token": self.kv_spec.bytes_per_token,
            "scale_bytes_per_token": self.kv_spec.scale_bytes_per_token,
            # tokens of every layer the pool holds (a sliding-window model holds longer sequences: max_model_len)
            "token_capacity": self.kv.num_blocks * self.kv_spec.block_size // len(self.kv.groups),
            "kv_cache_bytes": self.kv.num_blocks * self.kv_spec.bytes_per_block,
            "kv_cache_dtype": self.kv_spec.kv_dtype,
            # int4 / int2: the full-precision blocks the pool could hold at once (they share its bytes)
            "kv_quant_residual_blocks": self.kv.residual_pool.num_blocks if self.kv.residual_pool is not None else 0,
            "kv_key_centering": self.config.centers_keys,
            "kv_hadamard": self.rotates_kv,
            "kv_quant_sink_block": bool(self.kv_spec.quant_sink_blocks),
            "kv_quant_residual_free_blocks": self.kv.residual_pool.num_free_blocks if self.kv.residual_pool is not None else 0,
            "kv_cache_usage": self.kv.usage,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_compression": self.config.kv_compression,
            "snapkv_query": self.config.snapkv_query,
            "snapkv_question_weight": self.config.snapkv_question_weight,
            "kv_evicted_tokens_total": self.num_evicted_tokens,
            "kv_compactions_total": self.num_compactions,
            "kv_probe_tokens_total": self.num_probe_tokens,
            "num_steps": self.num_steps,
            "peak_num_blocks_used": self.peak_num_blocks_used,
            "kv_cache_usage_peak": self.peak_num_blocks_used / self.kv.num_blocks,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            # prompt (and, after a preemption, output) tokens the waiting sequences still have to compute, before prefix hits
            "num_waiting_tokens": sum(len(seq.token_ids) - seq.num_computed_tokens for seq in self.scheduler.waiting),
            "max_num_seqs": self.config.max_num_seqs,
            "max_model_len": self.max_model_len,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            **self.prefix_cache_stats(),
            **(self.kv.offloader.stats() if self.kv.offloader is not None else {"kv_tiers": {}}),
            "kv_role": self.config.kv_role,
            "kv_handovers_published_total": self.handovers_published,
            "kv_migrations_total": dict(self.migrations, hit_tokens=self.scheduler.migrated_hit_tokens),
        }
