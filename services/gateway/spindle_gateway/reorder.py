"""Reassembling a request's output tokens from StreamEvents.

Events carry tokens `seq, seq+1, ...`; they come from different publishers (the first token from the prefill
instance, the rest from decode), so they may arrive out of order, and a retry may repeat some. The request is
complete when a `finished` event arrived and every token before its end was received.
"""

from __future__ import annotations

from spindle_protocol.messages import StreamEvent, TokenLogprob


class TokenReorderer:
    def __init__(self) -> None:
        self._pending: dict[int, tuple[int, TokenLogprob | None]] = {}
        self.logprobs: list[TokenLogprob | None] = []  # of every token handed out, by position
        self.prompt_logprobs: list[TokenLogprob] | None = None  # prompt positions 1.., from the first output's event
        self.next_seq = 0  # tokens before this have been handed out
        self.total: int | None = None  # known once the finished event arrived
        self.finish_reason: str | None = None
        self.stats: dict[str, float] | None = None

    def push(self, event: StreamEvent) -> list[int]:
        """Take one event; return the tokens that are now contiguous, in order (possibly none)."""
        if event.seq < 0:
            return []
        if event.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.finished and self.total is None:
            self.total = event.seq + len(event.token_ids)
            self.finish_reason = event.finish_reason or "stop"
            self.stats = event.stats
            self._pending = {p: t for p, t in self._pending.items() if p < self.total}
        logprobs = event.logprobs if event.logprobs and len(event.logprobs) == len(event.token_ids) else None
        for i, token in enumerate(event.token_ids):
            pos = event.seq + i
            if pos >= self.next_seq and (self.total is None or pos < self.total):
                # a repeat of a position keeps the first copy
                self._pending.setdefault(pos, (token, logprobs[i] if logprobs else None))
        out = []
        while self.next_seq in self._pending:
            token, logprob = self._pending.pop(self.next_seq)
            out.append(token)
            self.logprobs.append(logprob)
            self.next_seq += 1
        return out

    @property
    def complete(self) -> bool:
        return self.total is not None and self.next_seq >= self.total

    @property
    def missing(self) -> int:
        """Tokens seen out of order and still waiting for an earlier one."""
        return len(self._pending)
