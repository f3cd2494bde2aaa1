"""`spindle sim compare --tune`: every strategy at its best, found the same way.

Each strategy class names its deployment knobs (`Strategy.tuning`): options of its own (SP caps, chunk sizes, ...)
and two of the cluster's shape, `prefill_share` (its share of the GPUs as prefill instances, on a prefill/decode
split) and `decode_tp` (the TP of its decode or colocated instances). The search is the same for every strategy: its
default configuration plus candidates drawn from the grid of its knobs without replacement (deterministic), `budget`
runs in all, each the cell's trace at `--rate` on the *tuning seed*; the configuration with the highest goodput
(ties: higher SLO attainment, then lower P50 TTFT) is kept and evaluated on the comparison's seeds, which must not
include the tuning seed. The paper's own configuration of each strategy (its defaults on its default shape) is kept
beside it as `NAME@paper` (not for `spindle`, which no paper configures).
"""

from __future__ import annotations

import argparse
import itertools
import random
from dataclasses import dataclass, replace
from typing import Any

from spindle_policy.strategy import parse_strategy_spec, strategy_class

from .executor import simulate
from .forked import map_forked
from .named_cluster import SimSetup
from .shapes import Entry, Shaper, check_runs
from .workloads import make_workload

SHAPE_KNOBS = ("prefill_share", "decode_tp")
PAPER = "@paper"


@dataclass(frozen=True)
class Tried:
    config: dict[str, Any]  # knob -> value (shape knobs and options)
    spec: str
    objective: tuple[float, float, float] | None  # None: it could not run (`why`)
    why: str = ""


def candidates(space: dict[str, tuple[Any, ...]], budget: int, seed: int) -> list[dict[str, Any]]:
    """The default ({}) first, then up to `budget` - 1 configurations of the grid in a seeded random order."""
    if budget < 1:
        raise ValueError(f"the tuning budget must be >= 1 run, got {budget}")
    keys = sorted(space)
    grid = [dict(zip(keys, values, strict=True)) for values in itertools.product(*(space[k] for k in keys))]
    random.Random(seed).shuffle(grid)
    return [{}, *grid[: budget - 1]]


def spec_with(spec: str, options: dict[str, Any]) -> str:
    name, given = parse_strategy_spec(spec)
    merged = given | options
    return name + (":" + ",".join(f"{k}={v}" for k, v in merged.items()) if merged else "")


def objective(summary: Any) -> tuple[float, float, float]:
    """Higher is better: goodput, SLO attainment, then -P50 TTFT."""
    ttft = summary.interactive_ttft_s.p50
    return (summary.goodput_req_s or 0.0, summary.slo_attainment or 0.0, -ttft if ttft == ttft else float("-inf"))


def tune_entry(entry: Entry, args: argparse.Namespace, shaper: Shaper, slo: Any) -> tuple[Entry, list[Tried]]:
    """The entry's strategy at the best configuration the search found on the tuning seed (the runs `--jobs` at a
    time)."""
    cls = strategy_class(entry.spec)
    trace = make_workload(args.workload, args.num_requests, args.rate, args.tune_seed, args.arrival, args.cv)

    def run(config: dict[str, Any]) -> Tried:
        shape = {k: v for k, v in config.items() if k in SHAPE_KNOBS}
        spec = spec_with(entry.spec, {k: v for k, v in config.items() if k not in SHAPE_KNOBS})
        setup = shaper.setup(cls, **shape) if shape else entry.setup
        why = setup if isinstance(setup, str) else check_runs(spec, cls, setup)
        if why:
            return Tried(config, spec, None, why)
        assert isinstance(setup, SimSetup)
        result = simulate(trace, spec, setup.latency, setup.config)
        return Tried(config, spec, objective(result.summary(args.workload, args.rate, slo)))

    configs = candidates(dict(cls.tuning), args.tune_budget, args.tune_seed)
    tried: list[Tried] = map_forked(run, configs, args.jobs)
    ran = [t for t in tried if t.objective is not None]
    if not ran:
        return replace(entry, skipped="no configuration of its tuning search could run"), tried
    chosen = max(ran, key=lambda t: t.objective)  # type: ignore[arg-type, return-value]  # the first of equals
    shape = {k: v for k, v in chosen.config.items() if k in SHAPE_KNOBS}
    setup = shaper.setup(cls, **shape) if shape else entry.setup
    assert isinstance(setup, SimSetup)
    note = f"tuned on seed {args.tune_seed} ({len(tried)} runs): {describe(chosen.config)}"
    tuned = {"seed": args.tune_seed, "runs": len(tried), "chosen": chosen.config}
    return replace(entry, spec=chosen.spec, setup=setup, note=note, tuned=tuned), tried


def describe(config: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.items()) or "its defaults"


def tune_entries(entries: list[Entry], args: argparse.Namespace, shaper: Shaper, slo: Any) -> list[Entry]:
    """Every runnable entry tuned, each followed by its paper configuration (`NAME@paper`, untuned) where a paper
    configures it."""
    out: list[Entry] = []
    for e in entries:
        if e.skipped or e.setup is None or e.spec.endswith(PAPER):
            out.append(e)
            continue
        tuned, _ = tune_entry(e, args, shaper, slo)
        print(f"{e.spec}: {tuned.note or tuned.skipped}")
        out.append(tuned)
        if not strategy_class(e.spec).from_paper:
            continue
        out.append(replace(e, spec=f"{parse_strategy_spec(e.spec)[0]}{PAPER}" if e.spec == e.asked else
                           f"{e.spec}{PAPER}", note="the paper's configuration (untuned)"))  # fmt: skip
    return out


def check_tune_args(args: argparse.Namespace, seeds: list[int]) -> None:
    if args.tune_budget < 1:
        raise ValueError(f"--tune-budget must be >= 1, got {args.tune_budget}")
    if args.rate is None:
        raise ValueError("--tune searches at the cell's load point: give --rate")
    if args.slo_ttft is None and args.slo_tpot is None:
        raise ValueError("--tune maximises goodput: give --slo-ttft and/or --slo-tpot")
    if args.tune_seed in seeds:
        raise ValueError(f"the tuning seed {args.tune_seed} is also evaluated: evaluate on other seeds (--seeds)")
