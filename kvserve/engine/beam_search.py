"""The engine's side of beam search (engine/beam.py scores the beams): a group's beams are sequences
that hold after each token until the whole group has drawn, then go on, change their last token,
fork or finish as the group decides. LLMEngine binds these as its methods."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvserve.engine.beam import Beam, BeamGroup, BeamSearchParams, Continuation
from kvserve.engine.sequence import Sequence, SequenceStatus
from kvserve.lora.request import LoRARequest
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine


def add_beam_search(engine: LLMEngine, prompt: str | list[int], params: BeamSearchParams, request_id: str | None = None,
                    cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> BeamGroup:  # fmt: skip
    """Queue a beam search of `prompt`; step() hands back one finished RequestOutput for it, its
    `beams` the finished beams best first (the output's tokens and text are the best one's). Every
    beam runs on lora_request's adapter, if one is given."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"beam search takes BeamSearchParams, got {type(params).__name__}")
    ends = frozenset() if params.ignore_eos else engine.eos_token_ids
    params.check_width(len(ends))
    prompt_len = len(prompt) if not isinstance(prompt, str) else None
    if prompt_len is not None:
        check_fits(engine, prompt_len, params)
    request_id = request_id if request_id is not None else f"beam-{next(engine._ids)}"
    if request_id in engine.beam_groups or request_id in engine.requests:
        raise ValueError(f"request_id {request_id!r} is already in use")
    # beams fork each other's blocks, which a compaction would rewrite: they never compress (the engine's --kv-compression included)
    sampling = SamplingParams(max_tokens=params.max_tokens, temperature=0, ignore_eos=True, logprobs=params.candidates(len(ends)),
                              kv_compression="none")  # fmt: skip
    seq = engine.add_request(prompt, sampling, f"{request_id}#0", cache_salt, lora_request=lora_request)
    seq.text, seq.beam_group = None, request_id
    max_new = min(params.max_tokens, engine.max_model_len - seq.prompt_len)
    if prompt_len is None:
        try:
            check_fits(engine, seq.prompt_len, params)
        except ValueError:
            engine.abort_request(seq.request_id)
            raise
    group = BeamGroup(request_id, list(seq.prompt_token_ids), params, ends, max_new, [Beam(seq, [], [], 0.0)], prompt=seq.prompt,
                      arrival_time=seq.arrival_time)
    engine.beam_groups[request_id] = group
    return group


def check_fits(engine: LLMEngine, prompt_len: int, params: BeamSearchParams) -> None:
    """A group whose beams cannot all reach their last token in the pool at once would be preempted and
    recomputed without end: refused (ValueError) with what it needs. Its beams share the prompt's whole
    blocks (kvserve plan counts them the same way)."""
    spec, total = engine.kv_spec, min(prompt_len + params.max_tokens, engine.max_model_len)
    shared = sum(1 for g in spec.groups if g.window is None) * (prompt_len // spec.block_size)
    need = spec.blocks_held(total) + (params.beam_width - 1) * (spec.blocks_held(total) - shared)
    if need > engine.kv.num_blocks:
        raise ValueError(f"a beam search of width {params.beam_width} over {prompt_len} prompt tokens and {total - prompt_len} new ones "
                         f"needs {need} KV blocks at its end, and the pool has {engine.kv.num_blocks}: lower the width (n, best_of) "
                         "or max_tokens, or give the server more --kv-cache-memory")  # fmt: skip


def advance_beam_groups(engine: LLMEngine) -> list[RequestOutput]:
    """Every group whose live beams have all drawn this round takes its next step; finished groups' outputs."""
    outputs = []
    for group in list(engine.beam_groups.values()):
        if all(beam.seq.held or beam.seq.is_finished for beam in group.beams):
            tops = [beam.seq.logprobs[-1].top for beam in group.beams]
            if group.first_token_time is None:
                group.first_token_time = time.monotonic()
                group.first_scheduled_time = group.beams[0].seq.first_scheduled_time
                group.num_cached_tokens = group.beams[0].seq.num_cached_tokens
            for beam in group.beams:
                beam.seq.logprobs.clear()
            _follow(engine, group, group.step(tops))
            if group.done:
                outputs.append(_finish_group(engine, group, None))
    return outputs


def _follow(engine: LLMEngine, group: BeamGroup, running: list[Continuation]) -> None:
    """Make the engine's sequences the group's next beams: the first continuation of a beam keeps its
    sequence (its last token, not computed yet, becomes the continuation's), every other one forks it."""
    by_parent: dict[int, list[Continuation]] = {}
    for c in running:
        by_parent.setdefault(c.parent, []).append(c)
    next_beams: dict[int, Beam] = {}  # by rank in `running`
    rank = {id(c): i for i, c in enumerate(running)}
    for index, beam in enumerate(group.beams):
        conts = by_parent.get(index, [])
        if not conts:
            _drop(engine, beam.seq)
            continue
        for c in conts[1:]:
            next_beams[rank[id(c)]] = Beam(_fork(engine, group, beam.seq, c.token), beam.output + [c.token], beam.logprobs + [c.top], c.score)
        first = conts[0]
        beam.seq.token_ids[-1] = first.token
        next_beams[rank[id(first)]] = Beam(beam.seq, beam.output + [first.token], beam.logprobs + [first.top], first.score)
    group.beams = [next_beams[i] for i in sorted(next_beams)]
    for beam in group.beams:
        beam.seq.held = False
    if engine.pool is not None:
        group.peak_blocks = max(group.peak_blocks, engine.kv.num_blocks - engine.kv.num_free_blocks)


def _fork(engine: LLMEngine, group: BeamGroup, parent: Sequence, token: int) -> Sequence:
    """A new beam from parent with `token` in place of its last: parent's blocks shared, the partly filled last one copied."""
    group.forks += 1
    child = Sequence(f"{group.request_id}#{group.forks}", parent.prompt_token_ids, parent.params, prompt=parent.prompt,
                     cache_salt=parent.cache_salt, token_ids=parent.token_ids[:-1] + [token], seed=parent.seed, lora=parent.lora)  # fmt: skip
    child.beam_group = group.request_id
    child.first_scheduled_time = parent.first_scheduled_time  # its prompt was computed (and counted) once
    engine.requests[child.request_id] = child
    kv = engine.kv
    computed = parent.num_computed_tokens
    shares = parent.status is SequenceStatus.RUNNING and computed > 0
    if shares and (computed % kv.block_size == 0 or kv.num_free_fresh_blocks >= len(kv.groups)):
        kv.fork(parent.request_id, child.request_id, computed)
        child.num_computed_tokens = computed
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = SequenceStatus.RUNNING
        engine.scheduler.running.append(child)
    else:  # no block for its copy of the last one (or the parent was preempted): it computes its tokens itself
        engine.scheduler.add(child)
    return child


def _drop(engine: LLMEngine, seq: Sequence) -> None:
    """A beam with no continuation: its blocks go back at once."""
    engine.requests.pop(seq.request_id, None)
    if not seq.is_finished:
        engine.scheduler.finish(seq)
        seq.finish_reason = "abort"


def _finish_group(engine: LLMEngine, group: BeamGroup, error: str | None) -> RequestOutput:
    for beam in group.beams:
        _drop(engine, beam.seq)
    group.beams = []
    del engine.beam_groups[group.request_id]
    decode = engine.tokenizer.decode if engine.tokenizer is not None else None
    beams = group.outputs(decode)
    best = beams.sequences[0] if beams.sequences else None
    output_ids = best.tokens[len(group.prompt_token_ids) :] if best else []
    now = time.monotonic()
    return RequestOutput(
        request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids, token_ids=output_ids,
        text=engine.tokenizer.decode(output_ids) if decode and best else "", finished=True,
        finish_reason="error" if error else best.finish_reason if best else "abort", num_output_tokens=len(output_ids),
        num_cached_tokens=group.num_cached_tokens,
        metrics={"arrival_time": group.arrival_time, "finished_time": now,
                 **({"first_token_time": group.first_token_time, "last_token_time": now,
                     "first_scheduled_time": group.first_scheduled_time} if group.first_token_time is not None else {})},
        beams=beams, error=error,
    )  # fmt: skip


def abort_beam_group(engine: LLMEngine, request_id: str) -> RequestOutput | None:
    group = engine.beam_groups.get(request_id)
    if group is None:
        return None
    out = _finish_group(engine, group, None)
    out.finish_reason = "abort"
    return out


def fail_beam_groups(engine: LLMEngine, seqs: list[Sequence], error: str) -> list[RequestOutput]:
    """The groups of beams a failed step took down: each ends with finish_reason "error"."""
    names = {seq.beam_group for seq in seqs if seq.beam_group is not None}
    return [_finish_group(engine, engine.beam_groups[name], error) for name in names if name in engine.beam_groups]
