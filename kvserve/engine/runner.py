"""Turns a scheduled batch into one flat forward pass over the paged pool."""

from __future__ import annotations

import numpy as np
import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata, PrefillSpan, WindowScoreSpan
from kvserve.engine.sampler import SampleResult, Sampler
from kvserve.engine.scheduler import ScheduledBatch
from kvserve.engine.sequence import Sequence, TokenLogprobs
from kvserve.kv.manager import KVCacheManager
from kvserve.lora.manager import LoRAManager
from kvserve.lora.rows import LoRARows
from kvserve.model.transformer import CausalLM

# Up to this many sampled rows draw from the int8 screen (kernels.sampling.screened_sample): each row
# recomputes its own tiles in bf16 and scans the vocabulary on its own, where a larger batch shares
# one full product (on Gemma 3 270M, one row 7.2 ms against 12.0, three 10.1 against 12.8, four
# 12.6 against 13.6 before the top-p rows the screen leaves to the full product).
SCREENED_SAMPLE_MAX_ROWS = 3
# prompt logprobs take the logits of this many rows at a time: [32, 262K] float32 is 34 MB
PROMPT_LOGPROB_ROWS = 32


class ModelRunner:
    def __init__(self, model: CausalLM, attention: AttentionBackend, kv: KVCacheManager, device: torch.device, sampler: Sampler,
                 lora: LoRAManager | None = None) -> None:  # fmt: skip
        self.model = model
        self.lora = lora
        self.attention = attention
        self.sampler = sampler
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[tuple[Sequence, SampleResult]]:
        """Run the batch and sample: one result for every sequence whose prompt is fully computed.

        Plain greedy rows (no logprobs, no penalties, no grammar) take the lm_head's argmax without full
        logits, and up to SCREENED_SAMPLE_MAX_ROWS sampled rows without logprobs or grammar draw from its
        int8 screen; the rest sample from full logits, masked by their grammars.
        """
        samplers, hidden, positions = self.forward_hidden(batch, with_positions=True)
        if not samplers:
            return []
        plain = [i for i, s in enumerate(samplers)
                 if s.params.greedy and s.params.logprobs is None and not s.params.uses_penalties and s.grammar is None]  # fmt: skip
        rest = sorted(set(range(len(samplers))) - set(plain))
        results: list[SampleResult | None] = [None] * len(samplers)
        if plain:
            tokens = self.model.greedy_tokens(hidden[torch.tensor(plain, device=self.device)]).tolist()
            for i, token in zip(plain, tokens):
                results[i] = SampleResult(token, None)
        if rest:
            rest = self._sample_screened(hidden, rest, samplers, positions, results)
        if rest:
            logits = self.model.compute_logits(hidden[torch.tensor(rest, device=self.device)])
            for i, result in zip(rest, self.sampler.sample(logits, [samplers[i] for i in rest], [positions[i] for i in rest])):
                results[i] = result
        return list(zip(samplers, results))

    def _sample_screened(self, hidden: torch.Tensor, rest: list[int], samplers: list[Sequence], positions: list[int],
                         results: list) -> list[int]:  # fmt: skip
        """A few sampled rows (no logprobs) draw from the int8-screened lm_head, exactly the tokens the
        full logits would give, at greedy's cost; returns the rows still to sample from full logits."""
        picked = [i for i in rest if not samplers[i].params.greedy and samplers[i].params.logprobs is None and samplers[i].grammar is None]
        if not picked or len(picked) > SCREENED_SAMPLE_MAX_ROWS or not self.sampler.native or self.device.type != "cpu":
            return rest
        rows, penalty_ids, penalty_counts = self.sampler.rows([samplers[i] for i in picked], self.model.config.vocab_size,
                                                              [positions[i] for i in picked])  # fmt: skip
        tokens = self.model.screened_sample(hidden[torch.tensor(picked)], rows, penalty_ids, penalty_counts)
        if tokens is None:
            return rest
        done = set()
        for i, token in zip(picked, tokens.tolist()):
            if token >= 0:
                results[i] = SampleResult(token, None)
                done.add(i)
        return [i for i in rest if i not in done]

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor]:
        """Run the batch; returns the sequences that sample this step and their logits [S, V]."""
        samplers, hidden = self.forward_hidden(batch)
        if not samplers:
            return [], torch.empty(0)
        return samplers, self.model.compute_logits(hidden).clone()  # compute_logits reuses its buffer

    @torch.inference_mode()
    def forward_hidden(self, batch: ScheduledBatch, with_positions: bool = False):
        """Run the batch; returns the sequences that sample this step and their last hidden states [S, hidden]
        (and, `with_positions`, the position each row samples, which seeds its draw). A sequence
        verifying guesses samples once per row. The rows that score prompt tokens (prompt logprobs) are
        scored on the way."""
        samplers, hidden, scored, positions = self._forward(batch)
        if scored:
            self._score_prompts(scored)
        return (samplers, hidden, positions) if with_positions else (samplers, hidden)

    def _forward(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor, list[tuple[Sequence, int, torch.Tensor]], list[int]]:
        """forward_hidden's pass, with the rows that score prompt tokens: (sequence, first position scored, hidden rows)."""
        meta, input_ids, sample_rows, samplers, positions = self.prepare(batch)
        captures = [(seq, start, n) for seq, n in batch.entries if seq.captured is not None and seq.probe is None
                    for start in [self._first_row(batch, seq)]]  # fmt: skip
        prompt_rows = self._prompt_rows(batch)
        extra = [np.arange(start, start + n) for _, start, n in captures] + [rows for _, _, rows in prompt_rows]
        if extra:  # scoring: every row of these sequences (prompt logprobs: the rows that score prompt tokens), after the rows that sample
            sample_rows = np.concatenate([sample_rows, *extra])
        ids = torch.from_numpy(input_ids).to(self.device)
        every_row = len(sample_rows) == len(input_ids) and bool((sample_rows == np.arange(len(input_ids))).all())  # a decode step
        rows = None if every_row else torch.from_numpy(sample_rows).to(self.device)
        lora = self._lora_rows(batch) if self.lora is not None else None
        hidden = self.model(ids, self.attention, meta, output_rows=rows, lora=lora)
        at = len(samplers)
        for seq, _, n in captures:
            seq.captured.append(hidden[at : at + n].clone())
            at += n
        scored = []
        for seq, first, rows in prompt_rows:
            scored.append((seq, first, hidden[at : at + len(rows)]))
            at += len(rows)
        return samplers, hidden[: len(samplers)], scored, positions

    def _lora_rows(self, batch: ScheduledBatch) -> LoRARows | None:
        """Each flat row's adapter, laid out as prepare() lays the rows out (decodes, then prefill chunks)."""
        if all(seq.lora is None for seq, _ in batch.entries):
            return None
        handles = [s.lora for s, n in batch.entries if n == 1]
        for seq, n in batch.entries:
            if n > 1:
                handles.extend([seq.lora] * n)
        return self.lora.rows(handles)

    def _prompt_rows(self, batch: ScheduledBatch) -> list[tuple[Sequence, int, np.ndarray]]:
        """For each sequence still scoring its prompt: the first prompt position this step scores and the
        flat rows that score it and the ones after (row of position p scores the token at p + 1)."""
        out = []
        for seq, n in batch.entries:
            if not seq.prompt_scores_pending:
                continue
            start = seq.num_computed_tokens
            end = start + n if seq.probe is None else min(start + n, seq.probe_from)  # a generic question's rows score nothing
            first = max(len(seq.prompt_logprobs), start + 1)  # a recomputed row (after a preemption) scores nothing new
            last = min(end, seq.prompt_len - 1)  # the last prompt row predicts the first generated token
            if first <= last:
                row = self._first_row(batch, seq) + first - 1 - start
                out.append((seq, first, np.arange(row, row + last - first + 1)))
        return out

    def _score_prompts(self, scored: list[tuple[Sequence, int, torch.Tensor]]) -> None:
        """Prompt logprobs of the rows scored this step, in blocks of rows that bound the [rows, vocab] logits."""
        for seq, first, hidden in scored:
            if len(seq.prompt_logprobs) != first:  # positions must arrive in order
                raise RuntimeError(f"prompt logprobs of {seq.request_id}: position {first} after {len(seq.prompt_logprobs)}")
            targets = seq.prompt_token_ids[first : first + hidden.shape[0]]
            seq.prompt_logprobs.extend(self.token_logprobs(hidden, targets, seq.params.prompt_logprobs))

    def token_logprobs(self, hidden: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprobs]:
        """Each row's logprob of its target token, the target's rank and the row's top `top` tokens."""
        out: list[TokenLogprobs] = []
        for begin in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[begin : begin + PROMPT_LOGPROB_ROWS]).float(), dim=-1)
            target = torch.tensor(targets[begin : begin + PROMPT_LOGPROB_ROWS], device=logprobs.device)
            chosen = logprobs.gather(1, target[:, None])
            ranks = (logprobs > chosen).sum(dim=1) + 1
            values, ids = logprobs.topk(top, dim=1) if top else (logprobs[:, :0], target[:, None][:, :0])
            for token, value, rank, top_ids, top_values in zip(target.tolist(), chosen[:, 0].tolist(), ranks.tolist(),
                                                                ids.tolist(), values.tolist()):  # fmt: skip
                out.append(TokenLogprobs(token, value, dict(zip(top_ids, top_values)), rank))
        return out

    @staticmethod
    def _first_row(batch: ScheduledBatch, seq: Sequence) -> int:
        """The flat row of seq's first token in a batch laid out as prepare() lays it out."""
        decodes = [s for s, n in batch.entries if n == 1]
        if seq in decodes:
            return decodes.index(seq)
        row = len(decodes)
        for s, n in batch.entries:
            if n > 1:
                if s is seq:
                    return row
                row += n
        raise ValueError("sequence not in the batch")

    def prepare(self, batch: ScheduledBatch) -> tuple[AttentionMetadata, np.ndarray, np.ndarray, list[Sequence], list[int]]:
        """The step's attention metadata, flat input ids, the rows that sample, their sequences and the
        positions they sample at: decode rows first (one token per sequence), then each prefill chunk
        (a sequence verifying guesses is one: every row of it samples)."""
        bs = self.block_size
        groups = len(self.kv.groups)
        decodes = [s for s, n in batch.entries if n == 1]
        prefills = [(s, n) for s, n in batch.entries if n > 1]
        ids_parts, position_parts = [], []
        slot_parts: list[list[np.ndarray]] = [[] for _ in range(groups)]
        sample_rows: list[int] = []
        samplers: list[Sequence] = []
        sample_positions: list[int] = []  # the position of the token a row draws: its own position + 1
        meta = AttentionMetadata(positions=torch.empty(0), slot_mappings=[])

        if decodes:
            positions = np.fromiter((s.num_computed_tokens for s in decodes), dtype=np.int64, count=len(decodes))
            ids_parts.append(np.fromiter((s.input_id(s.num_computed_tokens) for s in decodes), dtype=np.int64, count=len(decodes)))
            position_parts.append(positions)
            evicted = np.fromiter((self.kv.num_evicted(s.request_id) for s in decodes), dtype=np.int64, count=len(decodes))
            full_slots = positions - evicted if evicted.any() else positions  # a sliding group's slots are positions
            slots = [positions if self.kv.groups[g].window is not None else full_slots for g in range(groups)]
            tables = self.kv.block_id_rows([s.request_id for s in decodes], -(-int(positions.max() + 1) // bs))
            rows = np.arange(len(decodes))
            for g, table in enumerate(tables):
                slot_parts[g].append(table[rows, slots[g] // bs] * bs + slots[g] % bs)
            for row, seq in enumerate(decodes):
                if seq.eviction is not None:
                    meta.window_scores += self._window_spans(seq, row, int(positions[row]), int(positions[row]) + 1, [t[row] for t in tables])
                if seq.num_computed_tokens + 1 == seq.num_tokens and seq.probe is None:
                    for sampler in (seq, *seq.forks):  # forks sample their first token from the parent's logits
                        sample_rows.append(row)
                        samplers.append(sampler)
                        sample_positions.append(seq.num_tokens)
            meta.num_decode_tokens = len(decodes)
            position_lens = torch.from_numpy(positions + 1).to(self.device)
            slot_lens = position_lens if full_slots is positions else torch.from_numpy(full_slots + 1).to(self.device)
            meta.decode_kv_lens = [position_lens if self.kv.groups[g].window is not None else slot_lens for g in range(groups)]
            meta.decode_block_tables = [torch.from_numpy(t).to(self.device) for t in tables]

        row = len(decodes)
        for seq, n in prefills:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            positions = np.arange(start, end, dtype=np.int64)
            ids_parts.append(np.asarray(seq.input_ids(start, end), dtype=np.int64))
            position_parts.append(positions)
            evicted = [self.kv.num_evicted(seq.request_id, g) for g in range(groups)]
            tables = [t[0] for t in self.kv.block_id_rows([seq.request_id], -(-end // bs))]
            for g, table in enumerate(tables):
                slots = positions - evicted[g]
                slot_parts[g].append(table[slots // bs] * bs + slots % bs)
            meta.prefills.append(PrefillSpan(row, row + n, [start - e for e in evicted], [torch.from_numpy(t).to(self.device) for t in tables]))
            if seq.eviction is not None:
                meta.window_scores += self._window_spans(seq, row, start, end, tables)
            if seq.probe is not None and start < seq.probe_from <= end and seq.probe_from == len(seq.token_ids):
                # the prompt's last row, followed in this chunk by the generic question, draws the first token
                for sampler in (seq, *seq.forks):
                    sample_rows.append(row + seq.probe_from - 1 - start)
                    samplers.append(sampler)
                    sample_positions.append(seq.probe_from)
            if end == seq.num_tokens and seq.probe is None:  # the generic question's last row samples nothing
                if seq.draft_token_ids:  # a verification: the last token's row and every guess's
                    first = len(seq.token_ids) - 1 - start
                    sample_rows.extend(range(row + first, row + n))
                    samplers.extend([seq] * (n - first))
                    sample_positions.extend(range(start + first + 1, end + 1))
                for sampler in (seq, *seq.forks) if not seq.draft_token_ids else ():
                    sample_rows.append(row + n - 1)
                    samplers.append(sampler)
                    sample_positions.append(end)
            row += n

        for span in meta.window_scores:
            span.block_tables = [torch.as_tensor(t).to(self.device) for t in span.block_tables]
        meta.positions = torch.from_numpy(np.concatenate(position_parts)).to(self.device)
        meta.slot_mappings = [torch.from_numpy(np.concatenate(parts)).to(self.device) for parts in slot_parts]
        return meta, np.concatenate(ids_parts), np.asarray(sample_rows, dtype=np.int64), samplers, sample_positions

    def _window_spans(self, seq: Sequence, row: int, start: int, end: int, tables: list[np.ndarray]) -> list[WindowScoreSpan]:
        """The rows of positions [start, end), flat rows from `row` on, that score a prompt to be compressed:
        its SnapKV window's queries, then the generic question's that follows it (every row of it); the
        two in one span (one read of the keys) when this chunk holds both."""
        policy, evicted = seq.eviction, self.kv.num_evicted(seq.request_id)
        total = seq.probe_from if seq.probe is not None else seq.compression_point
        window_start = policy.window_start(total, self.kv.block_size)
        first, last = max(start, window_start), min(end, total)
        window = (policy.scores_window and not seq.eviction_started and first < last
                  and seq.compression_region(self.kv.block_size).compresses(total))  # fmt: skip
        if seq.probe is None or end <= seq.probe_from:
            return [WindowScoreSpan(row + first - start, row + last - start, first - evicted, tables, self._scores_of(seq, total))] if window else []
        weight = policy.question_query_weight(seq.probe_from - window_start, len(seq.probe))
        asked = max(start, seq.probe_from)
        begin = first if window else asked  # a window ends where the question begins
        return [WindowScoreSpan(row + begin - start, row + end - start, begin - evicted, tables, self._scores_of(seq, seq.probe_from),
                                context=seq.probe_from, weight=weight, weighted_from=asked - begin)]  # fmt: skip

    def _scores_of(self, seq: Sequence, total: int) -> torch.Tensor:
        """seq's SnapKV scores [layers, kv_heads, total], zeros until its first scored rows."""
        if seq.window_scores is None:
            spec = self.kv.spec
            seq.window_scores = torch.zeros(spec.num_layers, spec.num_kv_heads, total, device=self.device)
        return seq.window_scores


class SimulatedRunner:
    """Stands in for the model in trace replay: every sequence that would sample gets token 0."""

    def execute(self, batch: ScheduledBatch) -> list[tuple[Sequence, SampleResult]]:
        return [
            (sampler, SampleResult(0, None))
            for seq, n in batch.entries
            if seq.num_computed_tokens + n == seq.num_tokens
            for sampler in (seq, *seq.forks)
        ]
