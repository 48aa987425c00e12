"""Replay a JSONL trace through the engine's real scheduler and block manager, with no model."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.model.config import ModelConfig
from kvserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class TraceRequest:
    prompt_len: int
    output_len: int
    arrival_step: int = 0


MAX_TRACE_COUNT = 1 << 40  # tokens or steps: past this a value is a typo, not a workload


def _count(row: dict, names: tuple[str, ...], path: Path, number: int, default: int | None = None) -> int:
    """A trace field as an integer: a JSON integer (3.0 too), never a string, a boolean, 3.5 or 1e400."""
    name = next((n for n in names if n in row), names[0])
    value = row.get(name, default)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not -MAX_TRACE_COUNT <= value <= MAX_TRACE_COUNT:
        raise ValueError(f"{path}: line {number} needs an integer {name} (up to {MAX_TRACE_COUNT:,}), got {value!r}")
    return value


def read_trace(path: str | Path) -> list[TraceRequest]:
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"trace file {str(path)!r} is a directory")
    if not path.is_file():
        raise ValueError(f"trace file {str(path)!r} does not exist")
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {number} is not JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise ValueError(f"{path}: line {number} is not a JSON object")
        prompt = _count(row, ("prompt_len", "prompt_tokens"), path, number)
        output = _count(row, ("output_len", "output_tokens"), path, number)
        arrival = _count(row, ("arrival_step",), path, number, default=0)
        if prompt <= 0 or output <= 0 or arrival < 0:
            raise ValueError(f"{path}: line {number}: prompt_len and output_len must be positive, arrival_step >= 0")
        requests.append(TraceRequest(prompt, output, arrival))
    if not requests:
        raise ValueError(f"{path}: the trace is empty")
    return requests


def trace_prompt(index: int, length: int, vocab: int) -> list[int]:
    """Distinct, deterministic token ids per request (so a prefix cache sees no accidental sharing)."""
    return [(index * 7919 + i * 104729 + 1) % vocab for i in range(length)]


def trace_params(req: TraceRequest) -> SamplingParams:
    return SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)


def replay(config: EngineConfig, model_config: ModelConfig, trace: list[TraceRequest], progress: bool = True) -> dict:
    engine = LLMEngine.simulated(config, model_config)
    pending = sorted(enumerate(trace), key=lambda item: item[1].arrival_step)
    arrivals: dict[str, int] = {}
    first_step: dict[str, int] = {}
    seqs = []
    step = 0
    cursor = 0
    bar = tqdm(total=len(trace), desc="replay", unit="req", disable=not progress or len(trace) < 50)
    finished = 0
    for index, req in pending:  # before any prompt is built: a length past the context is refused at once
        if req.prompt_len + req.output_len > engine.max_model_len:
            raise ValueError(f"trace request {index}: prompt_len + output_len ({req.prompt_len + req.output_len:,}) does not fit "
                             f"--max-model-len {engine.max_model_len:,}")  # fmt: skip
    while cursor < len(pending) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():  # idle until the next arrival: no steps to simulate
            step = max(step, pending[cursor][1].arrival_step)
        while cursor < len(pending) and pending[cursor][1].arrival_step <= step:
            index, req = pending[cursor]
            seq = engine.add_request(trace_prompt(index, req.prompt_len, model_config.vocab_size), trace_params(req))
            arrivals[seq.request_id] = step
            seqs.append(seq)
            cursor += 1
        outputs = engine.step()
        for seq in seqs:
            if seq.request_id not in first_step and seq.first_scheduled_time is not None:
                first_step[seq.request_id] = step
        done = sum(1 for o in outputs if o.finished)
        finished += done
        bar.update(done)
        step += 1
    bar.close()
    delays = [first_step[r] - arrivals[r] for r in arrivals]
    stats = engine.stats()
    q = statistics.quantiles(delays, n=20, method="inclusive") if len(delays) > 1 else [delays[0]] * 19
    return {
        "num_requests": len(trace),
        "num_steps": stats["num_steps"],
        "num_blocks": stats["num_blocks"],
        "block_size": stats["block_size"],
        "bytes_per_token": stats["bytes_per_token"],
        "peak_num_blocks_used": stats["peak_num_blocks_used"],
        "peak_kv_usage": stats["kv_cache_usage_peak"],
        "peak_kv_bytes": stats["peak_num_blocks_used"] * engine.kv_spec.bytes_per_block,
        "num_preemptions": stats["num_preemptions"],
        "queue_delay_steps": {"mean": statistics.fmean(delays), "p50": statistics.median(delays), "p95": q[18], "max": max(delays)},
        "prompt_tokens": stats["prompt_tokens_total"],
        "generation_tokens": stats["generation_tokens_total"],
    }
