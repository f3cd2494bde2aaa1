"""Token sampling: logit processors (min_tokens, logit_bias, repetition / frequency / presence penalties),
greedy, temperature, min-p, top-k, top-p, per-request seeded generators, and log-probabilities.

The order and formulas are `SamplingParams`'. Greedy rows that need neither processing nor logprobs are
decided where the logits are (one small read-back); every other row is processed on the CPU: the per-request
generators are CPU generators, so a seeded request draws the same tokens whichever device computed its logits.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor

from .grammar import GrammarCompiler, GrammarState, all_masked
from .sampling_params import SamplingParams
from .sequence import Sequence


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one output position: the sampled token's and the `len(top_ids)` most likely."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True)
class Sampled:
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where the request asked for none


class PenaltyState:
    """A sequence's token counts for the penalties, kept up to date incrementally (the prompt is counted once,
    each step adds the new outputs). Rebuilt from the token ids wherever the sequence is rebuilt (resume, hand-off,
    a KVP placement), so it is a pure function of the tokens."""

    def __init__(self, vocab_size: int) -> None:
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # [V] in the prompt or the output
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)  # [V] occurrences in the output
        self.synced = 0  # token_ids[:synced] are counted

    def sync(self, seq: Sequence) -> None:
        ids, n_prompt, vocab = seq.token_ids, seq.num_prompt_tokens, self.seen.shape[0]
        if self.synced < n_prompt:
            prompt = torch.tensor(ids[self.synced : n_prompt], dtype=torch.long)
            self.seen[prompt[prompt < vocab]] = True
            self.synced = n_prompt
        if self.synced < len(ids):
            new = torch.tensor(ids[self.synced :], dtype=torch.long)
            new = new[new < vocab]
            self.seen[new] = True
            self.counts.index_add_(0, new, torch.ones(new.shape[0]))
            self.synced = len(ids)


def _penalty_state(seq: Sequence, vocab_size: int) -> PenaltyState:
    state = seq.penalty_state
    if not isinstance(state, PenaltyState) or state.seen.shape[0] != vocab_size:
        state = seq.penalty_state = PenaltyState(vocab_size)
    state.sync(seq)
    return state


def _grammar_state(
    seq: Sequence, compiler: GrammarCompiler | None, vocab_size: int, eos_token_ids: Seq[int]
) -> GrammarState:
    state = seq.grammar_state
    if not isinstance(state, GrammarState):
        assert seq.params.grammar is not None
        if compiler is None:
            state = GrammarState(None, vocab_size, eos_token_ids, "this engine has no tokenizer.json for grammars")
        else:
            try:
                state = GrammarState(compiler.matcher(*seq.params.grammar), vocab_size, eos_token_ids)
            except ValueError as e:  # the gateway checks grammars; this is a request that bypassed it
                state = GrammarState(None, vocab_size, eos_token_ids, str(e))
        seq.grammar_state = state
    state.sync(seq.output_token_ids)
    return state


def process_logits(
    row: Tensor, seq: Sequence, eos_token_ids: Seq[int] = (), grammars: GrammarCompiler | None = None
) -> Tensor:
    """`row [V]` fp32 CPU logits of `seq`'s next token -> the logits after the grammar's mask, min_tokens,
    logit_bias and the penalties (a new tensor when anything applies; `row` itself otherwise). Should min_tokens
    ban every token the grammar allows (it allows only EOS once complete), the grammar wins."""
    p = seq.params
    if not p.processes_logits:
        return row
    vocab = row.shape[0]
    row = _grammar_state(seq, grammars, vocab, eos_token_ids).mask(row) if p.grammar else row.clone()
    allowed = row
    if p.min_tokens and len(seq.output_token_ids) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        banned_ids = [t for t in banned if t < vocab]
        if banned_ids:
            row = row.clone()
            row[banned_ids] = float("-inf")
            if all_masked(row):
                row = allowed
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], dtype=torch.long)
        bias = torch.tensor([b for t, b in p.logit_bias if t < vocab], dtype=torch.float32)
        row.index_add_(0, ids, bias)
    if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
        state = _penalty_state(seq, vocab)
        if p.repetition_penalty != 1.0:
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(state.seen, penalised, row)
        if p.frequency_penalty or p.presence_penalty:
            row -= p.frequency_penalty * state.counts + p.presence_penalty * (state.counts > 0).float()
    return row


def truncate(logits: Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> Tensor:
    """logits [V] fp32 (temperature applied) -> logits with everything outside min-p, top-k and the top-p
    nucleus set to -inf."""
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens strictly before it already reach top_p (the top one always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def _logprobs(scaled: Tensor, token: int, n: int) -> TokenLogprobs:
    lp = torch.log_softmax(scaled, dim=-1)  # [V]
    top = torch.topk(lp, n) if n else None
    return TokenLogprobs(
        token_id=token,
        logprob=float(lp[token]),
        top_ids=tuple(top.indices.tolist()) if top is not None else (),
        top_logprobs=tuple(top.values.tolist()) if top is not None else (),
    )


def _is_plain_greedy(p: SamplingParams) -> bool:
    return p.greedy and p.logprobs is None and not p.processes_logits


def sample(
    logits: Tensor,
    seqs: Seq[Sequence],
    default_generator: torch.Generator,
    eos_token_ids: Seq[int] = (),
    grammars: GrammarCompiler | None = None,
) -> Sampled:
    """logits `[N, vocab]` fp32 (any device), one row per sequence -> one token (and its logprobs) per row.

    `eos_token_ids` are what `min_tokens` bans (with each request's stop_token_ids); `grammars` compiles the
    requests' grammars (SamplingParams.grammar)."""
    params = [s.params for s in seqs]
    tokens = torch.argmax(logits, dim=-1).tolist()
    logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
    if all(_is_plain_greedy(p) for p in params):
        return Sampled(tokens, logprobs)
    cpu = logits.float().cpu()
    for i, (seq, p) in enumerate(zip(seqs, params, strict=True)):
        if _is_plain_greedy(p):
            continue
        row = process_logits(cpu[i], seq, eos_token_ids, grammars)
        scaled = row if p.greedy else row / p.temperature
        if p.greedy:
            tokens[i] = int(torch.argmax(row))
        else:
            gen = seq.step_generator() or default_generator
            tokens[i] = draw(torch.softmax(truncate(scaled, p.top_k, p.top_p, p.min_p), dim=-1), gen)
        if p.logprobs is not None:
            logprobs[i] = _logprobs(scaled, tokens[i], p.logprobs)
    return Sampled(tokens, logprobs)


def draw(probs: Tensor, generator: torch.Generator) -> int:
    """One token from `probs [V]` by inverting the CDF at one uniform draw. `torch.multinomial` draws a random
    number per vocabulary entry (1.2 ms for 49k on this CPU); this draws one. Zero-probability tokens (filtered
    out) are never picked: `right=True` skips every entry whose CDF equals the point."""
    cdf = torch.cumsum(probs, dim=0)  # [V]
    point = torch.rand((), generator=generator) * cdf[-1]
    return min(int(torch.searchsorted(cdf, point, right=True)), probs.shape[0] - 1)
