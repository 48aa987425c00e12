"""LLMEngine: model, KV pool, scheduler and sampler wired into one step loop."""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import Future
import itertools
import logging
import random
import time
from collections.abc import Callable, Sequence as Seq

import torch
import xxhash

from kvserve.attention.backend import create_backend
from kvserve.config import DTYPES, EngineConfig
from kvserve.device_memory import fitting
from kvserve.engine import beam_search, engine_stats, eviction, migrate
from kvserve.engine.beam import BeamGroup
from kvserve.engine.draft_model import DraftModel
from kvserve.engine.cache_identity import checkpoint_digests, identity_fields
from kvserve.engine.kv_setup import kv_asked, kv_cache_spec, kv_capacity, kv_scales, resolve_attention_backend
from kvserve.engine.runner import ModelRunner, SimulatedRunner
from kvserve.engine.output_text import OutputText
from kvserve.engine.sampler import SampleResult, Sampler
from kvserve.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from kvserve.engine.sequence import Sequence, SequenceStatus
from kvserve.engine.speculative import Speculator, accepted_length
from kvserve.kv.centering import CALIBRATION_TOKENS, calibration_tokens, key_centers
from kvserve.kv.eviction import GENERIC_QUESTION, CompressionRegion
from kvserve.kv.rotation import is_power_of_two
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pool import PagedKVPool
from kvserve.kv.hashing import CacheIdentity, root_hash, validate_cache_salt
from kvserve.kv.conversation_pins import ConversationKVConfig
from kvserve.lora.manager import LoRAHandle, LoRAManager
from kvserve.lora.request import LoRARequest
from kvserve.heap import release_free_heap
from kvserve.kv.prefix import HashPrefixCache
from kvserve.kv.radix import RadixPrefixCache
from kvserve.kv.tiers import DiskStore, HostStore
from kvserve.kv.tiers.budgets import check_tier_budgets, warn_tier_budgets
from kvserve.kv.tiers.offload import KVOffloader
from kvserve.kv.tiers.remote import RemoteStore, masked_url
from kvserve.kv.tiers.signing import KEY_ENV, load_signer
from kvserve.kv.spec import GIB, blocks_for_tokens
from kvserve.model.config import ModelConfig
from kvserve.model.loader import build_model, load_checkpoint, resolve_gguf_activations, resolve_weight_format
from kvserve.model.weight_bytes import weight_bytes
from kvserve.model.registry import resolve_model_path
from kvserve.model.tokenizer import load_tokenizer
from kvserve.outputs import RequestOutput, request_output
from kvserve.sampling_params import SamplingParams
from kvserve.structured.compiler import GrammarCompiler

log = logging.getLogger(__name__)


NO_TOKENIZER = "this engine has no tokenizer (--skip-tokenizer-init, or no tokenizer files beside the weights): send token ids, not text"


class LLMEngine:
    # tests only: called with each step's batch before the forward pass, to raise inside a step
    step_fault_hook: Callable[[ScheduledBatch], None] | None = None
    lora: LoRAManager | None = None  # the adapters it holds (enable_lora); none for a simulated engine

    def __init__(self, config: EngineConfig) -> None:
        if config.threads is not None:
            torch.set_num_threads(config.threads)  # torch's OpenMP runtime, which the native kernels share (kernels/build.py)
        check_tier_budgets(config.kv_offload_host_gib, config.kv_offload_disk_dir, config.kv_offload_disk_gib)
        path = resolve_model_path(config.model)
        weight_format = resolve_weight_format(path, config.weight_dtype, config.device, config.dtype)
        checkpoint = load_checkpoint(path, weight_format, resolve_gguf_activations(config.gguf_activations, weight_format, config.dtype))
        tokenizer = None if config.skip_tokenizer_init else load_tokenizer(path, checkpoint.config.architecture)
        backend = resolve_attention_backend(config.attention_backend, torch.device(config.device), DTYPES[config.kv_cache_dtype]
                                            if config.kv_cache_dtype in DTYPES else config.torch_dtype)  # fmt: skip
        weights, tokenizer_digest = checkpoint_digests(path)
        self._setup(config, checkpoint.config, tokenizer,
                    CacheIdentity(model=weights, tokenizer=tokenizer_digest, **identity_fields(config, checkpoint.config, backend,
                                                                                               checkpoint.weight_format,
                                                                                               checkpoint.activations)))  # fmt: skip
        with fitting(self.device, kv_asked(config)):
            self.model = build_model(checkpoint, config.torch_dtype, self.device, self.max_model_len)
            self.weight_format = checkpoint.weight_format  # "gguf": the file's blocks; "float": --dtype copies
            self.gguf_activations = checkpoint.activations  # how the blocks' products take their rows (resolve_gguf_activations)
            self.pool = PagedKVPool(self.kv_spec, self.kv.num_blocks, self.device, kv_scales(config, self.kv_spec),
                                    key_centering=config.centers_keys, rotate=self.rotates_kv)  # fmt: skip
            if backend == "cpu_paged":
                self.model.enable_native_kernels()
        if config.centers_keys:
            self._center_keys(checkpoint.config.vocab_size)
        self._attach_tiers(config)
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            self.speculator.draft = DraftModel(config, checkpoint.config, spec.model, spec.draft_kv_cache_memory)
        attention = create_backend(backend, self.pool)
        self.lora = None
        if config.enable_lora:
            self.model.lora_enabled = True
            self.lora = LoRAManager(checkpoint.config, config.max_loras, config.max_lora_rank, config.max_cpu_loras or config.max_loras,
                                    config.torch_dtype, self.device, native=backend == "cpu_paged")  # fmt: skip
        self.runner = ModelRunner(self.model, attention, self.kv, self.device, Sampler(native=backend == "cpu_paged"), self.lora)
        release_free_heap()  # what loading parsed and dropped (tokenizer.json, GGUF metadata) leaves the process

    def weights_description(self) -> str:
        """How the weights are held, for start-up lines: "GGUF blocks", "int8 (Q8_0 blocks)", "int4 (Q4_1 blocks)" or the dtype of their copies."""
        held = {"gguf": "GGUF blocks", "int8": "int8 (Q8_0 blocks)", "int4": "int4 (Q4_1 blocks; v, down and embedding Q8_0)"}.get(getattr(self, "weight_format", "float"), self.config.dtype)
        return held + {"int8": ", int8 rows", "bf16": ", bf16 tiles"}.get(getattr(self, "gguf_activations", "exact"), "")

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
        if stores:
            pool = self.pool.nbytes if self.device.type == "cpu" else 0
            warn_tier_budgets(config.kv_offload_host_gib, config.kv_offload_disk_dir, config.kv_offload_disk_gib, self.weight_bytes + pool)
        if config.kv_remote_url is not None:
            stores.append(RemoteStore(config.kv_remote_url, config.kv_remote_timeout_ms, config.kv_remote_ttl, config.kv_remote_ca_file))
        if stores:
            self.kv.offloader = KVOffloader(stores, root_hash(self.cache_identity), self.pool.block_bytes, self.pool.write_block_bytes,
                                            config.kv_offload_policy, write_remote=config.kv_role != "consumer",
                                            signer=self.record_signer)  # fmt: skip
        if config.kv_remote_url is not None and self.record_signer is None:
            log.warning("the shared KV tier's records are not authenticated: anyone who can write to %s can plant K/V that "
                        "this server serves as the cached prompt prefix of other users' requests. Give every engine the same "
                        "secret with --kv-remote-key-file (or %s) to sign and check them", masked_url(config.kv_remote_url),
                        KEY_ENV)  # fmt: skip

    def lora_description(self) -> str:
        """', LoRA: up to 4 adapters of rank 16 resident (29 MiB beside the KV pool)', or '' (the serve banner)."""
        if self.lora is None:
            return ""
        return (f", LoRA: up to {self.lora.max_loras} adapters of rank {self.lora.max_lora_rank} resident "
                f"({self.lora.max_resident_bytes / (1 << 20):.0f} MiB beside the KV pool)")  # fmt: skip

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
        identity = CacheIdentity(model=config.model, **identity_fields(config, model_config, "simulated"))
        engine._setup(config, model_config, None, identity)
        engine.speculator = None  # a replay runs no model: nothing to guess with or to verify
        engine.model = engine.pool = None
        engine.runner = SimulatedRunner()
        return engine

    def _setup(self, config: EngineConfig, model_config: ModelConfig, tokenizer, identity: CacheIdentity) -> None:
        self.config = config
        # signs every KV record that leaves the process (tiers, migration) and refuses unsigned ones
        self.record_signer = load_signer(config.kv_remote_key_file)
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
            prefix_cache = kind(self.kv_spec.groups, config.block_size, root_hash(identity), config.expose_salt_stats)
        self.kv = KVCacheManager(self.kv_spec, num_blocks, blocks_for_tokens(self.max_model_len, config.block_size), prefix_cache)
        self.kv.keep_conversations(ConversationKVConfig(config.conversation_kv_share, config.conversation_kv_ttl))
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len, config.prefill_step_tokens), self.kv
        )
        eos = set(model_config.eos_token_ids)
        if tokenizer is not None:
            eos |= set(tokenizer.extra_stop_token_ids())
            if tokenizer.eos_token_id is not None:
                eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        spec = config.speculative_config
        self.speculator = Speculator(spec, self.max_model_len) if spec is not None else None
        self.grammars = None if tokenizer is None else GrammarCompiler(tokenizer.hf_tokenizer, model_config.vocab_size, self.eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self.beam_groups: dict[str, BeamGroup] = {}
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
        lora_request: LoRARequest | None = None,
    ) -> Sequence:
        """Queue a request. With ``stream``, step() hands out an output for it every step holding
        only what is new; otherwise only its finished output. A compressing request compresses its
        first `compress_at` prompt tokens before it computes the rest (None: the whole prompt), so
        what follows, a question say, is read against the compressed cache. A request with a
        lora_request runs with that adapter (enable_lora); its K/V are cached under the adapter's identity."""
        validate_cache_salt(cache_salt)
        lora = self._lora_handle(lora_request)
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
        eviction = self.eviction_policy(params)
        point = compress_at or len(token_ids)
        compress_from = min(params.kv_compress_from or 0, point)  # prompt tokens: the output is its own
        if eviction is not None and eviction.method != "streaming" and (
                compress_from == point or not CompressionRegion.of(eviction, point, compress_from, self.kv.block_size).compresses(point)):
            eviction = None  # every token it would compress is shared, or too few to pay for scoring: it compresses nothing
            # (streaming: its output, as it decodes)
        seq = Sequence(request_id, token_ids, params, prompt=prompt_text, cache_salt=cache_salt, seed=seed, text=text, stream=stream,
                       eviction=eviction, compress_at=compress_at, compress_from=compress_from,
                       grammar=self._grammar(params), lora=lora)  # fmt: skip
        if eviction is not None:  # a prompt whose compaction's own blocks could never fit writes into its last ones
            probe = len(self._generic_question) if eviction.asks_generic_question else 0
            reserve = seq.compaction_reserve(self.kv.block_size, len(token_ids))
            seq.compacts_in_place = not self.kv.fits_alone(len(token_ids) + probe, self.config.max_num_batched_tokens, reserve)
            answers_once = compress_at is None and params.max_tokens == 1  # finished by its first token: no question is worth asking
            if probe and not answers_once and self.pool is not None and seq.compression_region(self.kv.block_size).compresses(seq.compression_point):
                seq.question = self._generic_question[: self.max_model_len - seq.compression_point] or None
        self.requests[request_id] = seq
        if lora is not None:
            self.kv.serve_adapter(lora.identity)
        if queue:
            self.scheduler.add(seq)
        return seq

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (vLLM's remove_lora; engine thread): requests running on it finish with
        its weights, and its cached K/V leave the pool and the local tiers unless another held id
        has the same weights. False if no adapter of that id was read."""
        if isinstance(lora_int_id, bool) or not isinstance(lora_int_id, int):
            raise TypeError(f"lora_int_id must be an int, got {type(lora_int_id).__name__}")
        if self.lora is None or not self.lora.knows(lora_int_id):
            return False
        identity = self.lora.forget(lora_int_id)
        if identity is not None:
            self.kv.drop_adapter(identity)
        return True

    def _lora_handle(self, lora_request: LoRARequest | None) -> LoRAHandle | None:
        if lora_request is None:
            return None
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora=True (--enable-lora)")
        return self.lora.resolve(lora_request)

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
        stream: bool = False, lora_request: LoRARequest | None = None, keep_kv: bool = False,
    ) -> list[Sequence]:
        """n samples of one prompt (parallel sampling): the prompt is computed once, by the first;
        the others share its blocks from there, the partly filled last block copied per sample.
        keep_kv: a stored conversation's turn, whose first sample's blocks stay pinned for the next turn."""
        if not params:
            raise ValueError("a request group needs at least one SamplingParams")
        ids = list(request_ids) if request_ids is not None else [None] * len(params)
        if len(ids) != len(params):
            raise ValueError(f"got {len(ids)} request ids for {len(params)} samples")
        first = self.add_request(prompt, params[0], ids[0], cache_salt, stream, lora_request=lora_request)
        first.keep_kv = keep_kv
        seqs = [first]
        for sp, rid in zip(params[1:], ids[1:]):
            seq = self.add_request(first.prompt_token_ids, sp, rid, cache_salt, stream, queue=False, lora_request=lora_request)
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
        seq.question = None  # its captured rows are the prompt's: a generic question is computed in a step of its own
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

    # ------------------------------------------------------------------ beam search (engine/beam_search.py)
    add_beam_search = beam_search.add_beam_search
    _advance_beam_groups = beam_search.advance_beam_groups

    # ------------------------------------------------------------------ live migration (engine/migrate.py)
    export_request = migrate.export_request
    check_import = migrate.check_import
    max_migrated_records = migrate.max_migrated_records
    max_migration_bytes = migrate.max_migration_bytes
    decode_records = migrate.decode_records
    import_request = migrate.import_request

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
        if request_id in self.beam_groups:
            return beam_search.abort_beam_group(self, request_id)
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        seq.finished_time = time.monotonic()
        return request_output(seq)

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
        try:
            return self._step()
        finally:
            if self.kv.offloader is not None:  # the step's blocks copied out for the tiers go to their worker at once
                self.kv.offloader.flush()

    def _step(self) -> list[RequestOutput]:
        handed_over = self._handed_over()
        self.kv.expire_pins()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch:
            if batch.preempted:  # beams gave way: the next step admits what they made room for
                return handed_over
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
        finally:
            if self.speculator is not None:  # guesses live one step: nothing outside it (a migration, stats) sees them
                for seq in self.scheduler.running:
                    seq.draft_token_ids = []

    def _refuse_head(self) -> list[RequestOutput]:
        """The first waiting request is not admitted into an empty pool, so it never would be: it
        fails (finish_reason "error") instead of the engine spinning with every request behind it.
        --max-model-len is sized so this should not happen; this is the backstop."""
        seq = self.scheduler.waiting[0]
        log.error("request %s (%d tokens) does not fit the empty KV pool; failing it", seq.request_id, seq.num_tokens)
        self.requests.pop(seq.request_id, None)
        self.scheduler.finish(seq)
        seq.finish_reason, seq.finished_time = "error", time.monotonic()
        out = request_output(seq)
        out.error = f"the KV cache ({self.kv.num_blocks} blocks) cannot hold this request's {seq.num_tokens} tokens even alone"
        return [out] if seq.beam_group is None else beam_search.fail_beam_groups(self, [seq], out.error)

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
            out = request_output(seq)
            out.error = f"{type(exc).__name__}: {exc}"
            if seq.beam_group is None:
                outputs.append(out)
        return outputs + beam_search.fail_beam_groups(self, [seq for seq, _ in batch.entries], f"{type(exc).__name__}: {exc}")

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
            prefill = sum(n for seq, n in batch.entries if n > 1 and not seq.draft_token_ids)
            if prefill >= 64 and prefill >= 0.9 * batch.num_tokens:
                self.kv.offloader.observe_prefill(prefill, time.perf_counter() - started)
        draws = _by_sequence(sampled)
        now = time.monotonic()
        # guesses are judged before anything publishes, quantizes or frees by length: those see the accepted tokens only
        verified = {seq: self._verify(seq, draws.pop(seq), now) for seq, _ in batch.entries if seq.draft_token_ids}
        for seq, n in batch.entries:
            if seq not in verified:
                seq.num_computed_tokens += n
            self.kv.publish_full_precision(seq.request_id, seq.token_ids, seq.num_computed_tokens)
            self.kv.plan_quantization(seq.request_id, seq.num_computed_tokens)
        pairs = self.kv.take_quantization()
        if pairs and self.pool is not None:
            self.pool.quantize([(residual.block_id, target.block_id) for residual, target in pairs])
        self.kv.release_quantized(pairs)
        for seq, _ in batch.entries:
            # a compressing request's prompt is published up to what its compaction leaves whole
            region = seq.compression_region(self.kv.block_size) if seq.eviction is not None else None
            if region is None:
                self.kv.cache_blocks(seq.request_id, seq.token_ids, seq.num_computed_tokens)
            else:
                if not seq.eviction_started:
                    self.kv.cache_blocks(seq.request_id, seq.token_ids, min(seq.num_computed_tokens, region.whole))
                self._evict(seq)
            self.kv.free_unreachable(seq.request_id, seq.num_computed_tokens if seq.probe is None else seq.probe_from, seq.prompt_len,
                                     eviction.earliest_hit_end(seq, region))  # fmt: skip
        outputs = []
        for seq, reason in verified.items():
            if reason is not None:
                self._finish(seq, reason, now)
        for seq, results in (*draws.items(), *((seq, None) for seq in verified)):
            if results is not None:
                (result,) = results
                if seq.status is SequenceStatus.FORKING:
                    self.scheduler.start_fork(seq)
                if result.token_id is None:  # its grammar allows no token
                    self._finish(seq, "stop", now, stop_reason="grammar")
                else:
                    self._append_token(seq, result.token_id, now)
                if result.logprobs is not None:
                    seq.logprobs.append(result.logprobs)
            if seq.beam_group is not None:  # its group reads its draw once every beam has drawn
                seq.held = True
                continue
            if seq.is_finished:
                self.requests.pop(seq.request_id, None)
                if self.speculator is not None:
                    self.speculator.forget(seq.request_id)
                if self.hands_over:
                    self._handing_over.append((self.kv.offloader.flushed(), request_output(seq)))
                    continue
            if seq.stream or seq.is_finished:
                outputs.append(request_output(seq))
        return outputs + (self._advance_beam_groups() if self.beam_groups else [])

    # ------------------------------------------------------------------ KV eviction (engine/eviction.py)
    eviction_policy = eviction.eviction_policy
    _evict = eviction.evict

    def _verify(self, seq: Sequence, results: list[SampleResult], now: float) -> str | None:
        """Keep the guesses that equal what their rows drew, and the first drawn token that differs (or
        one more after them all); then give back the KV of the rest. Returns why the sequence ends
        with these tokens (None: it goes on); it is finished after the step's bookkeeping."""
        draft, seq.draft_token_ids = seq.draft_token_ids, []
        drawn = [r.token_id for r in results]
        accepted = accepted_length(draft, drawn)
        self.speculator.judged(seq, len(draft), accepted)
        reason = None
        for result in results[: accepted + 1]:
            reason = self._take_token(seq, result.token_id, now)
            if result.logprobs is not None:
                seq.logprobs.append(result.logprobs)
            if reason is not None:
                break
        seq.num_computed_tokens = len(seq.token_ids) - 1  # the last token is computed next step, as after a decode
        self.kv.truncate(seq.request_id, seq.num_computed_tokens)
        return reason

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        reason = self._take_token(seq, token, now)
        if reason is not None:
            self._finish(seq, reason, now)

    def _take_token(self, seq: Sequence, token: int, now: float) -> str | None:
        """Append a drawn token; returns why the sequence ends with it (None: it goes on)."""
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
        return reason

    def _finish(self, seq: Sequence, reason: str, now: float, stop_reason: str | int | None = None) -> None:
        seq.finish_reason = reason
        if stop_reason is not None:
            seq.stop_reason = stop_reason
        seq.finished_time = now
        self.scheduler.finish(seq, pin=seq.keep_kv and reason in ("stop", "length"))

    # ------------------------------------------------------------------ introspection (the stats: engine/engine_stats.py)
    prefix_cache_stats = engine_stats.prefix_cache_stats
    stats = engine_stats.stats

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (running requests keep their blocks); returns the blocks forgotten."""
        return self.kv.reset_prefix_cache()

    @property
    def weight_dtype(self) -> str:
        """How the weights are held: "gguf" (the file's blocks), "int8" (Q8_0 blocks), "int4" (Q4_1) or the --dtype of their copies."""
        held = getattr(self, "weight_format", "float")
        return self.config.dtype if held == "float" else held

    @functools.cached_property
    def weight_bytes(self) -> int:
        """The bytes the model's weights take as held (0 for a simulated engine): read once, they never change."""
        return weight_bytes(self.model) if self.model is not None else 0


def _by_sequence(sampled: list[tuple[Sequence, SampleResult]]) -> dict[Sequence, list[SampleResult]]:
    """A step's draws, per sequence in the order they came (a verifying sequence draws once per row)."""
    draws: dict[Sequence, list[SampleResult]] = {}
    for seq, result in sampled:
        draws.setdefault(seq, []).append(result)
    return draws
