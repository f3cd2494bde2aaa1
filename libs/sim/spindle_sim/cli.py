"""`spindle sim`: one simulated run of a strategy on a workload, summary printed and written as JSON.
`spindle sim sweep`: strategies x request rates, a table, a PNG of the load curves and the max sustainable load.
The arguments, cluster and SLO every `spindle sim` command shares (`spindle sim compare`, compare.py, takes them from
here; commands.py dispatches the three)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, cast

from spindle_costmodel import MODELS, hardware_names
from spindle_costmodel.parallel import SP_KINDS
from spindle_policy.calibration import CALIBRATIONS, load_paper_calibration
from spindle_policy.core import SchedulerConfig
from spindle_policy.latency import LatencyModel
from spindle_policy.strategy import available_strategies, strategy_class

from .cluster import SimConfig
from .executor import simulate
from .loadsearch import MaxLoad, max_sustainable_load
from .metrics import Slo, format_plan_us, strict_json
from .named_cluster import DEFAULT_NODES, ClusterSpec, SimSetup, given_shape, named_cluster, reshaped
from .sweep import METRICS, PERCENTILES, SweepRow, format_table, rows_to_dicts, sweep
from .workloads import TRACE_PREFIX, make_workload, trace_file

# flags that only a named cluster takes
NAMED_ONLY = ("model", "nodes", "gpus_per_node", "prefill_tp", "sp_kind", "noise")
SPEC_HELP = (
    "A strategy spec is NAME or NAME:key=value,key=value (options are the strategy's, e.g. fixed-sp:sp=8, "
    "request-sp:max_sp=16, chunked:chunk_size=512)."
)


CLUSTER_HELP = (
    "The cluster: by default the instances below with latencies from published figures (--calibration); or "
    "from a profile of this machine (--profile); or a named cluster (--hardware, with --model, --nodes, "
    "--gpus-per-node, --prefill-tp, --decode-tp): latencies, KV capacity and KV size from the cost model, and "
    "the GPUs shaped as the strategy runs: a disaggregated strategy gets half of them (spindle: 4/5) as "
    "prefill instances of --prefill-tp GPUs and the rest as decode instances of --decode-tp GPUs, a colocated "
    "one (chunked) all of them as colocated instances of --decode-tp GPUs, unless --instances, "
    "--decode-instances or --colocated say otherwise. The default TP is the smallest power of two whose "
    "weight shard leaves >= 30 % of a GPU's memory for KV. Instances pack onto nodes in rank order and never "
    "straddle two."
)


def _add_run_args(p: argparse.ArgumentParser, num_requests: int) -> None:
    """Workload, cluster, latency source and SLO flags shared by `spindle sim`, `sim sweep` and `sim compare`."""
    p.add_argument("--workload", default="tetris-short", help="workload name (spindle_sim.workloads)")
    p.add_argument(
        "--trace",
        type=Path,
        metavar="FILE",
        help="replay a trace file instead of --workload: Mooncake / AIPerf JSONL (timestamp in ms, input_length, "
        "output_length, hash_ids), BurstGPT CSV, or Spindle's own JSONL / CSV (`spindle_sim.traces`). Its "
        "first --num-requests requests (the file repeated when shorter), at the recorded times, or scaled to a mean "
        "of --rate req/s (a max-load search scales it to each rate); --seed, --arrival and --cv do not apply",
    )
    p.add_argument("--arrival", default="poisson", choices=["poisson", "gamma"])
    p.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of gamma inter-arrivals")
    p.add_argument("--num-requests", type=int, default=num_requests)
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("cluster", CLUSTER_HELP)
    g.add_argument(
        "--instances", type=int, help="prefill instances (default 32, 0 with --colocated; named: half the GPUs)"
    )
    g.add_argument(
        "--decode-instances", type=int, help="decode instances (default 8, 0 with --colocated; named: the rest)"
    )
    g.add_argument(
        "--colocated",
        type=int,
        help="colocated instances that prefill and decode, for `chunked` (default 0; named: every GPU with chunked)",
    )
    g.add_argument(
        "--decode-tp",
        type=int,
        help="GPUs (TP size) of each decode or colocated instance (default 1; named: as --prefill-tp)",
    )
    g.add_argument(
        "--spp",
        type=int,
        help="sequence-pipeline stages of each colocated instance (Medha's SPP: the instance takes --decode-tp x "
        "--spp GPUs, holds KV on all of them, and a prompt's chunks pipeline over the stages; default 1)",
    )
    g.add_argument(
        "--sp-kind",
        choices=SP_KINDS,
        help="how a named cluster prices SP prefill groups: ring (pass KV), ulysses (all-to-all: SP-NTP) or sp-tp "
        "(CSPS's SP-TP: all-gather / reduce-scatter around tensor-parallel attention); default: the layout the "
        "strategy runs (all-to-all for csps, ring for the others)",
    )
    source = g.add_mutually_exclusive_group()
    source.add_argument("--profile", type=Path, help="profile JSON written by `spindle profile`")
    source.add_argument(
        "--calibration", choices=sorted(CALIBRATIONS), help="published figures (default: tetris-a100-llama3-8b)"
    )
    source.add_argument(
        "--hardware",
        help=f"a named cluster of this device type, from the cost model: {', '.join(hardware_names())}, or a "
        "`spindle profile` JSON (this machine's fitted device)",
    )
    g.add_argument(
        "--model", help=f"with --hardware: a preset ({', '.join(MODELS)}) or a config.json path (default llama3-8b)"
    )
    g.add_argument(
        "--nodes",
        type=int,
        help=f"with --hardware: nodes (default {DEFAULT_NODES}; just enough when the instance counts are all given)",
    )
    g.add_argument("--gpus-per-node", type=int, help="with --hardware: GPUs per node (default: the hardware's)")
    g.add_argument(
        "--noise",
        type=float,
        metavar="F",
        help="with --hardware: the run is charged the cost model's own prices and the strategies plan with forms "
        "fitted to it (Eq. 1, Eq. 7, the decode and mixed-batch steps); F > 0 fits them to a profile whose every "
        "sample is off by a factor exp(F x N(0, 1)) instead, as a profile measured on real GPUs would be (e.g. "
        "0.05). The prediction error of each run is reported (`prediction_error`)",
    )
    g.add_argument(
        "--prefill-tp",
        type=int,
        help="with --hardware: GPUs (TP size) of each prefill instance (default: the smallest power of two "
        "leaving >= 30 %% of a GPU's memory for KV)",
    )
    p.add_argument("--decode-step-s", type=float, default=0.02, help="decode step time when the model has none")
    p.add_argument(
        "--slo-ttft", type=float, help="SLO on TTFT (s) for goodput and SLO attainment (interactive requests only)"
    )
    p.add_argument(
        "--slo-tpot", type=float, help="SLO on TPOT (s/token) for goodput and SLO attainment (interactive requests)"
    )
    p.add_argument(
        "--slo-ttft-per-ktok",
        type=float,
        default=0.0,
        help="with --slo-ttft: seconds added to the TTFT limit per 1,000 prompt tokens (a length-scaled TTFT SLO; "
        "default 0)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spindle sim",
        description="Simulate a cluster running a Spindle strategy: the real scheduler core on a virtual clock, "
        "with latencies from a profile of this machine (`spindle profile`), from published figures, or from the "
        "cost model for a named cluster (--hardware; e.g. `spindle sim --model llama3-70b --hardware h100-sxm "
        "--nodes 4 --strategy request-sp`). "
        "For load curves over several rates and strategies, and the max sustainable load, see "
        "`spindle sim sweep --help`; for every strategy side by side on one trace and cluster (a table, a PNG, "
        "one JSON), `spindle sim compare --help`.",
        epilog=f"{SPEC_HELP} Known strategies: {', '.join(available_strategies())}.",
    )
    p.add_argument("--strategy", default="single", help="strategy spec (default: single), e.g. fixed-sp:sp=8")
    p.add_argument("--sp", type=int, help="strategy option sp (fixed-sp: SP group size)")
    p.add_argument("--max-sp", type=int, help="strategy option max_sp (request-sp: largest SP size)")
    p.add_argument("--chunk-size", type=int, help="strategy option chunk_size (chunked: tokens per chunk)")
    p.add_argument(
        "--rate",
        type=float,
        help="mean arrival rate, requests/s (inf: all at once); default 1, or a --trace file's recorded times",
    )
    _add_run_args(p, num_requests=1000)
    p.add_argument("--json", type=Path, help="write the summary (with the cluster's shape) here")
    p.add_argument(
        "--timeline",
        type=Path,
        metavar="PATH",
        help="write the run's timeline here as one HTML page (the gateway's /dashboard view): each instance's prefill "
        "chunks with their SP groups, decode batches, KV use and queues, and the strategy's decisions",
    )
    return p


def build_sweep_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spindle sim sweep",
        description="Run strategies over request rates on one workload (one trace per rate, the same requests "
        "for every rate and strategy), print a strategy x rate table, and optionally plot P50/P99 TTFT and TBT "
        "vs rate (--plot) and search each strategy's max sustainable load (--max-load): the highest rate whose "
        "latency metric stays under an SLO, by default 25x its light-load value (Tetris, LoongServe), or, with "
        "--max-load-attainment A, at which a share >= A of the interactive requests meet --slo-ttft/--slo-tpot "
        "(DistServe).",
        epilog=f"{SPEC_HELP} --strategies takes one spec per argument; an argument without ':' may also list "
        "several option-less names separated by commas. So `--strategies single,request-sp` and "
        "`--strategies fixed-sp:sp=16 fixed-sp:sp=8 request-sp` are both valid; a spec with options always "
        f"stands alone. Known strategies: {', '.join(available_strategies())}. Example: spindle sim sweep "
        "--strategies fixed-sp:sp=16 fixed-sp:sp=8 request-sp --workload tetris-medium --rates 0.5,1,2,4 "
        "--instances 32 --plot sweep.png --json sweep.json",
    )
    p.add_argument("--strategies", nargs="+", required=True, metavar="SPEC", help="strategy specs (see below)")
    p.add_argument(
        "--rates", nargs="+", metavar="R", help="request rates in req/s, comma- or space-separated: 0.5,1,2,4"
    )
    _add_run_args(p, num_requests=1000)
    p.add_argument("--plot", type=Path, help="write a PNG of P50/P99 TTFT and TBT vs rate here")
    p.add_argument(
        "--json",
        type=Path,
        help="write every run's summary, the max loads and the cluster (the first strategy's shape; "
        "by_strategy: each one's) here",
    )
    _add_max_load_args(p)
    return p


def _add_max_load_args(p: argparse.ArgumentParser) -> None:
    """The max-sustainable-load search flags shared by `spindle sim sweep` and `spindle sim compare`."""
    g = p.add_argument_group("max sustainable load")
    g.add_argument("--max-load", action="store_true", help="search each strategy's max sustainable load")
    g.add_argument("--metric", default="ttft", choices=METRICS, help="latency the SLO is on (default ttft)")
    g.add_argument("--percentile", default="p50", choices=PERCENTILES, help="its statistic (default p50)")
    g.add_argument(
        "--light-rate",
        type=float,
        help="light-load rate (default: halve from --start-rate until the metric stops falling by > 5%%)",
    )
    g.add_argument(
        "--start-rate", type=float, default=1.0, help="where the light-load (or attainment) search starts (req/s)"
    )
    g.add_argument("--slo-scale", type=float, default=25.0, help="SLO = this x the light-load metric (default 25)")
    g.add_argument("--max-load-slo", type=float, help="an absolute SLO in seconds instead, the same for every strategy")
    g.add_argument("--rel-tol", type=float, default=0.05, help="bisection stops at this relative rate gap")
    g.add_argument("--max-rate", type=float, default=1e4, help="highest rate probed (req/s)")
    g.add_argument(
        "--max-load-window",
        type=float,
        default=120.0,
        metavar="S",
        help="each probed rate R replays at least R x S requests (default 120: two minutes of offered load; 0: "
        "--num-requests at every rate), so that a short trace's burst does not pass for a sustainable load",
    )
    g.add_argument(
        "--max-load-attainment",
        type=float,
        metavar="A",
        help="DistServe's goodput rule instead of the latency one: a rate is under the SLO when a share >= A "
        "(0 < A <= 1) of the interactive requests meet --slo-ttft/--slo-tpot (one or both required; batch requests "
        "have no latency SLO) and none was rejected or failed. No light-load search: it starts at --start-rate "
        "(halving, at most 8 times, while that rate violates), then grows and bisects; --metric, --percentile "
        "and --slo-scale do not apply, --light-rate and --max-load-slo may not be given",
    )


def check_max_load_args(args: argparse.Namespace) -> None:
    """The max-load flags that cannot go together (ValueError)."""
    a = args.max_load_attainment
    if a is None:
        return
    if not args.max_load:
        raise ValueError("--max-load-attainment sets the rule of --max-load: give --max-load too")
    if not 0 < a <= 1:
        raise ValueError(f"--max-load-attainment must be in (0, 1], got {a}")
    if args.slo_ttft is None and args.slo_tpot is None:
        raise ValueError("--max-load-attainment needs the per-request SLO: give --slo-ttft and/or --slo-tpot")
    flags = (("--light-rate", args.light_rate), ("--max-load-slo", args.max_load_slo))
    if given := [flag for flag, value in flags if value is not None]:
        raise ValueError(f"{' and '.join(given)} belong to the latency rule, not to --max-load-attainment")


def use_trace_file(args: argparse.Namespace) -> None:
    """--trace FILE: the run's workload is `trace:FILE`, read now so a bad file fails before any run."""
    if args.trace is None:
        return
    trace = trace_file(str(args.trace))
    if not trace:
        raise ValueError(f"{args.trace}: the trace has no requests")
    args.workload = f"{TRACE_PREFIX}{args.trace}"


def rate_text(rate: float | None) -> str:
    return "the recorded rate" if rate is None else f"{rate:g} req/s"


def _trace_args(args: argparse.Namespace) -> dict[str, Any]:
    """The trace flags, as `sweep` and `max_sustainable_load` take them."""
    return {"num_requests": args.num_requests, "seed": args.seed, "arrival": args.arrival, "cv": args.cv}


def _max_load(
    spec: str, setup: SimSetup, args: argparse.Namespace, slo_s: float | None = None, light_rate: float | None = None
) -> MaxLoad:
    """`spec`'s max sustainable load on `setup`, the search as the max-load flags say (`slo_s`, `light_rate`: a
    comparison's shared SLO and this strategy's light rate, found already)."""
    return max_sustainable_load(
        spec,
        args.workload,
        setup.latency,
        setup.config,
        metric=args.metric,
        percentile=args.percentile,
        light_rate=args.light_rate if light_rate is None else light_rate,
        slo_scale=args.slo_scale,
        slo_s=args.max_load_slo if slo_s is None else slo_s,
        start_rate=args.start_rate,
        rel_tol=args.rel_tol,
        max_rate=args.max_rate,
        attainment=args.max_load_attainment,
        slo=_slo(args),
        min_window_s=args.max_load_window,
        **_trace_args(args),
    )


def _latency(args: argparse.Namespace) -> LatencyModel:
    if args.profile is not None:
        from spindle_policy.profile_data import load_profile

        return load_profile(args.profile)
    return load_paper_calibration(key=args.calibration or "tetris-a100-llama3-8b")


def _sim_options(args: argparse.Namespace) -> dict[str, Any]:
    """SimConfig fields that do not depend on the cluster."""
    return {
        "decode_step_s": args.decode_step_s,
        "scheduler": SchedulerConfig(max_num_requests=max(args.num_requests, 1)),
    }


def _sim_config(args: argparse.Namespace) -> SimConfig:
    """The cluster given as instance counts (no --hardware)."""
    default_prefill, default_decode = (0, 0) if args.colocated else (32, 8)
    return SimConfig(
        num_prefill=default_prefill if args.instances is None else args.instances,
        num_decode=default_decode if args.decode_instances is None else args.decode_instances,
        num_colocated=args.colocated or 0,
        decode_tp=args.decode_tp or 1,
        colocated_tp=args.decode_tp or 1,
        colocated_spp=args.spp or 1,
        **_sim_options(args),
    )


def _cluster_spec(args: argparse.Namespace) -> ClusterSpec | None:
    """The named cluster (--hardware), or None; its other flags without --hardware are an error."""
    if args.hardware is None:
        given = [f"--{k.replace('_', '-')}" for k in NAMED_ONLY if getattr(args, k) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only apply to a named cluster: give --hardware too")
        return None
    return ClusterSpec(
        hardware=args.hardware,
        model=args.model or "llama3-8b",
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        num_prefill=args.instances,
        num_decode=args.decode_instances,
        num_colocated=args.colocated,
        spp=args.spp,
        sp_kind=args.sp_kind or "ring",  # each strategy's own unless given (setups)
        noise=args.noise or 0.0,
    )


def setups(args: argparse.Namespace, specs: list[str]) -> dict[str, SimSetup]:
    """Each strategy's cluster shape, latency model and config: on a named cluster, the GPUs shaped as it runs
    (one build per shape); otherwise the same instances and latency source for all."""
    cluster = _cluster_spec(args)
    if (args.spp or 1) > 1 and len(specs) == 1 and not strategy_class(specs[0]).keeps_kv_in_place:
        raise ValueError(f"--spp shapes pipeline replicas for strategies that keep a request's KV on one colocated "
                         f"instance (chunked, medha), not {specs[0]}")  # fmt: skip
    if cluster is None:  # the given instances; their GPUs reshaped for a strategy they do not suit
        config = _sim_config(args)
        setup = SimSetup(given_shape(config), _latency(args), config)
        return {
            spec: reshaped(setup, strategy_class(spec).colocated, strategy_class(spec).keeps_kv_in_place)
            for spec in specs
        }
    built: dict[tuple[bool, bool, bool, str, bool, float, bool], SimSetup] = {}
    out = {}
    for spec in specs:
        cls = strategy_class(spec)
        sp_kind = args.sp_kind or cls.sp_kind
        kind = (
            cls.colocated, cls.elastic, cls.keeps_kv_in_place, sp_kind, cls.reshards, cls.prefill_share,
            cls.splits_context,
        )  # fmt: skip
        if kind not in built:  # a pipeline (--spp) only for the strategies that can run on one
            shaped = replace(
                cluster, spp=cluster.spp if cls.keeps_kv_in_place else None, sp_kind=sp_kind,
                prefill_share=cls.prefill_share,
            )  # fmt: skip
            built[kind] = named_cluster(
                shaped, cls.colocated, cls.elastic, cls.reshards, cls.splits_context, **_sim_options(args)
            )
        out[spec] = built[kind]
    return out


def _slo(args: argparse.Namespace) -> Slo | None:
    if args.slo_ttft is None and args.slo_tpot is None:
        if args.slo_ttft_per_ktok:
            raise ValueError("--slo-ttft-per-ktok needs --slo-ttft (the base TTFT limit)")
        return None
    return Slo(args.slo_ttft, args.slo_tpot, args.slo_ttft_per_ktok)


def _strategy_spec(args: argparse.Namespace) -> str:
    """--strategy plus the option flags given: `--strategy fixed-sp --sp 8` -> "fixed-sp:sp=8"."""
    flags = (("sp", args.sp), ("max_sp", args.max_sp), ("chunk_size", args.chunk_size))
    given = [f"{k}={v}" for k, v in flags if v is not None]
    spec = args.strategy.strip()
    if not given:
        return spec
    return f"{spec},{','.join(given)}" if ":" in spec else f"{spec}:{','.join(given)}"


def split_specs(items: list[str]) -> list[str]:
    """`--strategies` arguments -> specs: an argument with ':' is one spec, one without may list names a,b,c."""
    specs: list[str] = []
    for item in items:
        parts = [item.strip()] if ":" in item else [s.strip() for s in item.split(",")]
        specs += [s for s in parts if s]
    if not specs:
        raise ValueError("--strategies: no strategy given")
    if len(set(specs)) != len(specs):
        raise ValueError(f"--strategies: a strategy is listed twice in {specs}")
    return specs


def parse_rates(items: list[str]) -> list[float]:
    try:
        return [float(x) for item in items for x in item.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"--rates: {e}") from None


def cluster_dict(by_spec: dict[str, SimSetup]) -> dict[str, Any]:
    """The sweep JSON's cluster: the first strategy's shape, and under by_strategy each one's."""
    first = next(iter(by_spec.values())).shape.as_dict()
    return first | {"by_strategy": {spec: s.shape.as_dict() for spec, s in by_spec.items()}}


def tier_text(t: dict[str, float]) -> str:
    """Re-shards and host-tier swaps of a run (tier_side.py), in one line."""

    def hidden(way: str) -> float:
        return 100 * t.get(f"{way}_hidden_s", 0.0) / t[f"{way}_s"] if t.get(f"{way}_s") else 0.0

    return (
        f"re-shards {int(t.get('reshards', 0))} ({t.get('reshard_s', 0.0):.2f} s); swapped out "
        f"{int(t.get('swap_out_tokens', 0))} tokens ({hidden('swap_out'):.0f} % hidden), onboarded "
        f"{int(t.get('swap_in_tokens', 0))} ({hidden('swap_in'):.0f} % hidden)"
    )


def _print_shapes(by_spec: dict[str, SimSetup]) -> None:
    texts: dict[str, list[str]] = {}
    for spec, s in by_spec.items():
        texts.setdefault(s.shape.text, []).append(spec)
    for text, specs in texts.items():
        print(f"cluster: {text}" + (f" [{', '.join(specs)}]" if len(texts) > 1 else ""))


def run_main(argv: list[str]) -> int:
    """`spindle sim`: one run."""
    args = build_parser().parse_args(argv)
    try:
        use_trace_file(args)
        if args.rate is None and args.trace is None:
            args.rate = 1.0
        if args.rate is not None and not args.rate > 0:
            raise ValueError(f"--rate must be > 0 requests/s, got {args.rate}")
        spec = _strategy_spec(args)
        setup = setups(args, [spec])[spec]
        trace = make_workload(args.workload, args.num_requests, args.rate, args.seed, args.arrival, args.cv)
        if args.timeline is None:
            result = simulate(trace, spec, setup.latency, setup.config)
        else:
            from .timeline import run_recorded

            title = f"spindle sim: {spec} on {args.workload} at {rate_text(args.rate)} ({setup.shape.text})"
            result = run_recorded(trace, spec, setup.latency, setup.config, args.timeline, title)
        summary = result.summary(args.workload, args.rate, _slo(args))
    except ValueError as e:
        print(f"spindle sim: {e}", file=sys.stderr)
        return 2
    d = cast(dict[str, Any], strict_json(summary.to_dict() | {"cluster": setup.shape.as_dict()}))
    if result.tier:
        d["tier"] = result.tier
    if args.json is not None:
        args.json.write_text(json.dumps(d, indent=2) + "\n")
    print(f"cluster: {setup.shape.text}")
    print(f"{spec} on {args.workload} at {rate_text(args.rate)}: {d['completed']}/{d['num_requests']} completed")
    for key in ("ttft_s", "tbt_s", "e2e_s"):
        s = d[key]
        print(f"  {key:7s} mean {_f(s['mean'])}  p50 {_f(s['p50'])}  p90 {_f(s['p90'])}  p99 {_f(s['p99'])}")
    norm = [d[k]["mean"] for k in ("normalized_input_latency_s", "normalized_output_latency_s")]
    print(f"  normalised latency (mean s/token): input {_f(norm[0], 6)}  output {_f(norm[1], 6)}")
    print(f"  throughput {d['throughput_tok_s']:.1f} tok/s ({result.events} events, {result.wall_s:.2f} s wall)")
    print(f"  plan() per request: {format_plan_us(d['plan_us'])} ({len(result.plan_ns)} calls)")
    if t := result.tier:
        print(f"  {tier_text(t)}")
    if args.timeline is not None:
        print(f"  timeline: {args.timeline}")
    if summary.slo is not None:
        print(
            f"  goodput {d['goodput_req_s']:.3f} req/s, {d['goodput_tok_s']:.1f} tok/s; "
            f"SLO attainment {100 * d['slo_attainment']:.1f} % (interactive requests)"
        )
    if summary.num_batch:
        jct = "did not finish" if d["batch_jct_s"] is None else f"completed in {d['batch_jct_s']:.1f} s"
        print(f"  batch job: {summary.num_batch} requests, {jct}")
    return 0


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _describe_max_load(m: MaxLoad) -> str:
    metric = m.metric.replace("_", " ").upper()
    head = f"{m.strategy}: "
    slo = f"{metric} SLO {m.slo_s:.3g} s (light load {m.light_value:.3g} s at {m.light_rate:.3g} req/s)"
    if m.attainment is not None:
        slo = f"SLO attainment >= {100 * m.attainment:g} % ({(m.slo or Slo()).describe()})"
        if m.rate is None:
            return head + f"violates the SLO even at {m.next_rate:.3g} req/s; {slo}"
    if m.rate is None:
        return head + f"violates the SLO even at light load; {slo}"
    if m.next_rate is None:
        return head + f">= {m.rate:.3g} req/s (never violated up to the highest rate probed); {slo}"
    return head + f"max sustainable load {m.rate:.3g} req/s ({m.next_rate:.3g} violates); {slo}"


def sweep_main(argv: list[str]) -> int:
    p = build_sweep_parser()
    args = p.parse_args(argv)
    if args.rates is None and not args.max_load:
        p.error("give --rates, --max-load or both")
    if args.plot is not None and args.rates is None:
        p.error("--plot needs --rates")
    rows: list[SweepRow] = []
    loads: list[MaxLoad] = []
    try:
        use_trace_file(args)
        check_max_load_args(args)
        specs = split_specs(args.strategies)
        by_spec = setups(args, specs)
        _print_shapes(by_spec)
        if args.rates is not None:
            rates = parse_rates(args.rates)
            for spec, s in by_spec.items():
                rows += sweep([spec], rates, args.workload, s.latency, s.config, slo=_slo(args), **_trace_args(args))
            print(format_table(rows))
        if args.max_load:
            for spec, s in by_spec.items():
                loads.append(_max_load(spec, s, args))
                print(_describe_max_load(loads[-1]))
        if args.plot is not None:
            from .plot import plot_sweep, sweep_title

            config = next(iter(by_spec.values())).config
            plot_sweep(rows, args.plot, sweep_title(args.workload, config, args.num_requests))
            print(f"plot: {args.plot}")
    except (ValueError, RuntimeError) as e:
        print(f"spindle sim sweep: {e}", file=sys.stderr)
        return 2
    if args.json is not None:
        slo = _slo(args)
        doc = {
            "workload": args.workload,
            "num_requests": args.num_requests,
            "seed": args.seed,
            "cluster": cluster_dict(by_spec),
            "slo": None if slo is None else asdict(slo),
            "rows": rows_to_dicts(rows),
            "max_load": [strict_json({**asdict(m), "saturated": m.saturated}) for m in loads],
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0
