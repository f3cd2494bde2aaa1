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
        ids: list[int] = []
        pos: list[Tensor] = []
        slots: list[Tensor] = []
        prefill_meta: list[PrefillChunk] = []
        sample_rows: list[int] = []
        sample_chunks: list[int] = []
        decode_tables = []
        for index, c in decodes + prefills:
            seq, start, n = c.seq, c.seq.num_computed_tokens, c.num_tokens
            offset = len(ids)
            ids.extend(seq.token_ids[start : start + n])
            table = torch.tensor(seq.block_table, dtype=torch.int32)
            pos.append(torch.arange(start, start + n))
            slots.append(self._slots(table, start, start + n))
            if n == 1:
                decode_tables.append(table)
            else:
                prefill_meta.append(PrefillChunk(offset, n, start, table.unsqueeze(0)))
            if start + n == seq.num_tokens:
                sample_rows.append(offset + n - 1)
                sample_chunks.append(index)
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            decode_table = torch.zeros(len(decode_tables), width, dtype=torch.int64)
            for i, t in enumerate(decode_tables):
                decode_table[i, : len(t)] = t
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
