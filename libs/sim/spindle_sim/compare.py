"""`spindle sim compare`: strategies side by side on one trace and one cluster (STRATEGIES.md §4).

Every strategy (by default every registered one) replays the same trace at one rate (--rate) and/or has its max
sustainable load searched (--max-load, the rule and machinery of `sim sweep --max-load`); a table, one JSON and
one PNG put them side by side.
- Shapes: on a named cluster (--hardware) each strategy gets the GPUs shaped as it runs (named_cluster.py). On a
  cluster given as instance counts, a colocated strategy (`chunked`) gets the same GPUs as colocated instances of
  --decode-tp when none were given, and a disaggregated one gets half of them as prefill and the rest as decode
  instances when all the given ones are colocated; otherwise the instances are used as given.
- Options: a bare name whose default `sp` does not fit the cluster (fixed-sp's 8 on 4 prefill instances, or where
  the latency model has no SP-8 fit) runs with the largest SP size that does; the spec as run names it everywhere.
- Skipped, with the reason: a strategy whose options its constructor refuses on this cluster, one the cluster
  cannot be shaped for, or one that rejects every request of the trace. An unknown name or option, or a malformed
  spec, is an error (exit 2).
- JSON: {"workload": {...}, "cluster": {...}, "strategies": {SPEC: {"completed", "ttft_s", "tpot_s", "e2e_s",
  "interactive_ttft_s", "interactive_tpot_s", "throughput_tok_s", "goodput_rps", "slo_attainment",
  "batch_jct_s", "max_load_rps", "plan_us"}}}: the same keys for every strategy, null where not asked for or
  not applicable (the run's fields without --rate, goodput and SLO attainment without an SLO, the batch job's
  completion time on a trace without batch requests, the max load without --max-load; it is 0 when even the
  light load, or under --max-load-attainment the lowest rate probed, violates the SLO). Latency stats ({mean,
  p50, p90, p99}) cover every completed request; the interactive_* ones only interactive requests, which goodput
  and SLO attainment count too (batch requests have no latency SLO). batch_jct_s is from the batch job's first
  arrival to its last finish, and also null when a batch request did not finish (the table then says so).
  "workload.max_load" is the rule: {"metric", "slo_scale", "slo_s", "attainment"} ("slo_attainment" and the
  target share under --max-load-attainment, the SLO then in "workload.slo"). "cluster" is the shape most
  strategies ran on, with `by_strategy` (each one's) and `skipped` (spec -> reason).
- Table: a `batch JCT s` column when some strategy ran a trace with a batch job, `SLO att.` when an SLO was
  given.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

from spindle_policy.strategy import (
    available_strategies,
    parse_strategy_spec,
    strategy_class,
    strategy_options,
)

from .cli import (
    SPEC_HELP,
    _add_max_load_args,
    _add_run_args,
    _describe_max_load,
    _max_load,
    _print_shapes,
    _slo,
    check_max_load_args,
    rate_text,
    split_specs,
    use_trace_file,
)
from .executor import simulate
from .forked import map_forked
from .loadsearch import MaxLoad, Probe, light_load
from .metrics import SimSummary, Stats, strict_json
from .named_cluster import ClusterShape
from .seeds import merge_seed_docs, parse_seeds, verdict_lines
from .shapes import Entry, Shaper, prepare
from .tuning import check_tune_args, tune_entries
from .workloads import TraceRequest, make_workload

STATS = ("mean", "p50", "p90", "p99")
EXAMPLES = (
    "spindle sim compare --workload tetris-medium --rate 4 --slo-ttft 2 --slo-tpot 0.1 --plot compare.png "
    "--json compare.json",
    "spindle sim compare --model llama3-70b --hardware h100-sxm --nodes 2 --strategies single chunked "
    "fixed-sp:sp=2 --num-requests 300 --max-load --plot compare.png",
    "spindle sim compare --workload mixed-batch --rate 2 --slo-ttft 5 --slo-tpot 0.1 --max-load "
    "--max-load-attainment 0.9",
)


def build_compare_parser() -> argparse.ArgumentParser:
    description = (
        "Run strategies (default: every registered one) on the same trace and cluster and put them side by side: "
        "a table (TTFT, TPOT, E2E, throughput, goodput, max load, plan() time, and how each strategy's GPUs were "
        "shaped), one PNG (--plot) and one JSON (--json). Give --rate for one load point, --max-load to search each "
        "strategy's max sustainable load (as `spindle sim sweep --max-load`), or both. On a named cluster "
        "(--hardware) each strategy gets the GPUs shaped as it runs; on instance counts a colocated strategy gets "
        "the same GPUs as colocated instances. A bare name whose default SP size does not fit the cluster runs with "
        "the largest that does; a strategy that cannot run is skipped, with the reason."
    )
    epilog = (
        f"{SPEC_HELP} --strategies takes specs as `spindle sim sweep` does (`single,request-sp fixed-sp:sp=4`). "
        f"Known strategies: {', '.join(available_strategies())}. The JSON: {{workload, cluster, strategies: {{SPEC: "
        "{completed, ttft_s, tpot_s, e2e_s, interactive_ttft_s, interactive_tpot_s, throughput_tok_s, goodput_rps, "
        "slo_attainment, batch_jct_s, max_load_rps, plan_us}}}, the same keys for every strategy, null where not "
        "asked for or not applicable. Goodput, SLO attainment and the interactive_* latencies count interactive "
        "requests only (batch requests, e.g. mixed-batch's job, have no latency SLO); batch_jct_s is the batch "
        "job's completion time (null without one, or when it did not finish)."
    )
    p = argparse.ArgumentParser(
        prog="spindle sim compare",
        description=textwrap.fill(description, 100, break_on_hyphens=False),
        epilog=textwrap.fill(epilog, 100, break_on_hyphens=False)
        + "\n\nexamples:\n"
        + "\n".join(f"  {e}" for e in EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--strategies", nargs="+", metavar="SPEC", help="strategy specs (default: every registered strategy)"
    )
    p.add_argument("--rate", type=float, help="one load point: mean arrival rate, requests/s (inf: all at once)")
    _add_run_args(p, num_requests=1000)
    p.add_argument("--plot", type=Path, help="write a PNG of the strategies side by side here")
    p.add_argument("--json", type=Path, help="write the comparison here")
    p.add_argument(
        "--timeline",
        type=Path,
        metavar="PATH",
        help="with --rate: write each strategy's run as one HTML page (as `spindle sim --timeline`), named after "
        "PATH with the strategy in it: out.html -> out.tetris.html",
    )
    p.add_argument(
        "--tune",
        action="store_true",
        help="search each strategy's deployment knobs (its options and share of prefill GPUs or instance TP: "
        "`Strategy.tuning`) with the same budget on --tune-seed at --rate, for the highest goodput under "
        "--slo-ttft/--slo-tpot; then evaluate the chosen configuration on the comparison's seeds, beside the "
        "paper's configuration as NAME@paper",
    )
    p.add_argument("--tune-budget", type=int, default=8, metavar="N", help="runs per strategy's search (default 8)")
    p.add_argument(
        "--tune-seed", type=int, default=99, metavar="S", help="the seed tuned on, never evaluated (default 99)"
    )
    p.add_argument(
        "--seeds",
        metavar="S,S,...",
        help="run the comparison once per seed (e.g. 1,2,3; overrides --seed): the JSON holds each metric's mean "
        "with its range (`spread`) and each seed's values (`per_seed`), and a strategy is called the winner of a "
        "metric only where its range does not overlap another's (else a tie)",
    )
    _add_max_load_args(p)
    p.add_argument(
        "--jobs", type=int, default=1, metavar="N",
        help="simulations at once (the tuning runs, the light-load probes, each strategy's run and max-load search), "
        "in forked processes (default 1); the results do not depend on it",
    )  # fmt: skip
    return p


def check_spec(spec: str) -> None:
    """A known strategy with only options it has (ValueError otherwise); their values are checked when built."""
    name, options = parse_strategy_spec(spec)
    strategy_class(spec)
    allowed = strategy_options(name)
    if unknown := sorted(set(options) - set(allowed)):
        have = ", ".join(f"{k}={v}" for k, v in allowed.items()) or "none"
        raise ValueError(f"strategy {name!r} has no option {', '.join(unknown)} (options: {have})")


def run_entry(
    entry: Entry, args: argparse.Namespace, trace: list[TraceRequest] | None, shared: SharedSlo | None = None
) -> Entry:
    """The run at --rate on `trace` (when given), then the max-load search (with --max-load) under the cell's
    `shared` SLO (the latency rule without --max-load-slo)."""
    if entry.skipped or entry.setup is None:
        return entry
    s = entry.setup
    if trace is not None:
        if getattr(args, "timeline", None) is None:
            result = simulate(trace, entry.spec, s.latency, s.config)
        else:  # the same run, its timeline written as one page
            from .timeline import run_recorded, strategy_path

            path = strategy_path(args.timeline, entry.spec)
            title = f"spindle sim compare: {entry.spec} on {args.workload} at {rate_text(args.rate)} ({s.shape.text})"
            result = run_recorded(trace, entry.spec, s.latency, s.config, path, title)
            print(f"timeline of {entry.spec}: {path}")
        if result.records and all(r.state == "rejected" for r in result.records):
            return replace(entry, skipped=f"rejects every request ({result.records[0].reason})")
        entry = replace(entry, summary=result.summary(args.workload, args.rate, _slo(args)))
    if args.max_load:
        if shared is None:
            entry = replace(entry, max_load=_max_load(entry.spec, s, args))
        else:
            light = shared.light_rates.get(entry.spec)
            entry = replace(entry, max_load=_max_load(entry.spec, s, args, slo_s=shared.slo_s, light_rate=light))
    return entry


@dataclass(frozen=True)
class SharedSlo:
    """The latency rule's SLO of a cell, the same for every strategy: `slo_scale` x the best light-load value."""

    slo_s: float  # inf: no strategy served its light load
    light_value: float
    strategy: str  # whose light load it is ("" when none served it)
    light_rates: dict[str, float]  # spec -> its light rate (the search starts there)


def shared_slo(entries: list[Entry], args: argparse.Namespace) -> SharedSlo | None:
    """The cell's SLO under the latency rule with no absolute --max-load-slo (None otherwise): each strategy's
    light load is found on the same trace, and the SLO is --slo-scale x the lowest light-load value (a strategy that
    rejects requests at light load has an infinite one). Printed, and the same for every strategy."""
    if not args.max_load or args.max_load_attainment is not None or args.max_load_slo is not None:
        return None
    best, rates = (math.inf, ""), {}

    def light(e: Entry) -> tuple[float, float]:
        assert e.setup is not None
        probe = Probe(e.spec, args.workload, e.setup.latency, e.setup.config, args.num_requests, args.seed,
                      args.arrival, args.cv, args.max_load_window)  # fmt: skip
        if args.light_rate is not None:
            return args.light_rate, probe.latency_at(args.metric, args.percentile)(args.light_rate)
        return light_load(probe, args.metric, args.percentile, args.start_rate)

    runnable = [e for e in entries if not e.skipped and e.setup is not None]
    for e, (rate, value) in zip(runnable, map_forked(light, runnable, args.jobs), strict=True):
        rates[e.spec] = rate
        if value < best[0]:
            best = (value, e.spec)
    shared = SharedSlo(args.slo_scale * best[0], best[0], best[1], rates)
    metric = f"{args.metric}_{args.percentile}"
    if best[1]:
        print(f"SLO for every strategy: {metric} <= {shared.slo_s:.4g} s ({args.slo_scale:g} x {best[1]}'s light "
              f"load, the best: {best[0]:.4g} s)")  # fmt: skip
    else:
        print("no strategy served the light load without rejecting requests: no SLO, no max load")
    return shared


def _stats(s: Stats) -> dict[str, float]:
    return {k: getattr(s, k) for k in STATS}


def strategy_dict(entry: Entry) -> dict[str, Any]:
    """One strategy's JSON: the same keys always, None where not asked for."""
    s, m = entry.summary, entry.max_load
    return {
        "completed": None if s is None else s.completed,
        # refused or unfinished: every request the run did not complete (each one a miss)
        "rejected": None if s is None else s.num_requests - s.completed,
        "ttft_s": None if s is None else _stats(s.ttft_s),
        "tpot_s": None if s is None else _stats(s.tpot_s),
        "e2e_s": None if s is None else _stats(s.e2e_s),
        "interactive_ttft_s": None if s is None else _stats(s.interactive_ttft_s),
        "interactive_tpot_s": None if s is None else _stats(s.interactive_tpot_s),
        "throughput_tok_s": None if s is None else s.throughput_tok_s,
        "goodput_rps": None if s is None else s.goodput_req_s,
        "slo_attainment": None if s is None else s.slo_attainment,
        "batch_jct_s": None if s is None else s.batch_jct_s,
        "max_load_rps": None if m is None else (m.rate if m.rate is not None else 0.0),
        "plan_us": None if s is None else asdict(s.plan_us),
        # how far the strategy's forms were from what its work was charged (named clusters: the cost model)
        "prediction_error": None if s is None else s.prediction_error,
        # the deployment it ran: its spec, its GPUs, and what --tune chose (null: not tuned)
        "config": {
            "spec": entry.spec,
            "gpus": None if entry.setup is None else short_shape(entry.setup.shape),
            "tuned": entry.tuned,
        },
    }


def compare_doc(args: argparse.Namespace, entries: list[Entry], shared: SharedSlo | None = None) -> dict[str, Any]:
    slo = _slo(args)
    rule = None
    if args.max_load and args.max_load_attainment is not None:
        rule = {"metric": "slo_attainment", "slo_scale": None, "slo_s": None, "attainment": args.max_load_attainment}
    elif args.max_load:
        metric = f"{args.metric}_{args.percentile}"
        rule = {"metric": metric, "slo_scale": args.slo_scale, "slo_s": args.max_load_slo, "attainment": None}
    if rule is not None:
        rule["window_s"] = args.max_load_window
        if shared is not None:  # the same SLO for every strategy, from the best light load
            rule["slo_s"] = shared.slo_s if math.isfinite(shared.slo_s) else None
            rule["slo_from"] = shared.strategy or None
    workload = {
        "name": args.workload,
        "num_requests": args.num_requests,
        "rate": args.rate,
        "arrival": args.arrival,
        "cv": args.cv,
        "seed": args.seed,
        "slo": None if slo is None else asdict(slo),
        "max_load": rule,
    }
    ran = [e for e in entries if not e.skipped]
    by_strategy = {e.spec: e.setup.shape.as_dict() for e in ran if e.setup is not None}
    shaped = [e.setup.shape.as_dict() for e in entries if e.setup is not None]
    shapes = list(by_strategy.values()) or shaped
    first = max(shapes, key=shapes.count) if shapes else {}  # the shape most strategies ran on (ties: the first)
    skipped = {e.spec: e.skipped for e in entries if e.skipped}
    cluster = first | {"by_strategy": by_strategy, "skipped": skipped}
    doc = {"workload": workload, "cluster": cluster, "strategies": {e.spec: strategy_dict(e) for e in ran}}
    return cast(dict[str, Any], strict_json(doc))


def short_shape(shape: ClusterShape) -> str:
    """'16 prefill + 16 decode, TP1', '2 prefill TP4 + 2 decode TP8', '32 colocated, TP1'."""
    roles = [
        (role, n, tp)
        for role, n, tp in (
            ("prefill", shape.num_prefill, shape.prefill_tp),
            ("decode", shape.num_decode, shape.decode_tp),
            ("colocated", shape.num_colocated, shape.colocated_tp),
        )
        if n
    ]
    if shape.colocated_spp > 1 and shape.num_colocated:  # pipeline replicas: colocated only
        return " + ".join(f"{n} {role} TP{tp}" for role, n, tp in roles) + f"-SPP{shape.colocated_spp}"
    if len({tp for _, _, tp in roles}) == 1:
        return " + ".join(f"{n} {role}" for role, n, _ in roles) + f", TP{roles[0][2]}"
    return " + ".join(f"{n} {role} TP{tp}" for role, n, tp in roles)


def _num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def _percent(x: float | None) -> str:
    return "-" if x is None or x != x else f"{100 * x:.1f}%"


def _jct_text(s: SimSummary | None) -> str:
    """The batch job's completion time: '812.4', 'unfinished' (a batch request was rejected or failed), '-'."""
    if s is None or s.batch_jct_s is None:
        return "-"
    return "unfinished" if s.batch_jct_s == float("inf") else f"{s.batch_jct_s:.1f}"


def _max_load_text(m: MaxLoad | None, rate: float | None) -> str:
    """The max load column: '6.75', '>= 64' when never violated up to the highest rate probed, '-'."""
    if m is None or rate is None:
        return "-"
    return f"{'>= ' if m.rate is not None and not m.saturated else ''}{rate:.3g}"


def _ranged(d: dict[str, Any], key: str, digits: int = 3) -> str:
    """A number, with its range over the seeds when there are several: '2.41 [2.30-2.52]'."""
    text = _num(d[key], digits)
    spread = d.get("spread", {}).get(key)
    if spread is None or spread[0] == spread[1] or text == "-":
        return text
    return f"{text} [{_num(spread[0], digits)}-{_num(spread[1], digits)}]"


def _prediction_text(errors: dict[str, Any] | None) -> str:
    """The mean |predicted - charged| / charged over all the work a strategy ran, '-' when its run is priced by its
    own forms; then, where its plans predict TTFT, the mean |predicted - got| / got: '4.1%', '4.1%, TTFT 12%'."""
    errors = errors or {}
    work = _percent(errors["all"]["mean_abs"]) if "all" in errors else "-"
    return work + (f", TTFT {_percent(errors['ttft']['mean_abs'])}" if "ttft" in errors else "")


def format_compare_table(entries: list[Entry], doc: dict[str, Any]) -> str:
    """A fixed-width table, one strategy a row; skipped ones say why. `SLO att.` when an SLO was given, `batch JCT s`
    when some strategy ran a trace with a batch job; `rej.` counts the requests each strategy did not complete. With
    several seeds each number is the mean, goodput and max load with their range, and the verdicts follow."""
    with_slo = doc["workload"]["slo"] is not None
    with_batch = any(e.summary is not None and e.summary.num_batch for e in entries)
    head = ["strategy", "GPUs", "done", "rej.", "ttft p50", "ttft p99", "tpot p50", "tpot p99", "e2e p50", "tok/s"]
    head += ["goodput req/s", *(["SLO att."] if with_slo else []), *(["batch JCT s"] if with_batch else [])]
    head += ["max load req/s", "plan µs mean/p99", "pred. err"]
    rows, notes = [], []
    for e in entries:
        shape = "-" if e.setup is None else short_shape(e.setup.shape)
        if e.skipped:
            notes.append(f"{e.spec}: skipped: {e.skipped}")
            continue
        d = doc["strategies"][e.spec]
        ttft, tpot, e2e, plan = (d[k] or {} for k in ("ttft_s", "tpot_s", "e2e_s", "plan_us"))
        done = "-" if d["completed"] is None else f"{d['completed']:g}/{doc['workload']['num_requests']}"
        max_load = _max_load_text(e.max_load, d["max_load_rps"])
        if "spread" in d and max_load != "-":
            max_load = (">= " if max_load.startswith(">=") else "") + _ranged(d, "max_load_rps")
        rows.append(
            [
                e.spec,
                shape,
                done,
                "-" if d["rejected"] is None else f"{d['rejected']:g}",
                *(_num(x.get(p)) for x, p in ((ttft, "p50"), (ttft, "p99"), (tpot, "p50"), (tpot, "p99"))),
                _num(e2e.get("p50")),
                _num(d["throughput_tok_s"], 1),
                _ranged(d, "goodput_rps"),
                *([_percent(d["slo_attainment"])] if with_slo else []),
                *([_jct_text(e.summary)] if with_batch else []),
                max_load,
                "-" if not plan else f"{_num(plan['mean'], 0)}/{_num(plan['p99'], 0)}",
                _prediction_text(d.get("prediction_error")),
            ]
        )
        if e.note:
            notes.append(f"{e.spec}: {e.note}")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([*(fmt.format(*r) for r in [head, *rows]), *notes, *verdict_lines(doc)])


def compare_title(doc: dict[str, Any]) -> str:
    w, c = doc["workload"], doc["cluster"]
    where = "the given instances"
    if c.get("model"):
        where = f"{c['model']} on {c['nodes']} x {c['gpus_per_node']} {c['hardware']}"
    at = "" if w["rate"] is None else f" at {w['rate']:g} req/s"
    return f"{w['name']}, {w['num_requests']} requests{at} - {where} ({c.get('gpus', '?')} GPUs)"


@dataclass(frozen=True)
class SeedRun(Entry):
    """An entry run on one seed, with the cell's shared SLO it was searched under."""

    shared: SharedSlo | None = None


def done_shared(done: list[Entry]) -> SharedSlo | None:
    return next((e.shared for e in done if isinstance(e, SeedRun) and e.shared is not None), None)


def run_seed(entries: list[Entry], args: argparse.Namespace) -> list[Entry]:
    """Every entry on `args.seed`: the run at --rate (or a --trace file's recorded times), and the max-load search
    under the cell's shared SLO."""
    trace = None
    if args.rate is not None or (args.trace is not None and not args.max_load):
        trace = make_workload(args.workload, args.num_requests, args.rate, args.seed, args.arrival, args.cv)
    shared = shared_slo(entries, args)

    def outcome(entry: Entry) -> tuple[SimSummary | None, MaxLoad | None, str]:
        ran = run_entry(entry, args, trace, shared)
        return ran.summary, ran.max_load, ran.skipped

    done: list[Entry] = []
    for entry, (summary, max_load, skipped) in zip(entries, map_forked(outcome, entries, args.jobs), strict=True):
        ran = replace(entry, summary=summary, max_load=max_load, skipped=skipped)
        done.append(SeedRun(**{f: getattr(ran, f) for f in Entry.__dataclass_fields__}, shared=shared))
        if ran.max_load is not None:
            print(_describe_max_load(ran.max_load))
    if all(e.skipped for e in done):
        raise ValueError("no strategy could run: " + "; ".join(f"{e.spec}: {e.skipped}" for e in done))
    return done


def compare_main(argv: list[str]) -> int:
    p = build_compare_parser()
    args = p.parse_args(argv)
    if args.rate is None and not args.max_load and args.trace is None:
        p.error("give --rate, --max-load or both (or --trace alone: a run at the recorded times)")
    started = time.perf_counter()
    try:
        use_trace_file(args)
        specs = split_specs(args.strategies) if args.strategies else available_strategies()
        for spec in specs:
            check_spec(spec)
        if args.rate is not None and not args.rate > 0:
            raise ValueError(f"--rate must be > 0 requests/s, got {args.rate}")
        _slo(args)  # a bad SLO fails before any run
        check_max_load_args(args)
        if args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        shaper = Shaper(args)
        entries = prepare(args, specs, shaper)
        seeds = parse_seeds(args.seeds) if args.seeds else [args.seed]
        if args.tune:
            check_tune_args(args, seeds)
            entries = tune_entries(entries, args, shaper, _slo(args))
        _print_shapes({e.spec: e.setup for e in entries if e.setup is not None})
        docs, done = [], []
        for seed in seeds:
            args.seed = seed
            if len(seeds) > 1:
                print(f"seed {seed}:")
            done = run_seed(entries, args)
            docs.append(compare_doc(args, done, done_shared(done)))
        doc = docs[0] if len(seeds) == 1 else merge_seed_docs(seeds, docs)
        if len(seeds) == 1:
            doc["workload"]["seeds"] = seeds
        print(format_compare_table(done, doc))
        if args.json is not None:
            args.json.write_text(json.dumps(doc, indent=2) + "\n")
        if args.plot is not None:
            from .compare_plot import plot_compare

            shapes = {e.spec: short_shape(e.setup.shape) for e in done if e.setup is not None}
            unsaturated = frozenset(e.spec for e in done if e.max_load and e.max_load.rate and not e.max_load.saturated)
            plot_compare(doc, args.plot, compare_title(doc), shapes, unsaturated)
            print(f"plot: {args.plot}")
    except (ValueError, RuntimeError) as e:
        print(f"spindle sim compare: {e}", file=sys.stderr)
        return 2
    ran = sum(not e.skipped for e in done)
    print(f"{ran} strateg{'y' if ran == 1 else 'ies'} compared in {time.perf_counter() - started:.1f} s wall")
    return 0
