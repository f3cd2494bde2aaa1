"""One price for the same work: the seconds of one iteration on one instance, whichever strategy scheduled it.

Every single-instance iteration the simulator runs is priced here, from what the iteration holds and nothing
else: a colocated instance's budgeted step under `chunked`, a `RunBatch` that Medha or LoongServe send to one
instance, a decode instance's continuous-batching step.

- Decodes only: the decode step at (TP, KVP 1) (`latency.decode`), or `decode_step_s` where the run has no decode
  model.
- With prompt chunks: the mixed-batch step at the instance's TP (`LatencyModel.mixed_model`: on a named cluster the
  cost model's fit, else built from Eq. 1 at SP 1 and the decode step), which prices the batch in one pass: the
  dense layers over all its tokens together, each chunk's attention over its history and itself, and the decodes'
  attention over their KV. Without a decode model, decodes beside chunks add `decode_step_s` (their only price).

Groups of several instances (SP prefill groups, LoongServe's elastic groups, Medha's KV-parallel replicas,
re-sharding groups) are priced where they run (prefill_side.py, iteration_side.py, tier_side.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..latency import LatencyModel
from ..mixed_batch import MixedFit


class StepPrice:
    def __init__(self, latency: LatencyModel, decode_step_s: float) -> None:
        self.latency = latency
        self.decode_step_s = decode_step_s
        self._mixed: dict[int, MixedFit] = {}

    def _fit(self, tp: int) -> MixedFit:
        fit = self._mixed.get(tp)
        if fit is None:
            fit = self._mixed[tp] = self.latency.mixed_model({tp}).fit_for(tp)
        return fit

    def decode(self, tp: int, num_decodes: int, kv_tokens: float) -> float:
        """A step of `num_decodes` decodes over `kv_tokens` cached tokens in all."""
        model = self.latency.decode
        if model is None:
            return self.decode_step_s
        return model.predict(num_decodes, kv_tokens, tp=tp)

    def step(self, tp: int, chunks: Iterable[tuple[int, int]], num_decodes: int = 0, decode_kv: float = 0) -> float:
        """One iteration: `chunks` as (history, tokens) pairs and `num_decodes` decodes over `decode_kv` tokens."""
        chunks = list(chunks)
        if not chunks:
            return self.decode(tp, num_decodes, decode_kv) if num_decodes else 0.0
        if self.latency.decode is None:
            extra = self.decode_step_s if num_decodes else 0.0
            return self._fit(tp).predict(chunks) + extra
        return self._fit(tp).predict(chunks, num_decodes, decode_kv)
