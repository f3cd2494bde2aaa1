"""Output text assembly: incremental detokenization plus stop strings, token by token.

A stop string can span several tokens, so up to `len(longest stop) - 1` characters are held back until it is
clear they do not start one. The stop string itself is never emitted (vLLM's `include_stop_str_in_output=False`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from spindle_tokenizer import IncrementalDetokenizer, Tokenizer


class StopStringMatcher:
    """Feed text pieces; get back the part that is safe to emit. After a match, `matched` is the stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        assert all(stops), "stop strings must be non-empty"
        self.stops = tuple(stops)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._held = ""
        self.matched: str | None = None

    def feed(self, piece: str) -> str:
        assert self.matched is None, "feed after a stop string matched"
        if not self.stops or not piece:
            return piece
        text = self._held + piece
        # `_held` had no complete match, so any match ends inside `piece`: the first one to complete wins.
        best: tuple[int, int, str] | None = None
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            self.matched = best[2]
            self._held = ""
            return text[: best[1]]
        keep = min(self._hold, len(text))
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back tail, once no more text will come."""
        out, self._held = self._held, ""
        return out


class TextAssembler:
    """Token ids in, visible text out: UTF-8-safe detokenization, then stop strings.

    `completion_tokens` counts the tokens consumed; after a stop string, the tokens past it are not consumed.
    """

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopStringMatcher(stops)
        self.completion_tokens = 0
        self.last_token: int | None = None

    @property
    def stopped(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stops.matched

    def add(self, token_ids: Iterable[int]) -> str:
        out = []
        for t in token_ids:
            if self._stops.matched is not None:
                break
            self.completion_tokens += 1
            self.last_token = t
            piece = self._detok.add(t)
            if piece:
                out.append(self._stops.feed(piece))
        return "".join(out)

    def finish(self) -> str:
        """The rest of the text after the last token (held-back bytes and characters)."""
        if self._stops.matched is not None:
            return ""
        out = self._stops.feed(self._detok.flush())
        if self._stops.matched is None:
            out += self._stops.flush()
        return out
