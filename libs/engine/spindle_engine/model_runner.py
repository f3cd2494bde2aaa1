"""Turns one scheduled step into model inputs, runs the forward pass and returns the logits to sample."""

from __future__ import annotations

import torch
from torch import Tensor

from spindle_model import LlamaModel

from .attention import PagedAttentionContext, PrefillChunk
from .kv_cache import KVCache
from .scheduler import ScheduledChunk


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size

    def _slots(self, table: Tensor, start: int, end: int) -> Tensor:
        pos = torch.arange(start, end)
        return table[pos // self.block_size].long() * self.block_size + pos % self.block_size

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> tuple[Tensor, list[int]]:
        """Run one step. Returns fp32 logits `[N, vocab]` and the indices into `chunks` they belong to:
        one row for every chunk that completes its sequence's known tokens (so a token is sampled)."""
        # decode tokens first, then prefill chunks; keep each chunk's index for the caller
        decodes = [(i, c) for i, c in enumerate(chunks) if c.num_tokens == 1]
        prefills = [(i, c) for i, c in enumerate(chunks) if c.num_tokens > 1]
        bs = self.block_size
        # decode tokens: positions and cache slots in plain Python (one tensor each, not a few per sequence)
        ids: list[int] = []
        dec_pos: list[int] = []
        dec_slots: list[int] = []
        sample_rows: list[int] = []
        sample_chunks: list[int] = []
        for index, c in decodes:
            seq, start = c.seq, c.seq.num_computed_tokens
            ids.append(seq.token_ids[start])
            dec_pos.append(start)
            dec_slots.append(seq.block_table[start // bs] * bs + start % bs)
            if start + 1 == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_chunks.append(index)
        pos: list[Tensor] = [torch.tensor(dec_pos, dtype=torch.long)]
        slots: list[Tensor] = [torch.tensor(dec_slots, dtype=torch.long)]
        prefill_meta: list[PrefillChunk] = []
        for index, c in prefills:
            seq, start, n = c.seq, c.seq.num_computed_tokens, c.num_tokens
            offset = len(ids)
            ids.extend(seq.token_ids[start : start + n])
            table = torch.tensor(seq.block_table, dtype=torch.int32)
            pos.append(torch.arange(start, start + n))
            slots.append(self._slots(table, start, start + n))
            prefill_meta.append(PrefillChunk(offset, n, start, table.unsqueeze(0)))
            if start + n == seq.num_tokens:
                sample_rows.append(offset + n - 1)
                sample_chunks.append(index)
        if decodes:
            tables = [c.seq.block_table for _, c in decodes]
            width = max(len(t) for t in tables)
            decode_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
            decode_lens = torch.tensor([c.seq.num_computed_tokens + 1 for _, c in decodes])
        else:
            decode_table = torch.zeros(0, 1, dtype=torch.int32)
            decode_lens = torch.zeros(0, dtype=torch.int64)
        positions = torch.cat(pos)
        ctx = PagedAttentionContext(
            self.cache,
            self.model.layer_range[0],
            torch.cat(slots),
            len(decodes),
            decode_table,
            decode_lens,
            prefill_meta,
        )
        hidden = self.model(positions, ctx, input_ids=torch.tensor(ids))  # [T, H]
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, dtype=torch.long)])
        return logits, sample_chunks
