"""What the simulator charges for work: one price for the same work, whichever strategy scheduled it.

Every piece of work a run executes is priced here, from what it holds and where it runs, never from who sent it:
one instance's iteration (a colocated instance's budgeted step under `chunked`, a `RunBatch` Medha or LoongServe
send to one instance, a decode instance's step), an SP prefill chunk on a group, a LoongServe group's prefill batch
and multi-master decode step, and KV moved between instances on the link between them.

Two price lists:
- `CostModelPrices`: the cost model itself (`spindle_costmodel.CostModel`), on a named cluster (`--hardware`). This
  is the ground truth of a simulated run; the strategies plan with forms *fitted* to it (Eq. 1, Eq. 7, the decode
  step, the mixed-batch step: `calibration.latency_from_cost_model`, optionally from noisy samples, `--noise`), so
  a plan can mispredict, and `SimResult.prediction_error` reports by how much.
- `FittedPrices`: the fitted forms of a `LatencyModel` (a profile of this machine, published figures), when there is
  no cost model to execute: the strategies then plan with the very forms the run is priced by.

Single-instance iterations (`step`): decodes alone pay the decode step, prompt chunks (with or without decodes) the
mixed-batch step, the batch in one pass. Without a decode model (published prefill figures only) a decode step costs
`decode_step_s`, and decodes beside chunks add it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from spindle_costmodel import CostModel, Parallelism
from spindle_costmodel.costs import Chunk
from spindle_costmodel.csa import alltoall_bytes
from spindle_policy.latency import LatencyModel
from spindle_policy.mixed_batch import MixedFit

Chunks = Iterable[tuple[int, int]]  # (history, tokens) per prompt chunk
Csa = tuple[int, float, str]  # CSPS's sparse attention: (levels, drop ratio at level 2, rule above level 2)


class FittedPrices:
    """Prices from a latency model's fitted forms."""

    def __init__(self, latency: LatencyModel, decode_step_s: float = 0.02) -> None:
        self.latency = latency
        self.decode_step_s = decode_step_s
        self._mixed: dict[int, MixedFit] = {}

    def mixed_fit(self, tp: int) -> MixedFit:
        fit = self._mixed.get(tp)
        if fit is None:
            fit = self._mixed[tp] = self.latency.mixed_model({tp}).fit_for(tp)
        return fit

    def decode(self, tp: int, num_decodes: int, kv_tokens: float) -> float:
        """One instance's step of `num_decodes` decodes over `kv_tokens` tokens in all (each with its new one)."""
        model = self.latency.decode
        if model is None:
            return self.decode_step_s
        return model.predict(num_decodes, kv_tokens, tp=tp)

    def step(self, tp: int, chunks: Chunks, num_decodes: int = 0, decode_kv: float = 0) -> float:
        """One instance's iteration: prompt chunks and `num_decodes` decodes over `decode_kv` tokens."""
        chunks = list(chunks)
        if not chunks:
            return self.decode(tp, num_decodes, decode_kv) if num_decodes else 0.0
        if self.latency.decode is None:
            extra = self.decode_step_s if num_decodes else 0.0
            return self.mixed_fit(tp).predict(chunks) + extra
        return self.mixed_fit(tp).predict(chunks, num_decodes, decode_kv)

    def sp_prefill(
        self, sp: int, history: int, tokens: int, keep: float = 1.0, cross_nodes: bool = False, csa: Csa | None = None
    ) -> float:
        """A prompt chunk on an SP group of prefill instances (`cross_nodes`: its members on several nodes; `csa`:
        (levels, drop) of CSPS's sparse attention over an all-to-all group, `keep` its share of pairs). The fitted
        Eq. 1 prices CSA's pairs, not the bytes its all-to-all saves."""
        return self.latency.prefill_seconds(sp, history, tokens, keep, cross_nodes)

    def group_prefill(self, size: int, chunks: Chunks, cross_nodes: bool = False) -> float:
        """A prefill batch over a group of `size` colocated instances (LoongServe's ESP)."""
        chunks = list(chunks)
        batch = self.latency.batch_prefill_on(cross_nodes)
        if batch is not None and size in batch.coeffs and all(h == 0 for h, _ in chunks):
            return batch.predict(size, [n for _, n in chunks])
        return sum(self.latency.prefill_seconds(size, h, n, cross_nodes=cross_nodes) for h, n in chunks)

    def group_decode(self, tp: int, size: int, num_decodes: int, kv_tokens: float) -> float:
        """A multi-master decode step of a group of `size` instances (each masters a share of the batch)."""
        model = self.latency.decode
        if model is None:
            return self.decode_step_s
        if (tp, size) in model.coeffs:
            return model.predict(num_decodes, kv_tokens, tp, size)
        return model.predict(math.ceil(num_decodes / size), kv_tokens / size, tp, 1)

    def transfer(self, nbytes: float, cross_nodes: bool = True) -> float:
        """KV moved between two instances on the link between them (0 where the run has no transfer model)."""
        link = self.latency.transfer_on(cross_nodes)
        return 0.0 if link is None else link.predict(nbytes)


@dataclass
class CostModelPrices(FittedPrices):
    """The cost model's own prices for a named cluster's instance shapes (what `calibration.latency_from_cost_model`
    fits its forms to): SP prefill on `prefill` (its TP and SP kind), colocated and decode instances at their TP, KV
    sent by `links` GPUs of an instance in parallel on the hardware's link inside or between nodes."""

    cm: CostModel
    prefill: Parallelism
    links: int = 1
    fitted: LatencyModel | None = None  # the forms fitted to `cm`: Medha's KV-parallel attention terms (below)
    decode_step_s: float = 0.02
    _mixed: dict[int, MixedFit] = field(default_factory=dict, repr=False)

    @property
    def latency(self) -> LatencyModel:  # type: ignore[override]
        assert self.fitted is not None, "CostModelPrices needs the latency model fitted to its cost model"
        return self.fitted

    def _s(self, chunks: Sequence[tuple[int, int]], num_decodes: int, kv: float, par: Parallelism, keep: float = 1.0
           ) -> float:  # fmt: skip
        parts = tuple(Chunk(int(n), int(h)) for h, n in chunks)
        return self.cm.iteration(parts, num_decodes, int(kv), par, keep).total_s

    def decode(self, tp: int, num_decodes: int, kv_tokens: float) -> float:
        return self._s((), num_decodes, kv_tokens, Parallelism(tp=tp)) if num_decodes else 0.0

    def step(self, tp: int, chunks: Chunks, num_decodes: int = 0, decode_kv: float = 0) -> float:
        chunks = list(chunks)
        if not chunks and not num_decodes:
            return 0.0
        return self._s(chunks, num_decodes, decode_kv, Parallelism(tp=tp))

    def sp_prefill(
        self, sp: int, history: int, tokens: int, keep: float = 1.0, cross_nodes: bool = False, csa: Csa | None = None
    ) -> float:
        par = replace(self.prefill, sp=sp, cross_nodes=cross_nodes)
        step = self.cm.iteration((Chunk(tokens, history),), 0, 0, par, keep)
        dense = step.op("sp_alltoall")
        if csa is None or dense is None:
            return step.total_s
        return step.total_s - dense.s + self.csa_alltoall_s(sp, tokens, csa, par)

    def csa_alltoall_s(self, sp: int, tokens: int, csa: Csa, par: Parallelism) -> float:
        """CSA's all-to-all over every layer: the bytes it sends (`spindle_costmodel.csa.alltoall_bytes`, each
        member a 1/sp share of them) on the group's link, one message per peer and direction."""
        m, (levels, drop, rule) = self.cm.model, csa
        q_heads, kv_heads = m.heads // par.tp, max(1, -(-m.kv_heads // par.tp))
        nbytes = alltoall_bytes(tokens, sp, levels, drop, q_heads, kv_heads, m.head_dim, m.dtype_bytes, rule)
        link = self.cm.hw.link(par.spans_nodes("sp", self.cm.hw.gpus_per_node))
        return m.layers * (nbytes / sp / link.bandwidth + 2 * (sp - 1) * link.latency_s)

    def group_prefill(self, size: int, chunks: Chunks, cross_nodes: bool = False) -> float:
        par = Parallelism(tp=self.prefill.tp, sp=size, sp_kind=self.prefill.sp_kind, cross_nodes=cross_nodes)
        return self._s(list(chunks), 0, 0, par)

    def group_decode(self, tp: int, size: int, num_decodes: int, kv_tokens: float) -> float:
        par = Parallelism(tp=tp, kvp=size)
        return self._s((), math.ceil(num_decodes / size), kv_tokens, par) if num_decodes else 0.0

    def transfer(self, nbytes: float, cross_nodes: bool = True) -> float:
        return self.cm.hw.link(cross_nodes).transfer_s(nbytes / self.links)


@dataclass
class ErrorStats:
    """Running statistics of (predicted - charged) / charged over the work priced."""

    count: int = 0
    abs_sum: float = 0.0
    signed_sum: float = 0.0
    worst: float = 0.0

    def add(self, charged: float, predicted: float) -> None:
        if charged <= 0:
            return
        rel = (predicted - charged) / charged
        self.count += 1
        self.abs_sum += abs(rel)
        self.signed_sum += rel
        self.worst = max(self.worst, abs(rel))

    def as_dict(self) -> dict[str, float | int]:
        n = max(1, self.count)
        return {"n": self.count, "mean_abs": self.abs_sum / n, "bias": self.signed_sum / n, "max_abs": self.worst}


class JudgedPrices(FittedPrices):
    """Charges `truth`'s prices and notes, per kind of work, how far the strategy's own forms (`planned`) were from
    them: the prediction error of a run (`SimResult.prediction_error`)."""

    KINDS = ("step", "decode", "sp_prefill", "group_prefill", "group_decode", "transfer")

    def __init__(self, truth: FittedPrices, planned: FittedPrices) -> None:
        self.truth, self.planned = truth, planned
        self.errors = {kind: ErrorStats() for kind in self.KINDS}

    def _judge(self, kind: str, *args: object) -> float:
        charged = getattr(self.truth, kind)(*args)
        self.errors[kind].add(charged, getattr(self.planned, kind)(*args))
        return charged

    def mixed_fit(self, tp: int) -> MixedFit:
        return self.truth.mixed_fit(tp)

    def decode(self, tp: int, num_decodes: int, kv_tokens: float) -> float:
        return self._judge("decode", tp, num_decodes, kv_tokens)

    def step(self, tp: int, chunks: Chunks, num_decodes: int = 0, decode_kv: float = 0) -> float:
        return self._judge("step", tp, list(chunks), num_decodes, decode_kv)

    def sp_prefill(
        self, sp: int, history: int, tokens: int, keep: float = 1.0, cross_nodes: bool = False, csa: Csa | None = None
    ) -> float:
        return self._judge("sp_prefill", sp, history, tokens, keep, cross_nodes, csa)

    def group_prefill(self, size: int, chunks: Chunks, cross_nodes: bool = False) -> float:
        return self._judge("group_prefill", size, list(chunks), cross_nodes)

    def group_decode(self, tp: int, size: int, num_decodes: int, kv_tokens: float) -> float:
        return self._judge("group_decode", tp, size, num_decodes, kv_tokens)

    def transfer(self, nbytes: float, cross_nodes: bool = True) -> float:
        return self._judge("transfer", nbytes, cross_nodes)

    def report(self) -> dict[str, dict[str, float | int]]:
        """Per kind of work priced in the run: n, mean |error|, mean signed error (bias), max |error|; and "all"."""
        out = {kind: e.as_dict() for kind, e in self.errors.items() if e.count}
        every = ErrorStats(sum(e.count for e in self.errors.values()), sum(e.abs_sum for e in self.errors.values()),
                           sum(e.signed_sum for e in self.errors.values()),
                           max((e.worst for e in self.errors.values()), default=0.0))  # fmt: skip
        if every.count:
            out["all"] = every.as_dict()
        return out
