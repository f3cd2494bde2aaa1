"""Turns one scheduled step into model inputs, runs the forward pass and returns the logits to sample.

Step inputs (ids, positions, slot mapping, block tables, sequence lengths) are built on the host once per
step and copied to the model's device without blocking; nothing inside the layer loop reads back to the host.
Decode-only steps go through `DecodeGraphRunner` (static buffers, a CUDA graph per batch bucket) when one is
given and the batch fits its largest bucket, or on CPU through `CPUDecodeRunner` (the whole layer stack in one
native call); mixed and larger steps run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from spindle_model import LlamaModel

from .attention import CONTEXTS, PagedAttentionContext, PrefillChunk, TritonPagedAttentionContext, host_to_device
from .cpu_decode import CPUDecodeRunner
from .cuda_graphs import DecodeGraphRunner
from .flash_attention import FlashPagedAttentionContext
from .kv_cache import KVCache
from .sampler import TokenLogprobs
from .scheduler import ScheduledChunk

PROMPT_LOGPROB_ROWS = 256


def _prompt_targets(c: ScheduledChunk) -> int:
    """How many of the chunk's positions are followed by a prompt token whose logprob the request asked for."""
    seq = c.seq
    if seq.params.prompt_logprobs is None:
        return 0
    return max(0, min(seq.num_computed_tokens + c.num_tokens, seq.num_prompt_tokens - 1) - seq.num_computed_tokens)


@dataclass
class StepBatch:
    """One step's flat token batch, in the order the attention context expects: decode tokens (one-token chunks)
    first, then prefill chunks without history, then chunks continuing a cached history. Plain numbers only (a
    pipeline stage rebuilds it from the wire), plus the scheduled chunks where the scheduler made it."""

    starts: list[int]  # per chunk: the position of its first token
    lengths: list[int]  # per chunk: its tokens
    tables: list[list[int]]  # per chunk: its sequence's block table
    block_size: int
    token_ids: list[int] = field(default_factory=list)  # [T]: the first stage's input
    sample_rows: list[int] = field(default_factory=list)  # rows of the last token of chunks that sample
    sample_chunks: list[int] = field(default_factory=list)  # the scheduler's chunk index of each sample row
    ordered: list[ScheduledChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_decodes(self) -> int:
        return sum(1 for n in self.lengths if n == 1)

    @property
    def positions(self) -> list[int]:
        return [p for s, n in zip(self.starts, self.lengths, strict=True) for p in range(s, s + n)]

    @property
    def slots(self) -> list[int]:
        bs = self.block_size
        out: list[int] = []
        for s, n, table in zip(self.starts, self.lengths, self.tables, strict=True):
            out.extend(table[p // bs] * bs + p % bs for p in range(s, s + n))
        return out

    def prefill_chunks(self) -> list[PrefillChunk]:
        out, offset = [], 0
        for s, n, table in zip(self.starts, self.lengths, self.tables, strict=True):
            if n > 1:
                out.append(PrefillChunk(offset, n, s, table))
            offset += n
        return out


def step_batch(chunks: list[ScheduledChunk], block_size: int) -> StepBatch:
    """The batch of scheduled `chunks` (see StepBatch for the order)."""
    decodes = [(i, c) for i, c in enumerate(chunks) if c.num_tokens == 1]
    prefills = [(i, c) for i, c in enumerate(chunks) if c.num_tokens > 1 and c.seq.num_computed_tokens == 0]
    prefills += [(i, c) for i, c in enumerate(chunks) if c.num_tokens > 1 and c.seq.num_computed_tokens > 0]
    batch = StepBatch([], [], [], block_size)
    for index, c in decodes + prefills:
        seq, start, n = c.seq, c.seq.num_computed_tokens, c.num_tokens
        batch.starts.append(start)
        batch.lengths.append(n)
        batch.tables.append(seq.block_table)
        batch.token_ids.extend(seq.token_ids[start : start + n])
        batch.ordered.append(c)
        if start + n == seq.num_tokens:
            batch.sample_rows.append(len(batch.token_ids) - 1)
            batch.sample_chunks.append(index)
    return batch


AttentionContext = PagedAttentionContext | TritonPagedAttentionContext | FlashPagedAttentionContext


def attention_context(cache: KVCache, first_layer: int, backend: str, batch: StepBatch) -> AttentionContext:
    """The paged attention context `backend` (one of `attention.CONTEXTS`) of `batch` over `cache` (which holds
    layers from `first_layer` on)."""
    device = cache.k.device
    index_dtype = torch.int32 if backend in ("triton", "flash-attn") else torch.long
    num_decodes = batch.num_decodes
    lens = [s + 1 for s in batch.starts[:num_decodes]]
    if num_decodes:
        tables = batch.tables[:num_decodes]
        width = max(len(t) for t in tables)
        decode_table = host_to_device([t + [0] * (width - len(t)) for t in tables], index_dtype, device)
    else:
        decode_table = torch.zeros(0, 1, dtype=index_dtype, device=device)
    decode_lens = host_to_device(lens, index_dtype, device)
    slot_mapping = host_to_device(batch.slots, torch.long, device)
    prefills = batch.prefill_chunks()
    args = (cache, first_layer, slot_mapping, num_decodes, decode_table, decode_lens, prefills)
    if backend == "triton":
        return TritonPagedAttentionContext(*args, decode_max_len=max(lens, default=0))
    if backend == "flash-attn":
        return FlashPagedAttentionContext(*args, decode_max_len=max(lens, default=0))
    return PagedAttentionContext(*args, native=backend == "torch")


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        *,
        attention_backend: str = "torch",
        decode_graphs: DecodeGraphRunner | None = None,
        cpu_decode: CPUDecodeRunner | None = None,
    ) -> None:
        if attention_backend not in CONTEXTS:
            raise ValueError(f"attention_backend must be one of {CONTEXTS}, got {attention_backend!r}")
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size
        self.device = cache.k.device
        self.attention_backend = attention_backend
        self.decode_graphs = decode_graphs
        self.cpu_decode = cpu_decode

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> tuple[Tensor, list[int]]:
        """Run one step. Returns fp32 logits `[N, vocab]` (on the model's device) and the indices into `chunks`
        they belong to: one row for every chunk that completes its sequence's known tokens (a token is sampled).
        After a decode-only step through the graph runner the logits are a view of its static buffer, valid until
        the next step."""
        wants_prompt_logprobs = any(_prompt_targets(c) for c in chunks)
        for runner in (self.decode_graphs, self.cpu_decode):
            if wants_prompt_logprobs:
                break  # the fast paths compute no prompt logprobs
            if runner is not None and (out := self._run_decode_only(runner, chunks)) is not None:
                return out
        batch = step_batch(chunks, self.block_size)
        rows = None if wants_prompt_logprobs else batch.sample_rows
        hidden = self.forward(batch, rows)
        if wants_prompt_logprobs:
            offset = 0
            for c in batch.ordered:
                if (targets := _prompt_targets(c)) > 0:  # a recomputed chunk (after preemption) overwrites its own
                    start = c.seq.num_computed_tokens
                    c.seq.prompt_logprobs[start : start + targets] = self._prompt_logprobs(
                        hidden[offset : offset + targets], c
                    )
                offset += c.num_tokens
            hidden = hidden[host_to_device(batch.sample_rows, torch.long, self.device)]
        return self.compute_logits(hidden), batch.sample_chunks

    def forward(self, batch: StepBatch, rows: list[int] | None) -> Tensor:
        """The last layer's (final-norm) hidden states of the step: rows `rows` of it, or every row when None."""
        ctx = self._context(batch)
        hidden = self.model(
            host_to_device(batch.positions, torch.long, self.device),
            ctx,
            input_ids=host_to_device(batch.token_ids, torch.long, self.device),
        )  # [T, H]
        return hidden if rows is None else hidden[host_to_device(rows, torch.long, self.device)]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Final-norm hidden states `[N, H]` -> fp32 logits `[N, vocab]`."""
        return self.model.compute_logits(hidden)

    def _prompt_logprobs(self, hidden: Tensor, c: ScheduledChunk) -> list[TokenLogprobs]:
        """The logprobs of the prompt tokens that follow each of `hidden`'s positions (`[n, H]`, positions
        `num_computed_tokens`.. of `c.seq`), with the `params.prompt_logprobs` most likely alternatives. In slices
        of PROMPT_LOGPROB_ROWS positions: a whole chunk's logits would be `[n, vocab]` fp32 (400 MB at 2k)."""
        seq, start = c.seq, c.seq.num_computed_tokens
        top_n = seq.params.prompt_logprobs or 0
        out = []
        for a in range(0, hidden.shape[0], PROMPT_LOGPROB_ROWS):
            lp = torch.log_softmax(self.compute_logits(hidden[a : a + PROMPT_LOGPROB_ROWS]), dim=-1).cpu()
            targets = torch.tensor(seq.token_ids[start + a + 1 : start + a + 1 + lp.shape[0]])  # [rows]
            chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
            top = torch.topk(lp, top_n) if top_n else None
            for i, t in enumerate(targets.tolist()):
                ids = tuple(top.indices[i].tolist()) if top is not None else ()
                values = tuple(top.values[i].tolist()) if top is not None else ()
                out.append(TokenLogprobs(t, chosen[i], ids, values))
        return out

    def _decode_inputs(self, chunks: list[ScheduledChunk]) -> tuple[list[int], ...]:
        """ids, positions, slots, sequence lengths, block tables and sampled rows of a decode-only step."""
        bs = self.block_size
        ids, pos, slots, lens, tables, sample_rows = [], [], [], [], [], []
        for i, c in enumerate(chunks):
            seq, p = c.seq, c.seq.num_computed_tokens
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            lens.append(p + 1)
            tables.append(seq.block_table)
            if p + 1 == seq.num_tokens:
                sample_rows.append(i)
        return ids, pos, slots, lens, tables, sample_rows

    def _run_decode_only(
        self, runner: DecodeGraphRunner | CPUDecodeRunner, chunks: list[ScheduledChunk]
    ) -> tuple[Tensor, list[int]] | None:
        """A decode-only step through `runner`; None when the step does not qualify."""
        if any(c.num_tokens != 1 for c in chunks):
            return None
        if not runner.fits(len(chunks), max(len(c.seq.block_table) for c in chunks)):
            return None
        ids, pos, slots, lens, tables, sample_rows = self._decode_inputs(chunks)
        logits = runner.run(ids, pos, slots, lens, tables)
        if len(sample_rows) < len(chunks):
            logits = logits[host_to_device(sample_rows, torch.long, self.device)]
        return logits, sample_rows

    def _context(self, batch: StepBatch) -> AttentionContext:
        return attention_context(self.cache, self.model.layer_range[0], self.attention_backend, batch)
