"""Run the reference configuration, then each lossy one, over the same text, prompts and needles."""

from __future__ import annotations

import gc
import math
import uuid
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.llm import LLM
from kvserve.eval.compare import TextScores, score_window
from kvserve.eval.text import EvalText, NeedleCase, needle_cases, retrieved
from kvserve.sampling_params import SamplingParams

NEEDLE_ANSWER_TOKENS = 12
NEEDLE_QUESTIONS = ("inside", "outside")
MAX_GREEDY_PROMPTS = 256


@dataclass(frozen=True)
class EvalPlan:
    context: int = 2048
    score_chunk: int = 32
    max_windows: int = 4
    greedy_prompts: int = 8
    greedy_prompt_len: int = 128
    greedy_tokens: int = 64
    needle_lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    needle_depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    needle_seed: int = 0
    needle_questions: tuple[str, ...] = ("inside",)  # inside: compressed with the question; outside: before it
    score_from: int = 0  # score positions from here on; a compressing configuration compresses the window's first score_from tokens

    def __post_init__(self) -> None:
        if self.context < 2:
            raise ValueError(f"--context must be at least 2 (a window scores its tokens after the first), got {self.context}")
        for name in ("score_chunk", "max_windows", "greedy_prompt_len", "greedy_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.greedy_prompts <= MAX_GREEDY_PROMPTS:
            raise ValueError(f"--greedy-prompts must be in [0, {MAX_GREEDY_PROMPTS}], got {self.greedy_prompts}")
        if any(not 0 <= d <= 1 for d in self.needle_depths):
            raise ValueError(f"--needle-depths must lie in [0, 1], got {list(self.needle_depths)}")
        if any(n < 1 for n in self.needle_lengths):
            raise ValueError(f"--needle-lengths must be positive, got {list(self.needle_lengths)}")
        if not self.needle_questions or any(q not in NEEDLE_QUESTIONS for q in self.needle_questions):
            raise ValueError(f"--needle-question must be one of inside, outside, both; got {list(self.needle_questions)}")
        if not 0 <= self.score_from < self.context - 1:
            raise ValueError(f"--score-from must be in [0, --context - 1) = [0, {self.context - 1}), got {self.score_from}")


@dataclass
class RunOutputs:
    """What one configuration produced, kept for the reference so the others compare with it."""

    window_hidden: list[torch.Tensor] = field(default_factory=list)
    greedy: list[list[int]] = field(default_factory=list)
    needle_hits: dict[str, list[bool]] = field(default_factory=dict)  # question inside/outside -> per case


@dataclass
class ConfigResult:
    name: str
    flags: str
    kv_cache_dtype: str
    kv_hadamard: bool  # stored rotated (--kv-hadamard, or int8's default)
    kv_quant_sink_block: bool  # int4/int2: the first block kept in full precision (--kv-quant-sink-block)
    bytes_per_token: int
    token_capacity: int
    perplexity: float
    perplexity_delta_pct: float | None
    mean_kl: float | None
    top1_agreement: float | None
    greedy_agreement: float | None
    needle: dict[int, float | None]  # context length -> share of cases retrieved (None: longer than the model allows)
    needle_outside: dict[int, float | None]  # the same with the haystack compressed before the question is read ({}: not run)

    def as_dict(self) -> dict:
        return {**self.__dict__, "needle": {str(k): v for k, v in self.needle.items()},
                "needle_outside": {str(k): v for k, v in self.needle_outside.items()}}  # fmt: skip


class Evaluation:
    """One model, one text; the reference run stays loaded while each configuration runs beside it."""

    def __init__(self, plan: EvalPlan, text: str, progress: bool = True) -> None:
        self.plan = plan
        self.raw_text = text
        self.progress = progress
        self.reference: LLM | None = None
        self.reference_outputs: RunOutputs | None = None
        self.reference_result: ConfigResult | None = None
        self.num_windows = self.scored_tokens = 0

    def _inputs(self, llm: LLM):
        if llm.tokenizer is None:
            raise ValueError("kvserve eval needs the model's tokenizer (no --skip-tokenizer-init)")
        text = EvalText.from_text(llm.tokenizer, self.raw_text)
        limit = llm.engine.max_model_len
        if self.plan.context >= limit:
            raise ValueError(f"--context {self.plan.context} must be below the engine's max_model_len {limit}")
        windows = text.windows(self.plan.context, self.plan.max_windows)
        prompts = text.prompts(self.plan.greedy_prompts, self.plan.greedy_prompt_len) if self.plan.greedy_prompts else []
        lengths = [n for n in self.plan.needle_lengths if n + NEEDLE_ANSWER_TOKENS <= limit]
        needles = needle_cases(llm.tokenizer, text, lengths, list(self.plan.needle_depths), self.plan.needle_seed)
        return windows, prompts, needles

    def run(self, name: str, flags: str, config: EngineConfig) -> ConfigResult:
        """Run one configuration; the first one run is the reference the rest compare with."""
        llm = LLM.from_config(config)
        try:
            windows, prompts, needles = self._inputs(llm)
            is_reference = self.reference is None
            units = len(windows) + (1 if prompts else 0) + len(needles) * len(self.plan.needle_questions)
            bar = tqdm(total=units, desc=f"eval {name}", unit="step", disable=not self.progress, leave=False)
            try:
                outputs, scores = self._run(llm, windows, prompts, needles, bar, is_reference)
            finally:
                bar.close()
            result = self._result(name, flags, llm, outputs, scores, needles, is_reference)
            if is_reference:
                self.reference, self.reference_outputs, self.reference_result = llm, outputs, result
                self.num_windows, self.scored_tokens = len(windows), scores.positions
                llm = None
            return result
        finally:
            if llm is not None:
                del llm
                gc.collect()

    def _run(self, llm: LLM, windows, prompts, needles: list[NeedleCase], bar, is_reference: bool):
        engine = llm.engine
        outputs = RunOutputs()
        scores = TextScores()
        for i, window in enumerate(windows):
            # a salt of its own per window: score() must compute every position
            start = self.plan.score_from
            hidden = engine.score(window, cache_salt=f"kvserve-eval-{uuid.uuid4().hex}", chunk=self.plan.score_chunk,
                                  compress_at=start or None)[start:]  # fmt: skip
            if is_reference:
                outputs.window_hidden.append(hidden)
                scores.add(score_window(engine.model, hidden, window[start:]))
            else:
                scores.add(score_window(engine.model, hidden, window[start:], self.reference.engine.model,
                                        self.reference_outputs.window_hidden[i]))  # fmt: skip
            bar.update(1)
        if prompts:
            params = SamplingParams(max_tokens=self.plan.greedy_tokens, temperature=0.0, ignore_eos=True)
            outputs.greedy = [list(out.token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]
            bar.update(1)
        params = SamplingParams(max_tokens=NEEDLE_ANSWER_TOKENS, temperature=0.0)
        for question in self.plan.needle_questions:
            hits = outputs.needle_hits[question] = []
            for case in needles:
                if question == "outside" and not engine.config.eviction.active and "inside" in outputs.needle_hits:
                    hits.append(outputs.needle_hits["inside"][len(hits)])  # nothing compresses: the same computation
                else:
                    seq = engine.add_request(case.token_ids, params, compress_at=case.question_at if question == "outside" else None)
                    while not seq.is_finished:
                        engine.step()
                    hits.append(retrieved(case.key, llm.tokenizer.decode(seq.output_token_ids)))
                bar.update(1)
        return outputs, scores

    def _result(self, name, flags, llm: LLM, outputs: RunOutputs, scores: TextScores, needles, is_reference) -> ConfigResult:
        stats = llm.stats()
        perplexity = math.exp(scores.nll / scores.positions)
        retrieval: dict[str, dict[int, float | None]] = {}
        for question, case_hits in outputs.needle_hits.items():
            retrieval[question] = {n: None for n in self.plan.needle_lengths}
            for length in self.plan.needle_lengths:
                hits = [hit for case, hit in zip(needles, case_hits) if case.length == length]
                if hits:
                    retrieval[question][length] = sum(hits) / len(hits)
        delta = kl = top1 = greedy = None
        if not is_reference:
            ref = self.reference_result
            delta = 100.0 * (perplexity / ref.perplexity - 1.0)
            kl = scores.kl / scores.positions
            top1 = scores.top1_agree / scores.positions
            if outputs.greedy:
                pairs = [(a, b) for mine, theirs in zip(outputs.greedy, self.reference_outputs.greedy) for a, b in zip(mine, theirs)]
                greedy = sum(a == b for a, b in pairs) / len(pairs)
        return ConfigResult(
            name=name, flags=flags, kv_cache_dtype=stats["kv_cache_dtype"], kv_hadamard=stats["kv_hadamard"],
            kv_quant_sink_block=stats["kv_quant_sink_block"], bytes_per_token=stats["bytes_per_token"],
            token_capacity=stats["token_capacity"], perplexity=perplexity, perplexity_delta_pct=delta, mean_kl=kl,
            top1_agreement=top1, greedy_agreement=greedy, needle=retrieval.get("inside", {}),
            needle_outside=retrieval.get("outside", {}),
        )  # fmt: skip

    def close(self) -> None:
        self.reference = self.reference_outputs = None
        gc.collect()
