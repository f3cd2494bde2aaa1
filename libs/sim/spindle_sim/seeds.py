"""`spindle sim compare --seeds 1,2,3`: one comparison per seed, merged into one document, and the only claims the
seeds can carry.

- Merged: every number of a strategy's JSON (the run's scalars and each latency statistic, the max load) is the
  mean over the seeds where it is not null, and `"spread": {metric: [min, max]}` holds its range (latency
  statistics as `"ttft_s.p50"`, ...); `"per_seed": {seed: {metric: value}}` keeps each seed's scalars (the max
  load per seed among them).
- Verdicts: per metric (goodput, max load, throughput: higher is better; P50 TTFT and TPOT: lower is better) the
  strategy with the best mean *wins* only when its range does not overlap any other strategy's range; otherwise it is
  a *tie* with every strategy whose range overlaps its own. Configurations of one strategy (`tetris:max_sp=8`,
  `tetris@paper`) are not each other's rivals. One seed carries no claim.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from spindle_policy.strategy import parse_strategy_spec

SCALARS = ("completed", "rejected", "throughput_tok_s", "goodput_rps", "slo_attainment", "batch_jct_s",
           "max_load_rps")  # fmt: skip
STAT_KEYS = ("ttft_s", "tpot_s", "e2e_s", "interactive_ttft_s", "interactive_tpot_s")
# metric -> True when higher is better
VERDICT_METRICS = {"goodput_rps": True, "max_load_rps": True, "throughput_tok_s": True, "ttft_s.p50": False,
                   "tpot_s.p50": False}  # fmt: skip


def parse_seeds(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]: distinct integers, in the order given."""
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"--seeds takes comma-separated integers, got {text!r}") from e
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds needs distinct seeds, got {text!r}")
    return seeds


def _values(d: dict[str, Any]) -> dict[str, float]:
    """A strategy's numbers, flat: its scalars and 'ttft_s.p50'-style statistics (nulls left out)."""
    out = {k: float(d[k]) for k in SCALARS if d.get(k) is not None}
    for k in STAT_KEYS:
        for stat, v in (d.get(k) or {}).items():
            if v is not None:
                out[f"{k}.{stat}"] = float(v)
    return out


def merge_seed_docs(seeds: Sequence[int], docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One comparison document from one per seed (the first seed's workload and cluster, the seeds listed)."""
    merged = dict(docs[0])
    merged["workload"] = dict(docs[0]["workload"], seed=None, seeds=list(seeds))
    strategies: dict[str, Any] = {}
    for spec in docs[0]["strategies"]:
        per_seed = {seed: _values(doc["strategies"][spec]) for seed, doc in zip(seeds, docs, strict=True)
                    if spec in doc["strategies"]}  # fmt: skip
        metrics = sorted({m for v in per_seed.values() for m in v})
        spread = {m: [min(v[m] for v in per_seed.values() if m in v), max(v[m] for v in per_seed.values() if m in v)]
                  for m in metrics}  # fmt: skip
        mean = {m: statistics.fmean(v[m] for v in per_seed.values() if m in v) for m in metrics}
        d = dict(docs[0]["strategies"][spec])
        for k in SCALARS:
            d[k] = mean.get(k)
        for k in STAT_KEYS:
            if d.get(k) is not None:
                d[k] = {stat: mean.get(f"{k}.{stat}") for stat in d[k]}
        d["spread"] = spread
        d["per_seed"] = {str(seed): {k: v[k] for k in SCALARS if k in v} for seed, v in per_seed.items()}
        strategies[spec] = d
    merged["strategies"] = strategies
    merged["verdicts"] = verdicts(strategies, len(seeds))
    return merged


def verdicts(strategies: dict[str, Any], num_seeds: int) -> dict[str, Any]:
    """metric -> {"best", "result": "wins" | "tie", "tied_with": [...]} (see the module docstring); {} with one seed."""
    if num_seeds < 2:
        return {}
    out: dict[str, Any] = {}
    for metric, higher in VERDICT_METRICS.items():
        ranges = {s: d["spread"][metric] for s, d in strategies.items() if metric in d.get("spread", {})}
        if len(ranges) < 2:
            continue
        means = {s: _values(strategies[s])[metric] for s in ranges}  # the merged document holds the means
        best = (max if higher else min)(means, key=lambda s: means[s])
        lo, hi = ranges[best]
        mine = parse_strategy_spec(best)[0]
        rivals = {s: r for s, r in ranges.items() if parse_strategy_spec(s)[0] != mine}  # not its own variants
        tied = [s for s, (a, b) in rivals.items() if a <= hi and b >= lo]
        out[metric] = {"best": best, "result": "tie" if tied else "wins", "tied_with": tied}
    return out


def verdict_lines(doc: dict[str, Any]) -> list[str]:
    """The verdicts as the table prints them."""
    seeds = doc["workload"].get("seeds") or []
    if len(seeds) < 2:
        return ["one seed: no strategy is called the winner (give --seeds 1,2,3 to compare over seeds)"]
    lines = [f"over seeds {', '.join(map(str, seeds))} (a win only where the seeds' ranges do not overlap):"]
    for metric, v in doc.get("verdicts", {}).items():
        if v["result"] == "wins":
            lines.append(f"  {metric}: {v['best']} wins")
        else:
            lines.append(f"  {metric}: tie between {', '.join([v['best'], *v['tied_with']])}")
    return lines
