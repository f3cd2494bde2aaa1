"""Seesaw's choice of parallel configurations (seed 004, §3.1, Fig. 10's "P4 -> D4" labels): for a model on a
group of GPUs, the prefill configuration `c_p` with the highest prompt throughput and the decode configuration
`c_d` with the highest generation throughput, each `PPa x TPb` with a * b = the group's GPUs (data parallelism is
not switched, as in the paper §4.1), from the shared cost model.

- Prefill: a micro-batch of `prefill_tokens` prompt tokens per pipeline stage, the pipeline full: prompt
  tokens per stage time (TP pays its all-reduces, PP only its activations between stages).
- Decode: the largest batch the KV left after the weights holds (every request at `context` tokens, at most
  `max_batch`), split into PP micro-batches as vLLM does: generated tokens per stage time of a micro-batch (PP
  loads every weight once per micro-batch: the weight traffic Seesaw's Observation 2 is about).
- A configuration whose weights do not fit is out. Ties go to fewer pipeline stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spindle_costmodel import Chunk, CostModel
from spindle_costmodel.memory import memory_plan
from spindle_costmodel.parallel import Parallelism

from ...calibration import mixed_fit
from ...reshard_model import GroupConfig, ReshardModel

UTILIZATION = 0.9  # of GPU memory for weights, KV and activations


@dataclass(frozen=True)
class ConfigThroughput:
    par: Parallelism
    prefill_tok_s: float  # 0 where it does not fit
    decode_tok_s: float
    decode_batch: int  # the KV-limited batch the decode rate is at
    fits: bool

    @property
    def label(self) -> str:
        return label(self.par)


def label(par: Parallelism) -> str:
    """`TP4`, `PP4`, `TP2PP2` (vLLM's and the paper's spelling)."""
    parts = [f"TP{par.tp}"] * (par.tp > 1) + [f"PP{par.pp}"] * (par.pp > 1)
    return "".join(parts) or "TP1"


def candidates(gpus: int, kv_heads: int) -> list[Parallelism]:
    """Every PPa x TPb over `gpus` GPUs with TP at most the KV heads (TP over more would replicate KV heads)."""
    return [Parallelism(tp=t, pp=gpus // t) for t in range(1, gpus + 1) if gpus % t == 0 and t <= kv_heads]


def evaluate(
    cm: CostModel, par: Parallelism, prefill_tokens: int, context: int, max_batch: int = 512, activation_tokens: int = 0
) -> ConfigThroughput:
    """`activation_tokens`: room kept for a batch's activations (at least a prompt's)."""
    mem = memory_plan(cm.model, cm.hw, par, 0, max(prefill_tokens, activation_tokens), UTILIZATION)
    if mem.kv_capacity_tokens < context:  # the weights (and a prompt's activations) leave no room
        return ConfigThroughput(par, 0.0, 0.0, 0, False)
    pre = cm.step([Chunk(prefill_tokens)], (), par)
    prefill = prefill_tokens / (pre.stage_s if pre.stage_s is not None else pre.total_s)
    batch = min(max_batch, mem.kv_capacity_tokens // context)  # the instance's KV holds this many contexts
    micro = max(1, math.ceil(batch / par.pp))
    step = cm.decode(micro, context, par)
    decode = micro / (step.stage_s if step.stage_s is not None else step.total_s)
    return ConfigThroughput(par, prefill, decode, batch, True)


@dataclass(frozen=True)
class Choice:
    prefill: ConfigThroughput  # c_p
    decode: ConfigThroughput  # c_d
    table: tuple[ConfigThroughput, ...]  # every candidate

    @property
    def label(self) -> str:
        """The paper's label, e.g. `PP4 -> TP4`."""
        return f"{self.prefill.label} -> {self.decode.label}"


def choose(
    cm: CostModel, gpus: int, prefill_tokens: int, context: int, max_batch: int = 512, activation_tokens: int = 0
) -> Choice:
    """c_p and c_d for `gpus` GPUs of `cm`'s hardware: prompts of about `prefill_tokens`, decode at `context`."""
    table = tuple(evaluate(cm, p, prefill_tokens, context, max_batch, activation_tokens)
                  for p in candidates(gpus, cm.model.kv_heads))  # fmt: skip
    fitting = [c for c in table if c.fits]
    if not fitting:
        raise ValueError(f"{cm.model.name} does not fit on {gpus} x {cm.hw.name} in any PP x TP configuration")
    best_prefill = max(fitting, key=lambda c: (c.prefill_tok_s, -c.par.pp))
    best_decode = max(fitting, key=lambda c: (c.decode_tok_s, -c.par.pp))
    return Choice(best_prefill, best_decode, table)


def reshard_model(
    cm: CostModel, gpus: int, prefill_tokens: int, context: int, activation_tokens: int = 8192, max_batch: int = 512
) -> tuple[ReshardModel, Choice]:
    """A group of `gpus` GPUs as the simulator runs it: every fitting configuration's iteration form and KV room
    (after `activation_tokens` of activations), `choose`'s c_p and c_d, the weights and the host links (one per
    GPU)."""
    choice = choose(cm, gpus, prefill_tokens, context, max_batch, activation_tokens)
    groups = {
        c.label: GroupConfig(c.label, mixed_fit(cm, c.par)[0], cm.max_kv_tokens(c.par, activation_tokens))
        for c in choice.table
        if c.fits
    }
    model = ReshardModel(
        groups, choice.prefill.label, choice.decode.label, float(cm.model.weight_bytes),
        cm.hw.host.bandwidth * gpus, cm.hw.host.latency_s, cm.model.kv_bytes_per_token,
    )  # fmt: skip
    return model, choice
