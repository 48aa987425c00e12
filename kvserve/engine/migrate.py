"""Live migration on the engine's side: export a request's state (engine/migration.py holds its
format), check whether this engine can continue one, and import it. LLMEngine binds these as its
methods (engine.export_request(...) and the rest)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvserve.engine.migration import MAX_STATE_BYTES, RequestState
from kvserve.engine.output_text import OutputText
from kvserve.engine.sequence import Sequence
from kvserve.kv.hashing import root_hash, validate_cache_salt
from kvserve.kv.tiers.record import BlockRecord, CorruptRecord, decode_record, encode_record, record_head, record_key, record_overhead

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine

log = logging.getLogger(__name__)


def export_request(engine: LLMEngine, request_id: str, with_records: bool = True) -> RequestState:
    """A running or waiting request's state (engine/migration.py), after which it leaves this
    engine (no output): its blocks stay in the prefix cache, so importing the state here again
    resumes it cheaply. With `with_records`, the KV of its cached blocks travels in the state;
    with a remote tier it is there already (this waits until what was sent has landed)."""
    seq = engine.requests.get(request_id)
    if seq is None:
        raise KeyError(request_id)
    if seq.eviction is not None or seq.captured is not None:
        raise ValueError("a request with kv_compression (or a scoring one) cannot migrate: its cache is not a prefix chain")
    if seq.params.prompt_logprobs is not None:
        raise ValueError("a request with prompt logprobs (echo with logprobs) cannot migrate: its scores stay here")
    if seq.beam_group is not None:
        raise ValueError("a beam of a beam search cannot migrate alone: its group chooses between its beams here")
    if seq.lora is not None:
        raise ValueError("a request running a LoRA adapter cannot migrate: the adapter is not part of its state")
    identity = root_hash(engine.cache_identity)
    records = []
    if with_records and engine.pool is not None:
        records = [encode_record(BlockRecord(b.block_hash, b.group, b.token_ids, engine.pool.block_bytes(b.block_id)), identity,
                                 engine.record_signer) for b in engine.kv.published_blocks(request_id)]  # fmt: skip
    state = RequestState(list(seq.prompt_token_ids), list(seq.output_token_ids), seq.params, seq.seed, identity, seq.cache_salt,
                         seq.prompt, seq.stream, list(seq.logprobs), seq.num_cached_tokens, records)  # fmt: skip
    engine.requests.pop(request_id)
    engine.scheduler.finish(seq)
    if engine.kv.offloader is not None and engine.kv.offloader.writes_remote:
        engine.kv.offloader.flushed().result(timeout=60)
    engine.migrations["out"] += 1
    return state


def check_import(engine: LLMEngine, state: RequestState) -> None:
    """Whether this engine can continue the request exactly (ValueError saying why not); changes nothing."""
    if state.identity != root_hash(engine.cache_identity):
        raise ValueError("the request was exported by an engine with another model, dtype or KV settings")
    validate_cache_salt(state.cache_salt)
    engine.validate_prompt_tokens(state.prompt_token_ids)
    tokens = [*state.prompt_token_ids, *state.output_token_ids]
    if any(t >= engine.model_config.vocab_size for t in state.output_token_ids):
        raise ValueError(f"output token ids must be in [0, {engine.model_config.vocab_size})")
    if len(tokens) >= engine.max_model_len or len(state.output_token_ids) >= state.params.max_tokens:
        raise ValueError("the request has no tokens left to generate")
    if len(state.logprobs) != (len(state.output_token_ids) if state.params.logprobs is not None else 0):
        raise ValueError("the request's logprobs do not match its output tokens")
    if engine.eviction_policy(state.params) is not None:
        raise ValueError("this engine compresses the request's cache (--kv-compression): it cannot continue it exactly")
    if len(state.prompt_token_ids) + state.params.max_tokens > engine.max_model_len:
        raise ValueError(f"max_tokens={state.params.max_tokens} plus the prompt's {len(state.prompt_token_ids)} tokens exceeds "
                         f"max_model_len={engine.max_model_len}")  # fmt: skip
    if len(state.records) > max_migrated_records(engine, len(tokens)):
        raise ValueError(f"{len(state.records)} KV records are more than {len(tokens)} tokens have blocks")


def max_migrated_records(engine: LLMEngine, num_tokens: int) -> int:
    """The most block records a migrated request of num_tokens tokens can carry (one per group per block)."""
    return (num_tokens // engine.kv.block_size + 1) * len(engine.kv.groups)


def max_migration_bytes(engine: LLMEngine) -> int:
    """The largest state (engine/migration.py) a request can need here: its JSON and its records."""
    records, spec = max_migrated_records(engine, engine.max_model_len), engine.kv_spec
    # a KIVI cache's sink blocks travel in full precision: up to residual_units quantized blocks' bytes
    sink_bytes = spec.quant_sink_blocks * len(engine.kv.groups) * max(spec.residual_units - 1, 0) * spec.bytes_per_block
    return MAX_STATE_BYTES + records * (4 + spec.bytes_per_block + record_overhead(engine.kv.block_size)) + sink_bytes


def decode_records(engine: LLMEngine, state: RequestState) -> list[BlockRecord]:
    """The state's KV records that pass their checks, signatures included (the others are counted,
    logged, then recomputed); pure, so a server runs it off the engine thread."""
    records, refused = [], {}
    for data in state.records:
        try:
            records.append(decode_record(data, state.identity, record_key(*record_head(data)), engine.record_signer))
        except (CorruptRecord, ValueError) as error:
            engine.migrations["records_rejected"] += 1
            reason = getattr(error, "reason", "damaged")
            refused[reason] = refused.get(reason, 0) + 1
    if refused:
        hint = " (damaged in transit, or the engines do not share one --kv-remote-key-file)" if {"unsigned", "bad_signature"} & refused.keys() else ""
        log.warning("a migrated request's KV records were refused%s: %s; its tokens are recomputed here", hint,
                    ", ".join(f"{n} {reason}" for reason, n in sorted(refused.items())))  # fmt: skip
    return records


def import_request(engine: LLMEngine, state: RequestState, request_id: str | None = None,
                   records: list[BlockRecord] | None = None, returning: bool = False) -> Sequence:  # fmt: skip
    """Continue a request exported by an engine with the same model and KV settings: its blocks
    (the records in the state, else the tiers, else recomputed) and its draws go on where they
    were, so it produces the tokens it would have produced there. Its outputs hold what is new."""
    check_import(engine, state)
    tokens = [*state.prompt_token_ids, *state.output_token_ids]
    request_id = request_id if request_id is not None else f"req-{next(engine._ids)}"
    if request_id in engine.requests:
        raise ValueError(f"request_id {request_id!r} is already in use")
    if records is None:
        records = decode_records(engine, state)
    if records and engine.pool is not None:
        engine.kv.adopt_blocks(tokens, state.cache_salt, records, engine.pool.write_block_bytes)
    text = None
    if engine.tokenizer is not None:
        text = OutputText(engine.tokenizer.incremental_detokenizer(), state.params.stop, state.params.include_stop_str_in_output)
        for token in state.output_token_ids:
            text.add(token)
        text.take_new()  # handed out at the source
    seq = Sequence(request_id, list(state.prompt_token_ids), state.params, prompt=state.prompt, cache_salt=state.cache_salt,
                   seed=state.seed, text=text, stream=state.stream, migrated=True,
                   grammar=engine._grammar(state.params, state.output_token_ids))  # fmt: skip
    for token in state.output_token_ids:
        seq.append_token(token)
    seq.logprobs = list(state.logprobs)
    seq.num_sent_tokens = len(state.output_token_ids)
    seq.num_cached_tokens = state.num_cached_tokens
    engine.requests[request_id] = seq
    engine.scheduler.add(seq)
    if not returning:  # a request back from a failed migration counts as failed, not as in
        engine.migrations["in"] += 1
    return seq
