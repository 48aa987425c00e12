"""The grammar's token mask on a step's logits: forbidden tokens get -inf before sampling."""

from __future__ import annotations

import torch

from kvserve.structured.compiler import xgrammar_module


class GrammarMask:
    """Fills the masks of a step's constrained rows together (xgrammar's batch matcher) and applies them."""

    def __init__(self) -> None:
        self._batch = None
        self._bitmask: torch.Tensor | None = None  # reused across steps; only the rows filled this step are read

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list) -> list[int]:
        """Masks row rows[i] of logits [R, V] by matchers[i]; returns the rows no token is allowed in."""
        xgr = xgrammar_module()
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        count, vocab = logits.shape
        words = xgr.get_bitmask_shape(1, vocab)[1]
        if self._bitmask is None or self._bitmask.shape[0] < count or self._bitmask.shape[1] != words:
            self._bitmask = xgr.allocate_token_bitmask(max(count, 64), vocab)
        bitmask = self._bitmask[:count]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        index = torch.tensor(rows, device=logits.device)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab, indices=rows)
        allowed = torch.isfinite(logits.index_select(0, index).amax(dim=1)).tolist()
        return [row for row, ok in zip(rows, allowed) if not ok]
