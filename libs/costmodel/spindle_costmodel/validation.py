"""The cost model against published and measured numbers: one `Check` per figure, each with its tolerance.

Magnitude checks hold |model / reference - 1| <= tolerance; direction checks (tolerance None) hold that the
model orders things as the paper says. `bench/costmodel_validation.py` prints them as the README's table and
plots predicted vs published/measured; the tests assert every check passes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .costs import Chunk, CostModel
from .hardware import get_hardware
from .model import get_model
from .parallel import Parallelism as P

DATA = Path(__file__).parent / "data" / "paper_figures.json"
H100_SOURCE = "H100 (bench/gpu_ops.py)"


@dataclass(frozen=True)
class Check:
    name: str
    source: str
    reference: float  # the paper's (or the measurement's) number
    model: float
    tolerance: float | None  # relative; None: a direction check, `holds` says whether the order is right
    holds_direction: bool = True
    unit: str = ""
    kind: str = "paper"  # "paper" or "measured"

    @property
    def error(self) -> float:
        return self.model / self.reference - 1

    @property
    def passed(self) -> bool:
        within = self.tolerance is None or abs(self.error) <= self.tolerance
        return within and self.holds_direction

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "reference": self.reference,
            "model": self.model,
            "error": self.error,
            "tolerance": self.tolerance,
            "passed": self.passed,
            "unit": self.unit,
            "kind": self.kind,
        }


def figures() -> dict[str, Any]:
    return json.loads(DATA.read_text())


def tetris_table1() -> list[Check]:
    """Llama-3-8B whole-prompt prefill on A100s, SP 1-16: every published cell (the fit's own data)."""
    table = figures()["tetris_table1_prefill_latency_s"]
    cm = CostModel(get_model("llama3-8b"), get_hardware("a100-80g"))
    checks = []
    for sp, row in table["sp"].items():
        for n, seconds in zip(table["prompt_tokens"], row, strict=True):
            if seconds is not None:
                model = cm.prefill(n, par=P(sp=int(sp))).total_s
                checks.append(Check(f"prefill {n // 1024}k SP{sp}", "Tetris Table 1", seconds, model, 0.15, unit="s"))
    return checks


def tetris_fig2() -> list[Check]:
    """Decode latency vs TP8 on 8 A100s. The paper gives maxima ("up to") over a sweep it does not print; the
    model takes its maximum over batch 1-128 and contexts 4k-64k that fit on one GPU."""
    ratios = figures()["tetris_decode_latency_ratio_vs_tp8"]
    cm = CostModel(get_model("llama3-8b"), get_hardware("a100-80g"))
    configs = {"tp1": P(), "tp2": P(tp=2), "tp4": P(tp=4), "sp8_tp1": P(kvp=8), "sp4_tp2": P(tp=2, kvp=4)}
    configs["sp2_tp4"] = P(tp=4, kvp=2)
    points = [(b, c) for b in (1, 8, 32, 128) for c in (4096, 16384, 65536) if cm.memory(P(), b * c, b).fits]
    model = {
        key: max(cm.decode(b, c, par).total_s / cm.decode(b, c, P(tp=8)).total_s for b, c in points)
        for key, par in configs.items()
    }
    ordered = model["tp1"] > model["tp2"] > model["tp4"] > 1 and model["sp8_tp1"] > model["sp4_tp2"] > 1
    # held to 50 %: maxima over an unprinted sweep, and the TP and SP ratios pull the fixed costs apart
    return [
        Check(f"decode {key} / TP8 (max)", "Tetris Fig. 2", ratios[key], model[key], 0.5, ordered, "x")
        for key in configs
    ]


def medha_fig2() -> list[Check]:
    """Llama-3-8B on one DGX-H100 (TP8): the longest prompt prefilled in 30 s and decoded at 20 ms TPOT. The
    paper's bounds assume peak FLOP/s; the model runs at the H100's measured efficiencies."""
    cm = CostModel(get_model("llama3-8b"), get_hardware("h100-sxm"))
    par = P(tp=8)
    prefill_limit = _largest(lambda n: cm.prefill(n, par=par).total_s <= 30.0)
    tpot_limit = _largest(lambda n: cm.decode(1, n, par).total_s <= 0.020)
    capacity = cm.max_kv_tokens(par)
    return [
        Check("max prompt, 30 s TTFT", "Medha Fig. 2", 1e6, prefill_limit, 0.35, unit="tokens"),
        Check("max context in memory", "Medha Fig. 2", 4e6, capacity, 0.25, unit="tokens"),
        Check("max context, 20 ms TPOT", "Medha Fig. 2", 4e6, tpot_limit, 0.35, unit="tokens"),
    ]


def medha_fig11() -> list[Check]:
    """KVP on Llama-3-8B decode, TP8 x SPP4 on H100s, one request at 4M and 10M tokens of context."""
    cm = CostModel(get_model("llama3-8b"), get_hardware("h100-sxm"))

    def tpot(ctx: int, kvp: int) -> float:
        return cm.decode(1, ctx, P(tp=8, pp=4, kvp=kvp)).total_s

    cut = 1 - tpot(10_000_000, 2) / tpot(10_000_000, 1)
    return [
        Check("KVP2 TPOT cut at 10M", "Medha Fig. 11", 0.40, cut, 0.25, unit="fraction"),
        Check("KVP1->4 speedup at 10M", "Medha Fig. 11", 2.5, tpot(10_000_000, 1) / tpot(10_000_000, 4), 0.35),
        Check("KVP1->4 speedup at 4M", "Medha Fig. 11", 1.7, tpot(4_000_000, 1) / tpot(4_000_000, 4), 0.5),
    ]


def loongserve() -> list[Check]:
    """LWM-1M-Text on A800s (modelled as A100-80G): 100K vs 1K prefill; prefill scales with DoP, decode (8
    requests of 2,000 tokens) poorly."""
    cm = CostModel(get_model("lwm-1m-text"), get_hardware("a100-80g"))
    ratio = cm.prefill(100_000, par=P(tp=8)).total_s / cm.prefill(1000, par=P(tp=8)).total_s
    prefill_gain = cm.prefill(100_000, par=P(tp=2)).total_s / cm.prefill(100_000, par=P(tp=2, sp=4)).total_s
    decode_gain = cm.decode(8, 2000, P(tp=2)).total_s / cm.decode(8, 2000, P(tp=2, kvp=4)).total_s
    ref = figures()["loongserve_scaling"]["prefill_100k_vs_1k_latency_ratio"]
    return [
        # the paper does not give the configuration; TP8 on one node is the model's reading, held to 2x
        Check("prefill 100K / 1K", "LoongServe Sec. 2.4", ref, ratio, 1.0, ratio > 100, "x"),
        Check(
            "DoP 4 gain: prefill > decode",
            "LoongServe Fig. 2/3",
            prefill_gain,
            decode_gain,
            None,
            prefill_gain > 2 * decode_gain,
            "x",
        ),
    ]


def seesaw() -> list[Check]:
    """Llama-2-13B on 8 L4s over PCIe: all-reduce's share of prefill grows with TP (Fig. 1); pipelines win
    prefill throughput and TP wins decode (Fig. 3). Global batch 16, 1,000-token prompts, 1,500 of context."""
    cm = CostModel(get_model("llama2-13b"), get_hardware("l4"))
    shares = []
    for tp in (2, 4, 8):
        step = cm.step([Chunk(1000)] * 16, (), P(tp=tp))
        shares.append(step.op("tp_allreduce").s / step.total_s)  # type: ignore[union-attr]
    grows = shares[0] < shares[1] < shares[2]
    # PP runs the batch of 16 as 8 micro-batches of 2 through its stages (bubble included), TP all 16 at once
    prompts, contexts = [Chunk(1000)] * 16, [1500] * 16
    prefill_pp = 16_000 / cm.microbatched(prompts, (), P(pp=8), 8).total_s
    prefill_tp = 16_000 / cm.step(prompts, (), P(tp=8)).total_s
    decode_pp = 16 / cm.microbatched((), contexts, P(pp=8), 8).total_s
    decode_tp = 16 / cm.decode(16, 1500, P(tp=8)).total_s
    return [
        Check("all-reduce share of prefill, TP2->8", "Seesaw Fig. 1", shares[0], shares[2], None, grows),
        Check("prefill tok/s: PP8 > TP8", "Seesaw Fig. 3", prefill_tp, prefill_pp, None, prefill_pp > prefill_tp),
        Check("decode tok/s: TP8 > PP8", "Seesaw Fig. 3", decode_pp, decode_tp, None, decode_tp > decode_pp),
    ]


def csps_table3() -> list[Check]:
    """Moving Q (one token) vs KV (1M tokens) of one layer across 8 A100s for decode, GLM-4-9B."""
    hw, glm = get_hardware("a100-40g-p4d"), get_model("glm-4-9b-1m")  # the public config; the paper prints none
    b = glm.dtype_bytes
    q = hw.intra.transfer_s(glm.q_dim * b)
    kv = hw.intra.transfer_s(1_000_000 * 2 * glm.kv_dim * b)
    ref = figures()["csps_headline"]["q_vs_kv_transfer_ms_1m"]
    return [Check("KV / Q transfer at 1M", "CSPS Table 3", ref[1] / ref[0], kv / q, None, kv > 100 * q, "x")]


def h100_layers(path: str | Path) -> list[Check]:
    """Whole decoder layers timed on an H100 (`bench/gpu_ops.py`), held out from the efficiencies, which come
    from that run's GEMM / attention / KV-read microbenchmarks on Llama-3-8B's shapes; other models' layers
    (Llama-2-7B's MHA, CodeLlama-34B, Llama-3-70B) are shapes the efficiencies never saw."""
    data = json.loads(Path(path).read_text())
    runs = {"llama3-8b": data, **data.get("other_models", {})}
    hw = get_hardware("h100-sxm")
    checks = []
    for name, run in runs.items():
        model = get_model(name)
        cm = CostModel(model, hw)

        def per_layer(bd: Any, layers: int = model.layers) -> float:
            return sum(o.s for o in bd.ops if o.name not in ("lm_head", "iteration")) / layers

        for r in run["layer_prefill"]:
            predicted = per_layer(cm.prefill(r["tokens"]))
            what = f"H100 {name} layer prefill {r['tokens']}"
            checks.append(Check(what, H100_SOURCE, r["s_per_layer"], predicted, 0.2, unit="s", kind="measured"))
        for r in run["layer_decode"]:
            predicted = per_layer(cm.decode(r["batch"], r["context"]))
            what = f"H100 {name} layer decode b{r['batch']} c{r['context']}"
            checks.append(Check(what, H100_SOURCE, r["s_per_layer"], predicted, 0.2, unit="s", kind="measured"))
    return checks


def paper_checks() -> list[Check]:
    return [*tetris_table1(), *tetris_fig2(), *medha_fig2(), *medha_fig11(), *loongserve(), *seesaw(), *csps_table3()]


def _largest(ok: Any, lo: int = 1024, hi: int = 1 << 27) -> int:
    """The largest n in [lo, hi) with ok(n), for ok monotone (true, then false)."""
    while hi - lo > max(1, lo // 200):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
