"""Continuous batching with chunked prefill under a token budget.

Each step the running sequences go first, in admission order: one token for a decoding sequence, a chunk
for one still prefilling. Waiting sequences are then admitted while budget, sequence slots and KV blocks
last. When a running sequence cannot grow, the most recently admitted one is preempted: its blocks are
freed and it waits to be recomputed from its tokens (prompt and output so far), which keeps outputs exact.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .kv_cache import BlockAllocator
from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192  # token budget of one step
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0  # > 0 caps one sequence's chunk per step
    # > 0 caps one sequence's chunk per step while other sequences share the engine (running or waiting): a long
    # prompt then interleaves with the decodes and the newer prompts instead of stalling them; alone, it takes
    # the whole budget
    shared_prefill_chunk: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.shared_prefill_chunk < 0:
            raise ValueError("shared_prefill_chunk must be >= 0")


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._arrivals = 0
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.arrival = self._arrivals
        self._arrivals += 1
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_uncomputed, budget)
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        if self.config.shared_prefill_chunk and len(self.running) + len(self.waiting) > 1:
            n = min(n, self.config.shared_prefill_chunk)
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.allocator.free(seq.request_id, seq.block_table)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        out: list[ScheduledChunk] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            target = seq.num_computed_tokens + n
            while not self.allocator.can_allocate(target, seq.block_table):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            self.allocator.allocate(seq.request_id, target, seq.block_table)
            out.append(ScheduledChunk(seq, n))
            budget -= n
            i += 1
        if len(out) < len(self.running):
            return out  # running work did not fit: admit nothing new this step
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = self._chunk(seq, budget)
            target = seq.num_computed_tokens + n
            if not self.allocator.can_allocate(target, seq.block_table):
                break
            self.waiting.popleft()
            self.allocator.allocate(seq.request_id, target, seq.block_table)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.append(ScheduledChunk(seq, n))
            budget -= n
        return out

    def detach(self, seq: Sequence, reason: str = "prefilled") -> None:
        """Take a sequence out of batching but keep its blocks (its KV is about to be handed off)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (stop, length, abort) and free its blocks; idempotent."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.request_id, seq.block_table)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
