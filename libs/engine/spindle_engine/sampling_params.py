"""Per-request sampling parameters (vLLM-shaped)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from spindle_tokenizer.grammar import GRAMMAR_KINDS

MAX_LOGPROBS = 20  # most alternatives per position (OpenAI's top_logprobs limit, vLLM's default max_logprobs)
MAX_CHOICES = 128  # most choices per request (n)


def choice_seed(seed: int | None, i: int) -> int | None:
    """Choice 0 keeps the request's seed (n=1 is unchanged); choice i > 0 gets another, spread by the 64-bit
    golden ratio, so the choices of a seeded request differ but are each reproducible."""
    if seed is None or i == 0:
        return seed
    return (seed + i * 0x9E3779B97F4A7C15) % 2**64


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature=0` is greedy. `top_k <= 0`, `top_p == 1` and `min_p == 0` disable those filters. `seed` makes
    one request's sampling deterministic regardless of what it is batched with.

    Logit processing, in this order, for every row (greedy rows too), as vLLM does it:
    - `min_tokens`: while fewer outputs exist, EOS (unless `ignore_eos`) and `stop_token_ids` are banned;
    - `logit_bias`: `(token id, bias)` pairs added to the logits (OpenAI: -100 bans, +100 forces);
    - `repetition_penalty` (vLLM's, CTRL's): a token seen in the prompt or the output has its logit divided by
      the penalty when positive and multiplied by it when negative;
    - `frequency_penalty` / `presence_penalty` (OpenAI's): logit -= frequency * count in the output
      + presence * (count > 0), over the output tokens only.
    Then temperature, then the truncation filters `min_p` (drop tokens below `min_p` x the top probability),
    `top_k`, `top_p`.

    `n`: independent choices from one prompt. A decode engine that resumes such a request from its prompt's KV
    (`Engine.resume`) decodes every choice from that one KV (choice i's seed is `choice_seed(seed, i)`).

    `grammar`: `(kind, source)`, a JSON schema or a regular expression the output must match (grammar.py): a
    mask applied before every other processor, so penalties and bias only choose among allowed tokens.

    `logprobs`: None for none; N >= 0 for the sampled token's log-probability plus the N most likely
    alternatives. They are `log_softmax(processed logits / temperature)` (temperature 1 when greedy): the
    distribution after penalties, bias and temperature, before the truncation filters. `prompt_logprobs`: the same
    for every prompt token after the first (`log_softmax` of the model's logits: no processors, no temperature),
    computed where the prompt is prefilled and reported with the first output.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    grammar: tuple[str, str] | None = None  # (kind, source): the output must match it (grammar.py)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        for t, b in bias:
            if t < 0 or not -100 <= b <= 100:
                raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {t}: {b}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.prompt_logprobs is not None and self.n > 1:
            raise ValueError("prompt_logprobs with n > 1 is not supported (send n = 1)")
        if self.grammar is not None:
            if len(self.grammar) != 2 or self.grammar[0] not in GRAMMAR_KINDS or not isinstance(self.grammar[1], str):
                raise ValueError(f"grammar must be (kind, source) with kind in {GRAMMAR_KINDS}, got {self.grammar!r}")
            object.__setattr__(self, "grammar", tuple(self.grammar))
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}], got {self.n!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", bias)

    def for_choice(self, i: int) -> SamplingParams:
        """The parameters of choice `i` of an `n`-choice request: one choice, its own seed."""
        return replace(self, n=1, seed=choice_seed(self.seed, i))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes_logits(self) -> bool:
        """Whether any logit processor (min_tokens, bias, penalties) applies to this request."""
        return bool(
            self.grammar
            or self.min_tokens
            or self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )
