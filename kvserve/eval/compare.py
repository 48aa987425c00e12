"""Next-token distributions of two runs along the same text: perplexity, KL divergence, top-1 agreement."""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROWS_PER_CHUNK = 128  # [128, 262K] float32 is 128 MiB: Gemma's vocabulary bounds the chunk


@dataclass
class TextScores:
    """Sums over scored positions (position i predicts token i + 1)."""

    positions: int = 0
    nll: float = 0.0  # this run's negative log-likelihood of the text
    kl: float = 0.0  # KL(reference || this run) of the next-token distributions
    top1_agree: int = 0  # positions where both runs rank the same token first

    def add(self, other: "TextScores") -> None:
        self.positions += other.positions
        self.nll += other.nll
        self.kl += other.kl
        self.top1_agree += other.top1_agree


def _log_probs(model, hidden: torch.Tensor) -> torch.Tensor:
    # compute_logits reuses its buffers: take a float32 copy before the next call
    return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


@torch.inference_mode()
def score_window(model, hidden: torch.Tensor, token_ids: list[int], ref_model=None, ref_hidden: torch.Tensor | None = None) -> TextScores:
    """Scores of one window from its hidden states; against a reference run when one is given."""
    targets = torch.tensor(token_ids[1:], dtype=torch.long, device=hidden.device)
    scores = TextScores(positions=len(targets))
    for start in range(0, len(targets), ROWS_PER_CHUNK):
        end = min(start + ROWS_PER_CHUNK, len(targets))
        logp = _log_probs(model, hidden[start:end])
        scores.nll -= logp.gather(1, targets[start:end, None]).sum().item()
        if ref_model is not None:
            ref_logp = _log_probs(ref_model, ref_hidden[start:end].to(hidden.device))
            # each position's KL is >= 0; its float sum can come out a hair below when the two agree
            scores.kl += (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0).sum().item()
            scores.top1_agree += (ref_logp.argmax(-1) == logp.argmax(-1)).sum().item()
    return scores
