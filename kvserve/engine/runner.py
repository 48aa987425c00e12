"""Turns a scheduled batch into one flat forward pass over the paged pool."""

from __future__ import annotations

import torch

from kvserve.engine.sampler import SampleResult, Sampler
from kvserve.engine.scheduler import ScheduledBatch
from kvserve.engine.sequence import Sequence
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pool import PagedKVPool
from kvserve.model.attention import AttentionMetadata, PrefillSpan
from kvserve.model.transformer import CausalLM


class ModelRunner:
    def __init__(
        self, model: CausalLM, pool: PagedKVPool, kv: KVCacheManager, device: torch.device, sampler: Sampler, attention_backend: str
    ) -> None:
        self.model = model
        self.sampler = sampler
        self.pool = pool
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        self.attention_backend = attention_backend

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[tuple[Sequence, SampleResult]]:
        """Run the batch and sample: one result for every sequence whose prompt is fully computed.

        Plain greedy rows (no logprobs, no penalties) take the lm_head's argmax without full logits.
        """
        samplers, hidden = self.forward_hidden(batch)
        if not samplers:
            return []
        plain = [i for i, s in enumerate(samplers) if s.params.greedy and s.params.logprobs is None and not s.params.uses_penalties]
        rest = sorted(set(range(len(samplers))) - set(plain))
        results: list[SampleResult | None] = [None] * len(samplers)
        if plain:
            tokens = self.model.greedy_tokens(hidden[torch.tensor(plain, device=self.device)]).tolist()
            for i, token in zip(plain, tokens):
                results[i] = SampleResult(token, None)
        if rest:
            logits = self.model.compute_logits(hidden[torch.tensor(rest, device=self.device)])
            for i, result in zip(rest, self.sampler.sample(logits, [samplers[i] for i in rest])):
                results[i] = result
        return list(zip(samplers, results))

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor]:
        """Run the batch; returns the sequences that sample this step and their logits [S, V]."""
        samplers, hidden = self.forward_hidden(batch)
        if not samplers:
            return [], torch.empty(0)
        return samplers, self.model.compute_logits(hidden)

    @torch.inference_mode()
    def forward_hidden(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor]:
        """Run the batch; returns the sequences that sample this step and their last hidden states [S, hidden]."""
        decodes = [(s, n) for s, n in batch.entries if n == 1]
        prefills = [(s, n) for s, n in batch.entries if n > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[torch.Tensor] = []
        sample_rows: list[int] = []
        samplers: list[Sequence] = []
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), attention_backend=self.attention_backend)

        if decodes:
            lengths = torch.tensor([s.num_computed_tokens + 1 for s, _ in decodes])
            max_blocks = -(-int(lengths.max()) // self.block_size)
            tables = torch.zeros(len(decodes), max_blocks, dtype=torch.long)
            for row, (seq, _) in enumerate(decodes):
                pos = seq.num_computed_tokens
                input_ids.append(seq.token_ids[pos])
                positions.append(pos)
                table = self.kv.block_table(seq.request_id)[:max_blocks]
                tables[row, : len(table)] = torch.tensor(table)
                if pos + 1 == seq.num_tokens:
                    sample_rows.append(row)
                    samplers.append(seq)
            query_pos = lengths - 1
            rows = torch.arange(len(decodes))
            slot_mapping.append(tables[rows, query_pos // self.block_size] * self.block_size + query_pos % self.block_size)
            meta.num_decode_tokens = len(decodes)
            meta.decode_block_tables = tables.to(self.device)
            meta.decode_context_lens = lengths.to(self.device)

        for seq, n in prefills:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            row = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            blocks = torch.tensor(self.kv.block_table(seq.request_id)[: -(-end // self.block_size)], dtype=torch.long)
            positions_new = torch.arange(start, end)
            slot_mapping.append(blocks[positions_new // self.block_size] * self.block_size + positions_new % self.block_size)
            meta.prefills.append(PrefillSpan(row, row + n, start, blocks.to(self.device)))
            if end == seq.num_tokens:
                sample_rows.append(row + n - 1)
                samplers.append(seq)

        meta.slot_mapping = torch.cat(slot_mapping).to(self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return samplers, self.model(ids, pos, self.pool, meta, output_rows=rows)


class SimulatedRunner:
    """Stands in for the model in trace replay: every sequence that would sample gets token 0."""

    def execute(self, batch: ScheduledBatch) -> list[tuple[Sequence, SampleResult]]:
        return [
            (seq, SampleResult(0, None))
            for seq, n in batch.entries
            if seq.num_computed_tokens + n == seq.num_tokens
        ]
