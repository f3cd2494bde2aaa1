"""How long LoongServe's batching step (Eq. 5, §5.3) takes as the pool grows to 128 elastic instances.

    python bench/loongserve_plan_time.py     # bench/results/loongserve_plan_time.json

The paper asks the whole schedule to fit "tens of milliseconds" and bounds the DP's splits by Eq. 6 to keep it
polynomial at scale. For each pool size (8 ... 128 instances, random unused slots) and batch of pending
requests (1 ... 32, lengths from the loongserve-mixed workload), the DP is timed exhaustively and with Eq. 6's
bounds (Eq. 7 fitted from the cost model: LWM-1M-Text on A100-80G at TP2, DoP 1-128), and the bounded plan's
summed input latency is compared with the exhaustive optimum. The strategy uses the exhaustive search while
n^2 m^2 <= EXACT_BUDGET and the bounds beyond.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from spindle_costmodel import CostModel, Parallelism, get_hardware, get_model
from spindle_policy.calibration import latency_from_cost_model
from spindle_policy.strategies.loongserve.batching import EXACT_BUDGET, plan_batches
from spindle_sim.workloads import make_workload

RESULTS = Path(__file__).parent / "results"
POOLS = (8, 16, 32, 64, 128)
BATCHES = (1, 4, 8, 16, 32)


def timed(repeat: int, *args: object, exact: bool) -> tuple[float, float]:
    """(median ms of `plan_batches(*args, exact=exact)`, its summed input latency)."""
    times, value = [], 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        value, _ = plan_batches(*args, exact=exact)  # type: ignore[arg-type]
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--exact-limit", type=int, default=64, help="largest pool timed exhaustively (slow in Python)")
    p.add_argument("--out", type=Path, default=RESULTS / "loongserve_plan_time.json")
    args = p.parse_args()
    cm = CostModel(get_model("lwm-1m-text"), get_hardware("a100-80g"))
    sizes = sorted({*range(1, 9), 16, 32, 64, 128})
    lm = latency_from_cost_model(cm, sizes, prefill=Parallelism(tp=2), max_tokens=1 << 19)
    fitted = lm.batch_prefill.coeffs  # type: ignore[union-attr]
    # every DoP up to 128: the fitted sizes, the others interpolated between their neighbours
    coeffs = {}
    for dop in range(1, 129):
        lo = max(s for s in fitted if s <= dop)
        hi = min((s for s in fitted if s >= dop), default=lo)
        w = 0.0 if hi == lo else (dop - lo) / (hi - lo)
        coeffs[dop] = tuple((1 - w) * a + w * b for a, b in zip(fitted[lo], fitted[hi], strict=True))
    rng = np.random.default_rng(0)
    lengths = [r.num_prefill_tokens for r in make_workload("loongserve-mixed", 1000, 1.0, seed=0)]
    rows = []
    print(f"{'instances':>9}{'requests':>9}{'exact ms':>10}{'bounded ms':>12}{'bounded/optimum':>17}{'default':>9}")
    for m in tqdm(POOLS, desc="pools"):
        slots = sorted(rng.integers(100_000, 280_000, m).tolist())
        for n in BATCHES:
            lens = sorted(rng.choice(lengths, n).tolist(), reverse=True)
            needs = [x + 512 for x in lens]
            bounded_ms, bounded = timed(args.repeat, lens, needs, slots, coeffs, exact=False)
            exact_ms = ratio = None
            if m <= args.exact_limit:
                exact_ms, best = timed(1, lens, needs, slots, coeffs, exact=True)
                ratio = bounded / best if math.isfinite(best) and best > 0 else None  # None: no plan fits
            default = "exact" if (n * m) ** 2 <= EXACT_BUDGET else "bounded"
            rows.append({"instances": m, "requests": n, "exact_ms": exact_ms, "bounded_ms": bounded_ms,
                         "bounded_over_optimum": ratio, "default": default})  # fmt: skip
            e = f"{exact_ms:10.2f}" if exact_ms is not None else f"{'-':>10}"
            r = f"{ratio:17.4f}" if ratio is not None else f"{'-':>17}"
            tqdm.write(f"{m:9d}{n:9d}{e}{bounded_ms:12.2f}{r}{default:>9}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"exact_budget": EXACT_BUDGET, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
