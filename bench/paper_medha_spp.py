"""Medha's sequence pipeline parallelism at scale (§3.3, Fig. 8-10) from the shared cost model.

    .venv/bin/python bench/paper_medha_spp.py     # table + bench/results/paper_medha_spp.json (a few seconds)

- Fig. 9: TTFT of one 1M-10M-token prompt on Medha 2D (TP8 per H100 server, SPP 1-16, 4,096-token chunks that
  pipeline over the stages), Llama-3-8B and -70B; "x" where the weights, KV and activations do not fit the GPUs
  (the paper's red crosses). Scaling efficiency from the smallest degree s0 that fits: s0 x TTFT(s0) / (SPP x
  TTFT(SPP)); the paper: 80 %+.
- Fig. 10: decode latency of one request at 2M context against the SPP degree (paper: "only marginally affected
  even with a 16-stage pipeline").
- Fig. 8: 1M tokens of Llama-3-8B on 128 H100s: SPP 16 x TP8 against context parallelism (ring SP 16 x TP8, the
  whole prompt in one pass); the paper: Medha 1.64x faster, under 15 s.
The cost model's SPP is `CostModel.prefill(..., par=Parallelism(tp, pp), chunk_size=...)` (costs.py): chunk i+1
enters stage 1 as chunk i leaves it; the simulator's SPP replicas use the same rule (sim/iteration_side.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from spindle_costmodel import CostModel
from spindle_costmodel.hardware import get_hardware
from spindle_costmodel.model import get_model
from spindle_costmodel.parallel import Parallelism

RESULTS = Path(__file__).parent / "results"
HARDWARE, TP, CHUNK = "h100-sxm", 8, 4096
MODELS = ("llama3-8b", "llama3-70b")
TOKENS = (1_000_000, 2_000_000, 4_000_000, 10_000_000)
SPP = (1, 2, 4, 8, 16)


def fits(cm: CostModel, par: Parallelism, tokens: int) -> bool:
    plan = cm.memory(par, tokens, CHUNK)
    return plan.weights + plan.kv + plan.activations <= plan.capacity


def fig9(cm: CostModel) -> dict[str, dict[str, float | None]]:
    """TTFT (s) per prompt length and SPP degree; None where it does not fit."""
    out: dict[str, dict[str, float | None]] = {}
    for n in TOKENS:
        row: dict[str, float | None] = {}
        for spp in SPP:
            par = Parallelism(tp=TP, pp=spp)
            row[str(spp)] = cm.prefill(n, par=par, chunk_size=CHUNK).total_s if fits(cm, par, n) else None
        out[str(n)] = row
    return out


def efficiency(row: dict[str, float | None]) -> dict[str, float | None]:
    """Scaling efficiency per SPP degree against the smallest degree that fits (None where it does not fit)."""
    fitting = [(int(s), t) for s, t in row.items() if t is not None]
    if not fitting:
        return dict.fromkeys(row)
    s0, t0 = fitting[0]
    return {s: (s0 * t0 / (int(s) * t) if t is not None else None) for s, t in row.items()}


def run() -> dict[str, Any]:
    hw = get_hardware(HARDWARE)
    doc: dict[str, Any] = {"hardware": HARDWARE, "tp": TP, "chunk": CHUNK, "models": {}}
    for name in MODELS:
        cm = CostModel(get_model(name), hw)
        ttft = fig9(cm)
        decode = {str(s): cm.decode(1, 2_000_000, Parallelism(tp=TP, pp=s)).total_s for s in SPP}
        doc["models"][name] = {
            "fig9_ttft_s": ttft,
            "fig9_efficiency": {n: efficiency(row) for n, row in ttft.items()},
            "fig10_decode_2m_s": decode,
        }
    cm = CostModel(get_model("llama3-8b"), hw)
    spp = cm.prefill(1_000_000, par=Parallelism(tp=TP, pp=16), chunk_size=CHUNK).total_s
    cp = cm.prefill(1_000_000, par=Parallelism(tp=TP, sp=16)).total_s
    doc["fig8_1m_128gpus"] = {"spp16_tp8_s": spp, "cp16_tp8_s": cp, "cp_over_spp": cp / spp, "paper": 1.64}
    return doc


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "x" if x is None else fmt.format(x)


def table(doc: dict[str, Any]) -> str:
    lines = [f"Fig. 9: TTFT (s) of one prompt, TP{TP} x SPP on {HARDWARE}, {CHUNK}-token chunks (x: does not fit)"]
    for name, m in doc["models"].items():
        lines.append(f"  {name:10s} " + " ".join(f"SPP{s:>2}" for s in SPP) + "   efficiency at SPP 16")
        for n, row in m["fig9_ttft_s"].items():
            eff = [e for e in m["fig9_efficiency"][n].values() if e is not None]
            cells = " ".join(f"{_f(row[str(s)]):>5s}" for s in SPP)
            lines.append(f"  {int(n) // 10**6:>3d}M {'':6s}{cells}   {_f(eff[-1] if len(eff) > 1 else None, '{:.0%}')}")
    lines.append("Fig. 10: decode step (ms) at 2M context against the SPP degree")
    for name, m in doc["models"].items():
        lines.append(f"  {name:10s} " + " ".join(f"{1e3 * t:.2f}" for t in m["fig10_decode_2m_s"].values()))
    f8 = doc["fig8_1m_128gpus"]
    lines.append(
        f"Fig. 8: 1M tokens, Llama-3-8B, 128 H100: SPP16 x TP8 {f8['spp16_tp8_s']:.2f} s, CP16 x TP8 "
        f"{f8['cp16_tp8_s']:.2f} s: CP / SPP {f8['cp_over_spp']:.2f}x (paper 1.64x)"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / "paper_medha_spp.json")
    args = parser.parse_args()
    doc = run()
    print(table(doc))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
