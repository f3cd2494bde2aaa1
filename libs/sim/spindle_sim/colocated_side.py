"""The simulator's colocated instances under a plan-at-arrival strategy (`chunked`): each one batches as the
engine on the stack does, and as vLLM's and Sarathi-Serve's schedulers do, under a per-step token budget.

Every step takes, in order, until the budget (`Strategy.step_token_budget`) runs out: one token for every running
decode; the next piece of each prompt already being prefilled, in admission order; then waiting prompts, FCFS, each
admitted when blocks for its whole sequence (prompt and every output token) fit, so a running batch never needs
preemption. A prompt's piece is as long as what is left of it or of the budget, so a step packs several prompts'
chunks. The plan's own chunk boundaries are not used: the instance chunks by its budget, as the engine does.
The step is priced by `prices.step` (prices.py) from what it holds, the price every strategy's
single-instance iterations pay.

What differs from the engine: it admits a prompt only when its whole sequence fits (the engine admits a chunk
whose blocks fit and preempts the newest request when a running one cannot grow), and it runs decodes before the
pieces of prompts still prefilling (the engine runs its running requests in admission order, both kinds mixed).
"""

from __future__ import annotations

from .base import SimBase
from .cluster import SimColocated
from .metrics import RequestRecord


class ColocatedSide(SimBase):
    def _queue_prompt(self, c: SimColocated, rec: RequestRecord) -> None:
        c.prompts.append(rec)
        c.queued_tokens += rec.num_prefill_tokens

    def _colocated_step(self, c: SimColocated, now: float) -> float | None:
        """Compose `c`'s next step (its decodes in `c.step_batch`, its prompt pieces in `c.step_chunks`) and
        return its seconds; None when there is nothing to run."""
        budget = self.step_budget
        decodes = c.running[:budget]
        budget -= len(decodes)
        chunks: list[tuple[RequestRecord, int, int]] = []  # (request, start, tokens)
        for rec in c.prefilling:
            if budget <= 0:
                break
            done = c.computed[rec.request_id]
            n = min(rec.num_prefill_tokens - done, budget)
            chunks.append((rec, done, n))
            budget -= n
        while c.prompts and budget > 0:
            rec = c.prompts[0]
            if rec.state != "pending":
                c.prompts.popleft()
                c.queued_tokens -= rec.num_prefill_tokens
                continue
            blocks = self._decode_blocks(rec)  # type: ignore[attr-defined]  # decode_side.py
            if c.free_blocks < blocks:
                break  # FCFS: wait for running requests to finish
            c.prompts.popleft()
            c.alloc(rec.request_id, blocks)
            rec.prefill_start = now
            c.prefilling.append(rec)
            c.computed[rec.request_id] = 0
            n = min(rec.num_prefill_tokens, budget)
            chunks.append((rec, 0, n))
            budget -= n
        if not decodes and not chunks:
            return None
        kv = sum(r.num_prefill_tokens + len(r.token_times) for r in decodes)  # each with the token it decodes
        seconds = self.prices.step(c.tp, [(start, n) for _, start, n in chunks], len(decodes), kv)
        c.step_batch, c.step_chunks = decodes, chunks
        for rec, _, _ in chunks:
            self._running.add(rec.request_id)
        if chunks:
            c.busy_spans.append((now, now + seconds))
        return seconds

    def _colocated_chunks_done(self, c: SimColocated, now: float) -> None:
        """The step's prompt pieces are computed: a prompt whose last piece it was samples its first token and
        decodes on `c` from the next step; a request that ended meanwhile frees its blocks."""
        chunks, c.step_chunks = c.step_chunks, []
        for rec, start, n in chunks:
            rid = rec.request_id
            self._running.discard(rid)
            c.queued_tokens -= n
            c.computed[rid] = start + n
            if rec.state != "pending":
                self._drop_prompt(c, rec)
                c.free(rid)
            elif start + n < rec.num_prefill_tokens:
                self._chunk_progress(rec, c.id, start + n, now)  # type: ignore[attr-defined]  # prefill_side.py
            else:
                self._drop_prompt(c, rec)
                self._prefill_finished(rec, c.id, now)  # type: ignore[attr-defined]  # prefill_side.py
                if rec.state == "pending":
                    rec.transfer_end = now  # the KV is already where it decodes
                    self._start_decoding(c, rec, now)  # type: ignore[attr-defined]  # decode_side.py
                else:
                    c.free(rid)

    def _drop_prompt(self, c: SimColocated, rec: RequestRecord) -> None:
        """`rec` no longer prefills on `c` (its prompt is done, or it ended): its uncomputed tokens leave the queue."""
        rid = rec.request_id
        if rid in c.computed:
            c.prefilling.remove(rec)
            c.queued_tokens -= rec.num_prefill_tokens - c.computed.pop(rid)
