"""Beam search on forked blocks: a group of beams that share their prefix blocks by reference.

Each beam is a sequence in the engine, decoding greedily with the top-K logprobs of its next token;
after it draws, it is held (the scheduler skips it) until every live beam of its group has drawn.
Then the group picks its next beams as transformers' `generate(num_beams=W)` does (the same
candidates, scores, ends and early-stopping heuristic, so the top sequence is the same), and the
engine's sequences follow: a beam whose best continuation is kept goes on as it is, one continued
by another token has its last, not yet computed token replaced, a second continuation of a beam is
a fork (its blocks shared, the partly filled last one copied), and a beam with no continuation is
finished at once, its blocks returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:
    from kvserve.engine.sequence import Sequence

NEG_INF = -1.0e9  # transformers' "no score" (a beam or a slot that cannot win)
EARLY_STOPPING = (True, False, "never")
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam reads its top 2 x beam_width tokens (more with several end tokens)


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams; `early_stopping` as transformers' generate takes it (False: its heuristic)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.beam_width > MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be at most {MAX_BEAM_WIDTH} (each beam reads its top 2 x beam_width tokens, at most "
                             f"{MAX_LOGPROBS}), got {self.beam_width}")  # fmt: skip
        if self.temperature != 0:
            raise ValueError(f"beam search here is deterministic (temperature 0), got temperature {self.temperature!r}")
        penalty = self.length_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not -10 <= penalty <= 10:
            raise ValueError(f"length_penalty must be a number in [-10, 10], got {penalty!r}")
        if self.early_stopping not in EARLY_STOPPING or isinstance(self.early_stopping, int) and not isinstance(self.early_stopping, bool):
            raise ValueError(f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")

    def candidates(self, num_eos: int) -> int:
        """How many continuations a step keeps (transformers' beams_to_keep): enough that W go on whatever ends."""
        return max(2, 1 + num_eos) * self.beam_width

    def check_width(self, num_eos: int) -> None:
        if self.candidates(num_eos) > MAX_LOGPROBS:
            widest = MAX_LOGPROBS // max(2, 1 + num_eos)
            raise ValueError(f"beam_width {self.beam_width} is too wide: each beam reads its top {self.candidates(num_eos)} tokens, "
                             f"at most {MAX_LOGPROBS} (with this model's {num_eos} end-of-sequence tokens: beam_width <= {widest})")  # fmt: skip


@dataclass
class BeamSearchSequence:
    """One finished beam, as vLLM returns it: the prompt's and the beam's tokens, the logprobs of each
    generated token (its top K), the sum of the chosen tokens' logprobs, and the length-penalized score
    the beams are ordered by (transformers' sequences_scores)."""

    tokens: list[int]
    logprobs: list[dict[int, float]]
    cum_logprob: float
    score: float
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an end-of-sequence token) or "length"
    num_output_tokens: int = 0


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


@dataclass
class Beam:
    """A live beam: the engine's sequence that computes it, its tokens after the prompt, their logprobs."""

    seq: Sequence | None  # the engine's sequence computing it (None once it is a finished hypothesis)
    output: list[int]
    logprobs: list[dict[int, float]]
    score: float  # sum of its tokens' logprobs


@dataclass
class Continuation:
    parent: int  # index into the group's beams
    token: int
    score: float
    top: dict[int, float]


@dataclass
class BeamGroup:
    """One prompt's beam search: the live beams and the best finished ones (at most beam_width)."""

    request_id: str
    prompt_token_ids: list[int]
    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    max_new_tokens: int  # the params' max_tokens, or less where max_model_len ends the beams first
    beams: list[Beam] = field(default_factory=list)
    finished: list[tuple[float, Beam, str]] = field(default_factory=list)  # (score, beam, finish reason), best first
    prompt: str | None = None
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None  # when its first round of draws was chosen
    num_cached_tokens: int = 0  # prompt tokens its first beam found in the prefix cache
    forks: int = 0  # beams forked so far (they name the sequences)
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied
    done: bool = False
    peak_blocks: int = 0

    def step(self, tops: list[dict[int, float]]) -> list[Continuation]:
        """Every live beam's top-K logprobs of its next token (in the order of self.beams): the beams that
        go on, best first (the caller maps them onto sequences), after the group took the ones that end."""
        p = self.params
        ends = self.eos_token_ids if not p.ignore_eos else frozenset()
        generated = len(self.beams[0].output)  # tokens each beam has before this step's
        keep = p.candidates(len(ends))
        cands = sorted((Continuation(b, token, beam.score + lp, top) for b, (beam, top) in enumerate(zip(self.beams, tops))
                        for token, lp in top.items()), key=lambda c: -c.score)[:keep]  # fmt: skip
        last = generated + 1 >= self.max_new_tokens
        hits = [last or c.token in ends for c in cands]
        running = [c for c, hit in zip(cands, hits) if not hit][: p.beam_width]
        # transformers: the top beam_width candidates that end join the finished ones, unless no improvement is possible
        if self.improvable and not (p.early_stopping is True and len(self.finished) >= p.beam_width):
            for rank, (c, hit) in enumerate(zip(cands, hits)):
                if hit and rank < p.beam_width:
                    parent = self.beams[c.parent]
                    beam = Beam(None, parent.output + [c.token], parent.logprobs + [c.top], c.score)
                    reason = "stop" if c.token in ends else "length"
                    self.finished.append((c.score / ((generated + 1) ** p.length_penalty), beam, reason))
            self.finished.sort(key=lambda f: -f[0])
            del self.finished[p.beam_width :]
        if running and self.improvable and len(self.finished) >= p.beam_width:
            length = (self.max_new_tokens if p.early_stopping == "never" and p.length_penalty > 0 else generated + 1)
            best_possible = running[0].score / (length**p.length_penalty)
            self.improvable = best_possible > self.finished[-1][0]
        full = p.early_stopping is True and len(self.finished) >= p.beam_width
        self.done = not running or not self.improvable or full or last
        return [] if self.done else running

    def outputs(self, decode) -> BeamSearchOutput:
        """The finished beams, best first."""
        sequences = []
        for score, beam, reason in self.finished:
            tokens = self.prompt_token_ids + beam.output
            sequences.append(BeamSearchSequence(tokens, beam.logprobs, beam.score, score, decode(tokens) if decode else None, reason,
                                                len(beam.output)))  # fmt: skip
        return BeamSearchOutput(sequences)
