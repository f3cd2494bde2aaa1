"""Samples of the cost model on the grids the strategies' fast predictors are fitted to.

Strategies plan with closed forms that answer in about a microsecond: Tetris Eq. 1 per SP size, LoongServe
Eq. 7 per degree of parallelism, a linear decode step per (TP, KVP), the mixed-batch step (Medha) as a dense-work
grid plus attention terms. Fitting them to these samples (the
scheduler's `latency_from_cost_model`) gives those forms for any (model, hardware, cluster). Points that do
not fit in memory are left out: the forms are fitted only where the plan is possible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .breakdown import Breakdown
from .costs import Chunk, CostModel
from .parallel import Parallelism


def length_grid(max_tokens: int, min_tokens: int = 256) -> list[int]:
    """Powers of two from min_tokens up to max_tokens, with max_tokens itself last."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    grid, n = [], min(min_tokens, max_tokens)
    while n < max_tokens:
        grid.append(n)
        n *= 2
    return [*grid, max_tokens]


def prefill_samples(
    cm: CostModel, sp: int, base: Parallelism, lengths: Sequence[int], history_ratios: Sequence[float] = (0, 0.5, 2)
) -> list[tuple[int, float, float, float]]:
    """(sp, C, L, seconds) for chunks of L tokens after C = ratio x L cached ones, on SP `sp` over `base`."""
    par = replace(base, sp=sp)
    rows = []
    for n in lengths:
        for ratio in history_ratios:
            hist = int(ratio * n)
            if not cm.memory(par, hist + n, n).fits:
                continue
            rows.append((sp, float(hist), float(n), cm.prefill(n, hist, par).total_s))
    return rows


def batch_prefill_samples(
    cm: CostModel, dop: int, base: Parallelism, lengths: Sequence[int]
) -> list[tuple[int, list[float], float]]:
    """(dop, [input lengths], seconds): single prompts and pairs of them, on an SP group of `dop`."""
    par = replace(base, sp=dop)
    rows = []
    for i, n in enumerate(lengths):
        for m in (None, *lengths[: i + 1]):
            batch = [n] if m is None else [n, m]
            if not cm.memory(par, sum(batch), sum(batch)).fits:
                continue
            step = cm.step([Chunk(int(x)) for x in batch], (), par)
            rows.append((dop, [float(x) for x in batch], step.total_s))
    return rows


def decode_samples(
    cm: CostModel, par: Parallelism, batches: Sequence[int], contexts: Sequence[int], multi_master: bool = False
) -> list[tuple[int, int, int, int, float]]:
    """(tp, kvp, batch, total KV tokens, seconds) for decode steps that fit in memory; `multi_master`: on a group
    of `par.kvp` instances that each master a share of the batch (`CostModel.multi_master_decode`)."""
    step = cm.multi_master_decode if multi_master else cm.decode
    rows = []
    for b in batches:
        for ctx in contexts:
            if not cm.memory(par, b * ctx, b).fits:
                continue
            rows.append((par.tp, par.kvp, b, b * ctx, step(b, ctx, par).total_s))
    return rows


ATTENTION_OPS = ("attention_prefill", "attention_decode")


def _attention_s(step: Breakdown, name: str) -> float:
    op = step.op(name)
    return op.s if op is not None else 0.0


def dense_grid(cm: CostModel, par: Parallelism, max_tokens: int = 1 << 16) -> tuple[list[float], list[float]]:
    """Token counts 1, 2, 4, ... up to `max_tokens` (those whose activations fit) and the seconds of their dense
    work: one iteration of a fresh chunk of that many tokens less its attention."""
    grid, dense, n = [], [], 1
    while n <= max_tokens and cm.memory(par, n, n).fits:
        step = cm.step([Chunk(n)], (), par)
        grid.append(float(n))
        dense.append(step.total_s - sum(_attention_s(step, name) for name in ATTENTION_OPS))
        n *= 2
    return grid, dense


def attention_samples(
    cm: CostModel, par: Parallelism, lengths: Sequence[int], history_ratios: Sequence[float] = (0, 1, 4, 16)
) -> list[tuple[float, float, float]]:
    """(C, L, seconds of prefill attention) for chunks of L tokens after C = ratio x L cached ones."""
    rows = []
    for n in lengths:
        for ratio in history_ratios:
            hist = int(ratio * n)
            if cm.memory(par, hist + n, n).fits:
                step = cm.step([Chunk(n, hist)], (), par)
                rows.append((float(hist), float(n), _attention_s(step, "attention_prefill")))
    return rows


def decode_attention_samples(
    cm: CostModel, par: Parallelism, batches: Sequence[int], contexts: Sequence[int]
) -> list[tuple[float, float]]:
    """(total KV tokens, seconds of decode attention) of decode batches that fit in memory."""
    rows = []
    for b in batches:
        for ctx in contexts:
            if cm.memory(par, b * ctx, b).fits:
                rows.append((float(b * ctx), _attention_s(cm.decode(b, ctx, par), "attention_decode")))
    return rows
