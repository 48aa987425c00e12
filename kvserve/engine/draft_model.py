"""speculative_config method "draft_model": a smaller model with the target's vocabulary guesses the next tokens.

The draft runs in an engine of its own (its paged KV pool of `draft_kv_cache_memory` GiB, prefix
caching on, token ids only). Each step, every sequence that guesses becomes one greedy draft request
of k tokens over its whole token list, and the draft engine steps until all are done: the requests
ride in one flat batch, and the prefix cache keeps what the draft computed before, so a request
computes only what is new since the last guess (the tokens kept since, and the partly filled last
block). Guesses the target rejected live on only as cached blocks under their own hashes, which
nothing with the accepted tokens matches: the draft's rollback is the prefix cache's.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING

from kvserve.config import EngineConfig
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.sequence import Sequence
    from kvserve.model.config import ModelConfig


class DraftModel:
    def __init__(self, target: EngineConfig, target_model: ModelConfig, model: str, kv_cache_memory: float) -> None:
        from kvserve.engine.engine import LLMEngine

        config = dataclasses.replace(
            target, model=model, weight_dtype="auto", kv_cache_dtype="auto", kv_cache_memory=kv_cache_memory, num_kv_blocks=None,
            max_model_len=None, enable_prefix_caching=True, prefix_cache="hash", skip_tokenizer_init=True, speculative_config=None,
            kv_compression="none", kv_keep_ratio=None, kv_budget=None, kv_offload_host_gib=0.0, kv_offload_disk_dir=None,
            kv_offload_disk_gib=None, kv_remote_url=None, kv_remote_key_file=None, kv_role="both", kv_hadamard=None, block_size=None,
            kv_cache_scales=None,
        )  # fmt: skip
        self.engine = LLMEngine(config)
        vocab = self.engine.model_config.vocab_size
        if vocab != target_model.vocab_size:
            raise ValueError(f"the draft model {model} has a vocabulary of {vocab} tokens and the target {target_model.vocab_size}: "
                             "a draft must share the target's tokenizer and vocabulary")  # fmt: skip
        self._ids = itertools.count()

    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """k greedy draft tokens after each sequence's tokens ([] where the draft's context is too short)."""
        engine = self.engine
        requests = {}
        for i, (seq, k) in enumerate(wanted):
            if len(seq.token_ids) + k > engine.max_model_len:
                continue
            draft = engine.add_request(list(seq.token_ids), SamplingParams(max_tokens=k, temperature=0, ignore_eos=True),
                                       request_id=f"draft-{next(self._ids)}", cache_salt=seq.cache_salt)  # fmt: skip
            requests[draft.request_id] = i
        guesses: list[list[int]] = [[] for _ in wanted]
        while requests and engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in requests:
                    guesses[requests.pop(out.request_id)] = list(out.token_ids) if out.finish_reason != "error" else []
        return guesses

    def forget(self, request_id: str) -> None:
        """Nothing to drop: a finished sequence's draft blocks stay cached until the draft pool needs them."""
