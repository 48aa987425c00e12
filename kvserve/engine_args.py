"""Engine flags shared by every CLI command, spelled as vLLM spells them."""

from __future__ import annotations

import argparse

from kvserve.config import GGUF_ACTIVATIONS, WEIGHT_DTYPES, EngineConfig
from kvserve.kv.eviction import KV_COMPRESSIONS, SNAPKV_QUERIES
from kvserve.kv.spec import KV_DTYPES
from kvserve.model.registry import DEFAULT_MODEL, PACKAGED_MODELS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    aliases = ", ".join(PACKAGED_MODELS)
    group.add_argument("--model", default=DEFAULT_MODEL, help=f"alias ({aliases}), a .gguf file, or an HF directory (default: %(default)s)")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="weights and activations; auto: bfloat16 on CUDA and on x86 CPUs with avx512_bf16 or amx_bf16 (the CPU "
                       "multiplies bf16 natively), float32 on other x86 CPUs (bf16 GEMMs are emulated there and ran 3-5x slower); "
                       "on other CPUs the faster of the two in a timed matmul")
    group.add_argument("--weight-dtype", default="auto", choices=list(WEIGHT_DTYPES),
                       help="how the weights are held: gguf keeps a GGUF file's quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, "
                       "Q5_K, Q6_K; one copy, the file's size) and computes on them exactly (float32 FMAs, or bf16 dot products on their codes; int8 rows or "
                       "AMX bf16 tiles: --gguf-activations); bfloat16 / float32 dequantize them "
                       "into --dtype (which must match); int8 quantizes the projections, embedding and lm_head (of a Hugging Face "
                       "checkpoint, or a GGUF file's dequantized) to int8 with a scale per 32 weights of a row (GGUF's Q8_0 layout, 8.5 bits a weight; weight-only, the "
                       "activations stay in --dtype); int4 quantizes the q, k, o, gate and up projections to 4 bits with a scale and a minimum per 32 weights (GGUF's Q4_1, asymmetric groups of 32: 5 bits a weight) and v, down, the embedding and the lm_head to Q8_0 (as llama.cpp's Q4_K_M keeps v and down at more bits). auto: gguf for GGUF files where --dtype is float32 on the CPU (with "
                       "bf16 activations the AMX and bf16-dot kernels run on bf16 weights), else --dtype. "
                       "See docs/models.md")
    group.add_argument("--gguf-activations", default="auto", choices=list(GGUF_ACTIVATIONS),
                       help="how products on GGUF (or --weight-dtype int8 / int4) blocks take their rows: int8 quantizes each row per block "
                       "of 32 values and multiplies the blocks' codes with integer dot products (AVX512-VNNI; the rows' "
                       "rounding is the only loss, docs/models.md); exact multiplies the rows by the exact dequantized values; bf16 "
                       "(AMX CPUs, --dtype bfloat16) multiplies them on AMX tiles by the values rounded to bf16, the products of "
                       "bf16 weights bit for bit at the file's size. "
                       "auto: exact (int8 rows cost 0.10-0.22%% perplexity on the packaged models). The embedding and lm_head "
                       "stay exact")
    group.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_DTYPES, "fp8"],
                       help="KV cache format; auto follows --dtype. int8 and fp8 (fp8 = fp8_e4m3) keep one scale per token and "
                       "head; int4 and int2 are KIVI-style (keys per channel, values per token, in groups), the most recent "
                       "tokens kept in full precision. See docs/kv-quantization.md")
    # the three int4/int2 flags default to None so that one given with another cache is refused, not ignored
    group.add_argument("--kv-quant-group-size", type=int, default=None,
                       help="int4/int2: tokens per key-channel scale and channels per value scale (default: 32)")
    group.add_argument("--kv-quant-residual", type=int, default=None,
                       help="int4/int2: the most recent tokens kept in full precision, in blocks taken from the pool as a "
                       "sequence needs them (default: 128)")
    group.add_argument("--kv-quant-sink-block", action=argparse.BooleanOptionalAction, default=None,
                       help="int4/int2: keep each sequence's first block (--block-size tokens) in full precision too: the "
                       "first token is the attention sink most heads look at, and its outlier keys would set the scales of "
                       "its whole key group (on SmolLM2 int4 it cuts the mean KL 2.5x; see docs/kv-quantization.md). Costs one "
                       "full-precision block per sequence, taken from the pool while the sequence holds it (default: on)")
    group.add_argument("--kv-cache-scales", default=None, metavar="FILE",
                       help='fp8: a JSON file of calibrated scales, {"k_scale": [[per head] per layer], "v_scale": [...]}, '
                       "used instead of each token's own")
    group.add_argument("--kv-key-centering", action=argparse.BooleanOptionalAction, default=True,
                       help="int8/fp8: store keys minus each layer's and head's mean key, measured at start on a short text; "
                       "attention is unchanged (softmax ignores a shift common to a query's scores) and the per-token scale "
                       "no longer spends its levels on a constant. Off with calibrated --kv-cache-scales; no effect on other formats")
    group.add_argument("--kv-hadamard", action=argparse.BooleanOptionalAction, default=None,
                       help="store K and V in a Hadamard basis per head: q, k and v are turned by one orthonormal matrix "
                       "before attention and the output back after it (a fast Walsh-Hadamard transform), so attention is "
                       "unchanged while the quantization scales no longer follow a vector's largest channel; needs a "
                       "power-of-two head dim. Default: on for int8 (it lowered its cost on every model measured), off "
                       "otherwise: fp8 and int4 gain on SmolLM2 but lose on Gemma 3 and badly on Qwen2.5 (docs/kv-quantization.md), int2 "
                       "loses, a 16-bit cache gains nothing")
    group.add_argument("--block-size", type=int, default=None,
                       help="tokens per KV block (default: 16; for int4/int2 a multiple of --kv-quant-group-size, 32)")
    group.add_argument("--kv-cache-memory", type=float, default=2.0, help="GiB preallocated for the paged KV pool (default: %(default)s)")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV blocks; overrides --kv-cache-memory")
    group.add_argument("--max-num-seqs", type=int, default=64, help="most sequences running in one step (default: %(default)s)")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="token budget of one step: decode tokens plus prefill chunks (default: %(default)s)")
    group.add_argument("--prefill-step-tokens", type=int, default=1024,
                       help="once a step's prompt tokens have reached this and one of its prompts is complete (the one "
                            "that crossed it, at the latest), it takes no more prompts, decodes still: a request whose prompt "
                            "is done gets its first token without waiting for the rest of a --max-num-batched-tokens budget "
                            "of later prompts (bench/ladder.py's int8 rung on Qwen2.5-Coder-0.5B, rounds of ten ~400-token "
                            "prompts: TTFT p50 1.57x -> 1.04x the 16-bit rung's; docs/benchmarks.md). No effect when it is "
                            "at or above --max-num-batched-tokens; 0: prompts fill the budget (default: %(default)s)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output; default: the model's context, capped by the KV capacity")
    group.add_argument("--seed", type=int, default=0, help="seed of requests that bring none (default: %(default)s)")
    group.add_argument("--attention-backend", default="auto", choices=["auto", "cpu_paged", "torch_sdpa"],
                       help="attention over the paged KV pool: cpu_paged reads it in place through block tables with native kernels "
                       "compiled on first use; torch_sdpa gathers blocks and runs torch SDPA (any device); "
                       "auto takes cpu_paged on CPU when a C++ compiler is present")
    group.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    group.add_argument("--threads", type=int, default=None,
                       help="CPU threads the engine computes with (torch's and kvserve's kernels); default: one per core. "
                       "Replicas sharing a machine each take their share (kvserve cluster does)")
    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters (PEFT's adapter_config.json + adapter_model.safetensors) over the base model; "
                      "requests name one, and its identity keys their cached K/V")
    lora.add_argument("--max-loras", type=int, default=1,
                      help="adapters kept resident as products in the activations' dtype, least recently used out first "
                      "(a step with more holds them all for that step; default: %(default)s)")
    lora.add_argument("--max-lora-rank", type=int, default=16, help="adapters of a higher rank are refused (default: %(default)s)")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="adapters kept as read, so a request for one reads no files (default: --max-loras)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the K/V of prompt prefixes already computed (system prompts, documents, earlier turns); "
                       "--no-enable-prefix-caching turns it off")
    group.add_argument("--prefix-cache", default="hash", choices=["hash", "radix"],
                       help="hash: whole blocks matched by chained hash; radix: a radix tree that also reuses the shared "
                       "part of a block (copied into a fresh one)")
    group.add_argument("--expose-salt-stats", action="store_true",
                       help="count prefix-cache misses whose first block another cache_salt cached (reason other_salt in "
                       "/metrics) and show reuse per salt in /v1/kv/snapshot, /dashboard and kvserve top. Both tell any "
                       "caller whether a guessed prompt start or salt is another tenant's: only where every caller is "
                       "trusted. Off (default): such a miss counts as no_shared_prefix and the snapshot has no per-salt rows")
    group.add_argument("--skip-tokenizer-init", action="store_true",
                       help="load no tokenizer: prompts are token ids, outputs token ids (also what happens when the model "
                       "directory has no tokenizer files)")
    group.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                       help="give sliding-window layers blocks for the whole sequence, as full-attention layers get "
                       "(by default they hold only their window's blocks)")
    group.add_argument("--kv-compression", default="none", choices=list(KV_COMPRESSIONS),
                       help="evict cached tokens: snapkv keeps, at the end of prefill, the prompt positions that the queries of "
                       "the prompt's end (--snapkv-window) and a generic question attend to most (per layer and KV head; see "
                       "--snapkv-query); streaming keeps --sink-tokens first tokens and the most recent ones, evicting as "
                       "decode proceeds; random is a baseline. Needs --kv-keep-ratio or --kv-budget. See docs/kv-eviction.md")
    group.add_argument("--kv-keep-ratio", type=float, default=None, help="share of a sequence's tokens kept, in (0, 1]; with --kv-compression none, the budget of "
                       "requests that ask for compression themselves (the API's kv_compression field)")
    group.add_argument("--kv-budget", type=int, default=None, help="tokens kept per sequence (instead of --kv-keep-ratio); with --kv-compression none, as --kv-keep-ratio")
    group.add_argument("--snapkv-window", type=int, default=32,
                       help="snapkv: the prompt's last positions, kept (up to half the budget), whose queries score every position: "
                       "from the first block boundary (--block-size) among them when half of them or more follow it, so a prefix "
                       "hit reads up to it (with the defaults, the last 17 to 32 queries), else all of them (default: %(default)s)")
    group.add_argument("--snapkv-kernel", type=int, default=7,
                       help="snapkv: width of the max-pool that smooths the scores, odd (default: %(default)s)")
    group.add_argument("--snapkv-query", default="both", choices=list(SNAPKV_QUERIES),
                       help="snapkv: whose attention scores the prompt's positions: window (SnapKV as published), its last "
                       "--snapkv-window tokens (the question, when the prompt ends with one); generic, a generic question appended after the "
                       "tokens compressed, computed and dropped again (question-agnostic: a document compressed before "
                       "its questions are known; about a dozen more tokens of prefill per sequence; needs a tokenizer); "
                       "both, the window's scores and the generic question's added, weighed by --snapkv-question-weight "
                       "(default: %(default)s)")
    group.add_argument("--snapkv-question-weight", type=float, default=10.0,
                       help="snapkv with --snapkv-query both: how much the generic question's scores weigh against the "
                       "window's, each averaged over its queries; in (0, 1e6] (default: %(default)s)")
    group.add_argument("--sink-tokens", type=int, default=4, help="streaming: first tokens always kept (default: %(default)s)")
    group.add_argument("--kv-offload-host-gib", type=float, default=0.0,
                       help="a host-memory tier under the KV pool: cached blocks evicted from the pool (and preempted "
                       "sequences' blocks) are kept here, least recently used first out, and loaded back as prefix hits "
                       "instead of recomputed when that is measured to be faster; 0 turns it off (default: %(default)s). "
                       "On a CPU device it is a second budget beside --kv-cache-memory. See docs/kv-tiers.md")
    group.add_argument("--conversation-kv-share", type=float, default=0.1, metavar="FRACTION",
                       help="the share of the KV pool that stored conversations (the Responses API with store: true) may keep "
                       "pinned between turns, so a follow-up (previous_response_id) finds its whole history cached; pins give "
                       "way before any request is preempted or refused; 0 turns it off (default: %(default)s)")
    group.add_argument("--conversation-kv-ttl", type=float, default=300.0, metavar="SECONDS",
                       help="how long a stored conversation's blocks stay pinned after its turn, before they go back to the "
                       "cache's LRU order (and down to the host tier when one is set) (default: %(default)s)")
    group.add_argument("--kv-offload-disk-dir", default=None, metavar="DIR",
                       help="a local disk tier under the host tier (or under the pool): one file per block, kept across "
                       "restarts of an engine with the same model and KV settings")
    group.add_argument("--kv-offload-disk-gib", type=float, default=None,
                       help="the disk tier's budget in GiB, with --kv-offload-disk-dir (default: 8)")
    group.add_argument("--kv-offload-policy", default="write_back", choices=["write_back", "write_through"],
                       help="write_back: a block goes down when the pool evicts it; write_through: as soon as it is computed "
                       "(a restart or a crash keeps more, at the cost of a copy per block) (default: %(default)s)")
    group.add_argument("--kv-remote-url", default=None, metavar="URL",
                       help="a Redis server as a KV tier shared by several engines: redis://[:password@]host:port/db, or "
                       "rediss://... for TLS. Every computed block goes there (keyed by its prefix hash, the model, KV "
                       "settings and salt: no prompt text), and a prefix any engine computed is loaded instead of "
                       "recomputed. Give the server a maxmemory and an LRU policy. See docs/kv-sharing.md")
    group.add_argument("--kv-remote-timeout-ms", type=int, default=200,
                       help="the deadline of every call to the remote tier; a call past it marks the server down until it "
                       "answers a ping again (requests recompute meanwhile) (default: %(default)s)")
    group.add_argument("--kv-remote-ttl", type=int, default=3600,
                       help="seconds a remote entry lives after it was last written or read (default: %(default)s)")
    group.add_argument("--kv-remote-ca-file", default=None, metavar="PEM",
                       help="with a rediss:// URL: the CA certificate to verify the server with (default: the system's)")
    group.add_argument("--kv-remote-key-file", default=None, metavar="PATH",
                       help="a file holding a secret (16+ bytes; or the environment's KVSERVE_KV_REMOTE_KEY, never a flag "
                       "value `ps` would show) that every engine sharing KV shares: each KV record leaving the process "
                       "(the Redis and disk tiers, migration, prefill hand-overs) is signed (AES-GMAC) and unsigned or "
                       "mis-signed records are refused. Without one, anyone who can write to the Redis server can plant K/V")
    group.add_argument("--kv-role", default="both", choices=["both", "producer", "consumer"],
                       help="disaggregated prefill through --kv-remote-url: a producer prefills, publishes the prompt's "
                       "blocks and answers once they are stored; a consumer decodes with them and never writes the remote "
                       "tier; both does both (default: %(default)s). `kvserve pd-proxy` puts one of each behind one URL")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding, as vLLM spells it: \'{"method": "ngram", "num_speculative_tokens": 4, '
                       '"prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 8}\'. Each decoding '
                       "sequence guesses up to num_speculative_tokens tokens by looking its last 2-4 tokens up in its prompt and "
                       "output, and one step checks them all; the tokens and logprobs are exactly those of plain decoding, "
                       "greedy or seeded. No sequence guesses in a step where disable_by_batch_size or more run (default 8; "
                       'null: always). {"method": "draft_model", "model": ALIAS_OR_PATH, "draft_kv_cache_memory": 0.25} guesses '
                       "with a smaller model that shares the target's vocabulary, in its own KV pool of that many GiB. "
                       "See docs/speculative-decoding.md")


KIVI_FLAGS = ("kv_quant_group_size", "kv_quant_residual", "kv_quant_sink_block")


def engine_config_from_args(args: argparse.Namespace, strict_kivi_flags: bool = True, **extra) -> EngineConfig:
    """The engine's config from parsed flags. An int4/int2 flag beside another cache is refused,
    unless not `strict_kivi_flags` (`kvserve eval`: flags given to the command apply to the rows they fit)."""
    names = EngineConfig.field_names()
    values = {name: getattr(args, name) for name in names if hasattr(args, name)}
    values.update(extra)
    given = [name for name in KIVI_FLAGS if values.get(name) is not None]
    if given and strict_kivi_flags and values.get("kv_cache_dtype") not in ("int4", "int2"):
        raise ValueError(f"--{given[0].replace('_', '-')} applies to --kv-cache-dtype int4 or int2; this cache is "
                         f"{values.get('kv_cache_dtype', 'auto')}")  # fmt: skip
    for name in KIVI_FLAGS:
        if values.get(name) is None:
            values.pop(name, None)
    return EngineConfig(**values)
