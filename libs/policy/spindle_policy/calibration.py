"""Latency models calibrated on published figures.

`PAPER_FIGURES` (packaged with `spindle_costmodel`) holds the project's `shared/reference/paper_figures.json`
and the figures the cost model is validated on (numbers from the five papers, with their sources).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from spindle_costmodel import PAPER_FIGURES, CostModel, Link, Parallelism
from spindle_costmodel.costs import SINGLE, Chunk
from spindle_costmodel.fast_forms import (
    attention_samples,
    batch_prefill_samples,
    decode_attention_samples,
    decode_samples,
    dense_grid,
    length_grid,
    prefill_samples,
)

from .latency import BatchPrefillModel, DecodeStepModel, LatencyModel, PrefillLatencyModel, TransferModel
from .mixed_batch import MixedBatchModel, MixedFit

# calibration name -> entry in paper_figures.json holding a whole-prompt prefill table
CALIBRATIONS = {"tetris-a100-llama3-8b": "tetris_table1_prefill_latency_s"}

# Tetris Table 1's hardware: 200 Gbps InfiniBand across nodes. The per-message latency is not published.
TETRIS_IB_BYTES_PER_S = 200e9 / 8


def prefill_table_samples(table: dict[str, Any]) -> list[tuple[int, float, float, float]]:
    """(sp, C=0, L, seconds) samples from a {"prompt_tokens": [...], "sp": {"1": [seconds or null]}} table.

    Each entry is a whole prompt prefilled at once (batch 1, no history); null means out of memory.
    """
    try:
        lengths = [int(n) for n in table["prompt_tokens"]]
        per_sp = table["sp"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"prefill table lacks prompt_tokens/sp: {e}") from e
    samples = []
    for sp, secs in per_sp.items():
        if len(secs) != len(lengths):
            raise ValueError(f"sp={sp}: {len(secs)} latencies for {len(lengths)} prompt lengths")
        samples += [(int(sp), 0.0, float(n), float(s)) for n, s in zip(lengths, secs, strict=True) if s is not None]
    return samples


def load_paper_calibration(path: str | Path = PAPER_FIGURES, key: str = "tetris-a100-llama3-8b") -> LatencyModel:
    """Prefill models (Tetris Eq. 1 and LoongServe Eq. 7, DoP = SP size) fitted to a published table.

    The table has no decode-step figures, so the bundle's decode model is left out.
    """
    if key not in CALIBRATIONS:
        raise ValueError(f"unknown calibration {key!r}; known: {sorted(CALIBRATIONS)}")
    try:
        figures = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read paper figures from {path}: {e}") from e
    entry = CALIBRATIONS[key]
    if entry not in figures:
        raise ValueError(f"{path} has no {entry!r} entry")
    samples = prefill_table_samples(figures[entry])
    prefill = PrefillLatencyModel.fit(samples)
    batch = BatchPrefillModel.fit((sp, [length], secs) for sp, _, length, secs in samples)
    return LatencyModel(
        prefill=prefill,
        batch_prefill=batch,
        transfer=TransferModel(latency_s=0.0, bandwidth_bytes_per_s=TETRIS_IB_BYTES_PER_S),
        source=f"{key}: {figures[entry].get('source', entry)}",
    )


def latency_from_cost_model(
    cm: CostModel,
    sp_sizes: Sequence[int] = (1,),
    prefill: Parallelism = SINGLE,
    decode: Sequence[Parallelism] = (SINGLE,),
    max_tokens: int = 1 << 20,
    decode_batches: Sequence[int] = (1, 4, 16, 64, 256),
    transfer_links: int = 1,
    multi_master: Sequence[Parallelism] = (),
    mixed: Sequence[Parallelism] = (),
    noise: float = 0.0,
    seed: int = 0,
) -> LatencyModel:
    """The strategies' fast forms fitted to the cost model of one (model, hardware): Tetris Eq. 1 and LoongServe
    Eq. 7 per SP size (prefill instances shaped like `prefill`, e.g. its TP; fitted twice for SP > 1: with the group
    packed as the cost model packs it, and with its members on different nodes), the decode step per decode
    instance shape in `decode`, and the transfer over the link between nodes and the one inside a node,
    `transfer_links` GPUs sending their share of the KV in parallel (a TP instance's GPUs each hold their KV
    heads). `multi_master`: decode steps of elastic groups (LoongServe's multi-master decoding over `kvp`
    instances), fitted under their (TP, KVP) key.
    `mixed`: colocated instance shapes to fit the mixed-batch step (`mixed_from_cost_model`) for. `noise` > 0: a
    profile's measurements rather than the model's own numbers: every sample (and each link's latency and
    bandwidth) is off by a factor exp(noise x N(0, 1)), deterministic for `seed`."""
    if transfer_links < 1:
        raise ValueError(f"transfer_links must be >= 1, got {transfer_links}")
    jit = Jitter(noise, seed)
    lengths = length_grid(max_tokens)
    prefill_rows, batch_rows, cross_rows, cross_batch_rows = [], [], [], []
    cross = replace(prefill, cross_nodes=True)
    for sp in sorted(set(sp_sizes)):
        prefill_rows += prefill_samples(cm, sp, prefill, lengths)
        batch_rows += batch_prefill_samples(cm, sp, prefill, lengths[::2])
        if sp > 1:  # the same group with its members on different nodes
            cross_rows += prefill_samples(cm, sp, cross, lengths)
            cross_batch_rows += batch_prefill_samples(cm, sp, cross, lengths[::2])
    if not prefill_rows:
        raise ValueError(f"{cm}: no prefill of >= {lengths[0]} tokens fits on {prefill.label()}")
    decode_rows = []
    for par in decode:
        rows = decode_samples(cm, par, decode_batches, lengths)
        if len(rows) < 3:
            raise ValueError(f"{cm}: decode on {par.label()} does not fit in memory")
        decode_rows += rows
    for par in multi_master:
        decode_rows += decode_samples(cm, par, decode_batches, lengths, multi_master=True)
    prefill_rows, cross_rows = ([(*r[:3], jit(r[3])) for r in rows] for rows in (prefill_rows, cross_rows))
    batch_rows, cross_batch_rows = ([(*r[:2], jit(r[2])) for r in rows] for rows in (batch_rows, cross_batch_rows))
    decode_rows = [(*r[:4], jit(r[4])) for r in decode_rows]

    def link_model(link: Link) -> TransferModel:
        bandwidth = link.bandwidth * transfer_links / jit(1.0)
        return TransferModel(latency_s=jit(link.latency_s), bandwidth_bytes_per_s=bandwidth)

    return LatencyModel(
        prefill=PrefillLatencyModel.fit(prefill_rows),
        batch_prefill=BatchPrefillModel.fit(batch_rows),
        decode=DecodeStepModel.fit(decode_rows),
        transfer=link_model(cm.hw.inter),
        transfer_intra=link_model(cm.hw.intra),
        prefill_cross=PrefillLatencyModel.fit(cross_rows) if cross_rows else None,
        batch_prefill_cross=BatchPrefillModel.fit(cross_batch_rows) if cross_batch_rows else None,
        mixed=mixed_from_cost_model(cm, mixed, max_tokens, jit) if mixed else None,
        source=f"cost model: {cm.model.name} on {cm.hw.name}",
    )


class Jitter:
    """Multiplicative measurement noise: x -> x * exp(noise * z), z ~ N(0, 1) drawn in call order from `seed`."""

    def __init__(self, noise: float = 0.0, seed: int = 0) -> None:
        if not 0 <= noise < 1:
            raise ValueError(f"noise must be in [0, 1), got {noise}")
        self.noise = noise
        self.rng = np.random.default_rng(seed)

    def __call__(self, x: float) -> float:
        return x if not self.noise else float(x * np.exp(self.noise * self.rng.standard_normal()))


def mixed_from_cost_model(
    cm: CostModel, shapes: Sequence[Parallelism], max_tokens: int = 1 << 20, jit: Jitter | None = None
) -> MixedBatchModel:
    """The mixed-batch step per TP degree of `shapes` (`mixed_fit`; `jit`: noise on every sample)."""
    fits, errors = {}, {}
    for par in shapes:
        fits[par.tp], errors[par.tp] = mixed_fit(cm, par, max_tokens, jit)
    return MixedBatchModel(fits, errors)


def mixed_fit(
    cm: CostModel, par: Parallelism, max_tokens: int = 1 << 20, jit: Jitter | None = None
) -> tuple[MixedFit, float]:
    """The mixed-batch step of one instance shape (a full pass through its pipeline stages, if any): the dense grid
    from the cost model's dense ops, the attention coefficients by least squares (relative) on its attention ops;
    and the mean relative error against whole cost-model iterations of chunks (after histories up to 16x their
    length) mixed with decode batches."""
    jit = jit or Jitter()
    lengths = length_grid(min(max_tokens, 1 << 16), 64)
    grid, dense = dense_grid(cm, par)
    if len(grid) < 2:
        raise ValueError(f"{cm}: not even a 2-token iteration fits on {par.label()}")
    dense = [jit(x) for x in dense]
    rows = np.array([(h, n, jit(t)) for h, n, t in attention_samples(cm, par, lengths) if t > 0])
    x = np.stack([rows[:, 0] * rows[:, 1], rows[:, 1] ** 2], axis=1)
    c_hist, c_sq = np.linalg.lstsq(x / rows[:, 2:3], np.ones(len(rows)), rcond=None)[0]
    kv = np.array([(k, jit(t)) for k, t in decode_attention_samples(cm, par, (1, 16, 128), lengths) if t > 0])
    c_kv = float(np.sum(kv[:, 1]) / np.sum(kv[:, 0]))
    fit = MixedFit(tuple(grid), tuple(dense), float(c_hist), float(c_sq), c_kv)
    rel = []
    for n in (128, 512, 2048):
        for hist in (0, 4 * n, 16 * n):
            for b, ctx in ((0, 0), (8, 4096), (64, 16384)):
                if not cm.memory(par, hist + n + b * ctx, n + b).fits:
                    continue
                want = cm.step([Chunk(n, hist)], [ctx] * b, par).total_s
                rel.append(abs(fit.predict([(hist, n)], b, b * ctx) - want) / want)
    return fit, float(np.mean(rel)) if rel else float("nan")
