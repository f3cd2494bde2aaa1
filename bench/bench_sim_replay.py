"""Real vs simulated: one small trace through the real stack and through the simulator, TTFT/E2E compared.

1. A seeded trace: --num-requests short requests (lognormal prompt lengths in --prompt-lens, outputs in
   --output-lens, min/max at the 0.1 %/99.9 % quantiles), Poisson arrivals at --rate.
2. A profile of this machine with the real profiler (`spindle_launcher.profile.run_profile`) on a small grid
   covering those lengths (or --profile FILE, written by `spindle profile` or an earlier run).
3. The real stack (started here unless --url: 2 prefill + 1 decode, strategy single): a few untimed warm-up
   requests, then the trace replayed through the gateway by the load generator (serve_trace.run_trace).
4. The simulator (`spindle_sim.simulate`, strategy single) on the same trace with the profile's
   latency model and the real instances' KV capacities (read from /v1/spindle/instances).
5. A table of measured vs simulated TTFT and E2E (P50, P90, mean) and the relative error, written as JSON.

The sequential warm-up requests also measure the stack's fixed TTFT overhead at idle (their TTFT minus the
profile's prefill prediction); "sim + overhead" adds it to every simulated TTFT and E2E, to show how much of
the gap a constant per-request overhead in the simulator would close. It is not fitted to the replay.

    python bench/bench_sim_replay.py                       # writes bench/results/sim_replay.json
    python bench/bench_sim_replay.py --num-requests 40 --rate 3 --profile bench/results/sim_replay_profile.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as the engine services set it (see bench_serve.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import numpy as np
from bench_engine import machine_info, write_json
from serve_client import make_client, stream_completion
from serve_trace import length_mismatches, request_rows, run_trace, trace_prompts

from spindle_launcher.plan import StackConfig
from spindle_launcher.profile import ProfileConfig, run_profile
from spindle_launcher.stack import Stack
from spindle_policy.core import SchedulerConfig
from spindle_policy.latency import LatencyModel
from spindle_policy.profile_data import load_profile, write_profile
from spindle_sim import SimConfig, simulate
from spindle_sim.traces import write_csv
from spindle_sim.workloads import Independent, LogNormal, TraceRequest, make_workload

log = logging.getLogger("bench.sim_replay")

ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = ROOT / "results" / "sim_replay.json"
DTYPES = ("bfloat16", "float16", "float32")
WARMUP_LENS = (32, 64, 128, 256)  # sequential untimed requests (also the idle-overhead sample)


def _pair(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI, got {text!r}") from None
    if not 1 <= lo < hi:
        raise argparse.ArgumentTypeError(f"need 1 <= LO < HI, got {text!r}")
    return lo, hi


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    description, _, examples = __doc__.partition("\n\n    python")
    p = argparse.ArgumentParser(
        description=description,
        epilog="examples:\n    python" + examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--num-requests", type=int, default=20, help="default: %(default)s")
    p.add_argument("--rate", type=float, default=1.5, help="Poisson arrival rate, requests/s (default: %(default)s)")
    p.add_argument("--prompt-lens", type=_pair, default=(32, 256), help="prompt length range (default: 32,256)")
    p.add_argument("--output-lens", type=_pair, default=(8, 32), help="output length range (default: 8,32)")
    p.add_argument("--seed", type=int, default=0, help="trace and prompt seed (default: 0)")
    p.add_argument("--url", help="gateway of a running stack (default: start one)")
    p.add_argument("--model", default="smollm2", help="model of the started stack and the profile")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--prefill", type=int, default=2, help="prefill instances of the started stack (default: 2)")
    p.add_argument("--decode", type=int, default=1, help="decode instances of the started stack (default: 1)")
    p.add_argument("--max-model-len", type=int, default=1024, help="of the started stack (default: %(default)s)")
    p.add_argument("--kv-cache-tokens", type=int, default=8192, help="of the started stack (default: %(default)s)")
    p.add_argument(
        "--engine-threads",
        type=int,
        default=1,
        help="torch threads of each engine process of the started stack (OMP_NUM_THREADS) and of the profile; "
        "1 keeps 3 engines on 2 cores from oversubscribing (default: %(default)s)",
    )
    p.add_argument("--profile", type=Path, help="use this profile JSON instead of measuring one")
    p.add_argument("--profile-out", type=Path, help="write the measured profile here")
    p.add_argument("--profile-repeats", type=int, default=3, help="prefill repeats of the profile (default: 3)")
    p.add_argument("--no-transfer", action="store_true", help="profile without the gloo transfer benchmark")
    p.add_argument("--log-dir", type=Path, help="service logs of the started stack (default: a temp dir)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default: {DEFAULT_OUT})")
    args = p.parse_args(argv)
    if args.num_requests < 1 or not args.rate > 0 or args.engine_threads < 1:
        p.error("--num-requests and --engine-threads must be >= 1 and --rate > 0")
    if args.prompt_lens[1] + args.output_lens[1] > args.max_model_len:
        p.error("--max-model-len must hold the longest prompt + output")
    return args


# ----------------------------------------------------------------------------------------------- pieces


def build_trace(n: int, rate: float, prompt_lens: tuple[int, int], output_lens: tuple[int, int], seed: int) -> list:
    workload = Independent(LogNormal.from_range(*prompt_lens), LogNormal.from_range(*output_lens))
    return make_workload(workload, n, rate, seed)


def profile_config(args: argparse.Namespace) -> ProfileConfig:
    """A grid over the trace's prompt lengths and the decode batches a few requests make."""
    lo, hi = args.prompt_lens
    chunks = tuple(sorted({max(lo // 2, 1), lo, (lo + hi) // 2, hi}))
    return ProfileConfig(
        model=args.model,
        dtype=args.dtype,
        histories=(0, hi),
        chunks=chunks,
        decode_batches=(1, 2, 4, 8),
        decode_kv_tokens=(lo, hi),
        transfer_bytes=(2**14, 2**18, 2**22, 2**24),
        repeats=args.profile_repeats,
        transfer=not args.no_transfer,
    )


def kv_bytes_per_token(model: str, dtype: str) -> int:
    """K and V of every layer: 2 x layers x KV heads x head dim x dtype bytes (smollm2 fp32: 46,080)."""
    import torch

    from spindle_engine.kv_cache import KVCache
    from spindle_model import resolve_model

    c = resolve_model(model, progress=False).config
    return KVCache.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, getattr(torch, dtype))


def instance_capacities(url: str) -> dict[str, list[int]]:
    """role -> KV blocks of each live instance, as the instances report them."""
    r = httpx.get(url + "/v1/spindle/instances", timeout=10, trust_env=False)
    r.raise_for_status()
    out: dict[str, list[int]] = {}
    for inst in r.json()["instances"]:
        if "error" in inst:
            raise RuntimeError(f"instance {inst['instance_id']} did not answer: {inst['error']}")
        out.setdefault(inst["role"], []).append(int(inst["kv_blocks_total"]))
    return out


async def warm_up(url: str, model: str, seed: int) -> list[tuple[int, float]]:
    """Concurrent requests (every instance runs once), then sequential ones: [(prompt tokens, TTFT s)]."""
    api = url + "/v1/completions"
    prompts = trace_prompts([TraceRequest(0.0, n, 2) for n in WARMUP_LENS], seed + 1000)
    async with make_client(120.0) as client:
        together = await asyncio.gather(*(stream_completion(client, api, model, p, 4) for p in prompts * 2))
        alone = [await stream_completion(client, api, model, p, 2) for p in prompts for _ in range(2)]
    failed = [r.error for r in [*together, *alone] if not r.success]
    if failed:
        raise RuntimeError(f"warm-up request failed: {failed[0]}")
    return [(r.prompt_len, r.ttft) for r in alone]


async def replay(url: str, model: str, trace: list[TraceRequest], seed: int) -> dict[str, Any]:
    async with make_client(600.0) as client:
        results, duration, start = await run_trace(client, url + "/v1/completions", model, trace, seed)
    rows = request_rows(trace, results, start)
    return {"duration_s": duration, "requests": rows, "length_mismatches": length_mismatches(rows)}


def simulate_trace(
    trace: list[TraceRequest], latency: LatencyModel, caps: dict[str, list[int]], kv_bytes: int, max_model_len: int
) -> list[dict[str, Any]]:
    cfg = SimConfig(
        num_prefill=len(caps["prefill"]),
        num_decode=len(caps["decode"]),
        block_size=16,  # the engine's (EngineConfig.block_size; the services have no flag for it)
        prefill_kv_blocks=min(caps["prefill"]),
        decode_kv_blocks=min(caps["decode"]),
        kv_bytes_per_token=kv_bytes,
        max_model_len=max_model_len,
        scheduler=SchedulerConfig(max_num_requests=max(len(trace), 1)),
    )
    result = simulate(trace, "single", latency, cfg)
    return [
        {
            "state": r.state,
            "ttft": r.ttft,
            "e2e": r.e2e,
            "prefill_s": None if r.prefill_end is None else r.prefill_end - r.prefill_start,
            "queue_s": None if r.prefill_start is None else r.prefill_start - r.arrived_at,
            "token_times": [t - r.arrived_at for t in r.token_times],
        }
        for r in sorted(result.records, key=lambda r: int(r.request_id.rsplit("-", 1)[1]))
    ]


# ----------------------------------------------------------------------------------------------- comparison


def _stats(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)), "mean": float(a.mean())}


def compare(measured: list[dict], simulated: list[dict], overhead_s: float) -> dict[str, Any]:
    """Per metric and statistic: measured, simulated, relative error (sim / measured - 1), and the same with
    the idle overhead added to the simulation."""
    out: dict[str, Any] = {}
    for metric in ("ttft", "e2e"):
        m = _stats([r[metric] for r in measured if r["success"]])
        s = _stats([r[metric] for r in simulated if r["state"] == "finished"])
        so = _stats([r[metric] + overhead_s for r in simulated if r["state"] == "finished"])
        out[metric] = {
            k: {
                "measured_s": m[k],
                "simulated_s": s[k],
                "rel_error": s[k] / m[k] - 1,
                "simulated_plus_overhead_s": so[k],
                "rel_error_plus_overhead": so[k] / m[k] - 1,
            }
            for k in m
        }
    return out


def format_table(cmp: dict[str, Any]) -> str:
    rows = [("metric", "measured", "simulated", "error", "sim+overhead", "error")]
    for metric, by_stat in cmp.items():
        for stat, v in by_stat.items():
            rows.append(
                (
                    f"{metric.upper()} {stat}",
                    f"{v['measured_s'] * 1e3:.0f} ms",
                    f"{v['simulated_s'] * 1e3:.0f} ms",
                    f"{v['rel_error']:+.0%}",
                    f"{v['simulated_plus_overhead_s'] * 1e3:.0f} ms",
                    f"{v['rel_error_plus_overhead']:+.0%}",
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- main


def run(args: argparse.Namespace, url: str | None = None) -> dict[str, Any]:
    """The whole comparison against `url` (or a stack started here); returns the result document."""
    t0 = time.perf_counter()
    trace = build_trace(args.num_requests, args.rate, args.prompt_lens, args.output_lens, args.seed)
    profile_doc: dict[str, Any] | None = None
    if args.profile is not None:
        latency = load_profile(args.profile)
    else:
        log.info("profiling this machine with %d threads (%s)", args.engine_threads, profile_config(args))
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(args.engine_threads)
        try:
            profile_doc = run_profile(profile_config(args), progress=False)
        finally:
            torch.set_num_threads(threads)
        latency = LatencyModel.from_json(json.dumps(profile_doc["model"]))
        if args.profile_out is not None:
            write_profile(profile_doc, args.profile_out)
    t_profile = time.perf_counter() - t0
    stack = None
    try:
        if url is None:
            log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="spindle-sim-replay-"))
            config = StackConfig(
                model=args.model,
                dtype=args.dtype,
                prefill=args.prefill,
                decode=args.decode,
                port=0,
                max_model_len=args.max_model_len,
                kv_cache_tokens=args.kv_cache_tokens,
                kvstore_memory_gb=0.5,
                log_dir=str(log_dir),
                env={"OMP_NUM_THREADS": str(args.engine_threads)},
            )
            log.info("starting the stack; service logs in %s", log_dir)
            stack = Stack(config).start()
            url = stack.url
        caps = instance_capacities(url)
        model = args.model
        warm = asyncio.run(warm_up(url, model, args.seed))
        log.info("replaying %d requests at %s", len(trace), url)
        measured = asyncio.run(replay(url, model, trace, args.seed))
    finally:
        if stack is not None:
            stack.stop()
    assert latency.prefill is not None
    idle = [ttft - latency.prefill.predict(1, 0, n) for n, ttft in warm]
    overhead_s = statistics.median(idle)
    kv_bytes = kv_bytes_per_token(args.model, args.dtype)
    simulated = simulate_trace(trace, latency, caps, kv_bytes, args.max_model_len)
    return {
        "machine": machine_info() | {"load_average_1m": os.getloadavg()[0]},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not k.startswith("_")},
        "trace": [vars(r) for r in trace],
        "instances_kv_blocks": caps,
        "kv_bytes_per_token": kv_bytes,
        "profile": {
            "source": str(args.profile) if args.profile else "measured",
            "fit_error": profile_doc["fit_error"] if profile_doc else None,
            "wall_s": t_profile,
            "model": json.loads(latency.to_json()),
        },
        "idle_overhead": {"ttft_minus_predicted_prefill_s": idle, "median_s": overhead_s},
        "measured": measured,
        "simulated": simulated,
        "comparison": compare(measured["requests"], simulated, overhead_s),
        "completed": {
            "measured": sum(r["success"] for r in measured["requests"]),
            "simulated": sum(r["state"] == "finished" for r in simulated),
            "total": len(trace),
        },
        "wall_s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    doc = run(args, args.url.rstrip("/") if args.url else None)
    write_json(args.out, doc)
    write_csv(args.out.with_suffix(".trace.csv"), [TraceRequest(**r) for r in doc["trace"]])
    c = doc["completed"]
    print(
        f"\n{c['total']} requests ({args.prompt_lens[0]}-{args.prompt_lens[1]} prompt, "
        f"{args.output_lens[0]}-{args.output_lens[1]} output tokens) at {args.rate:g} req/s, strategy single; "
        f"completed: {c['measured']} measured, {c['simulated']} simulated"
    )
    print(f"profile: {doc['profile']['source']}, fit error {doc['profile']['fit_error']}")
    print(
        "idle TTFT overhead of the stack (warm-up TTFT - predicted prefill): "
        f"{doc['idle_overhead']['median_s'] * 1e3:.1f} ms"
    )
    print(format_table(doc["comparison"]))
    for line in doc["measured"]["length_mismatches"][:5]:
        print(f"length mismatch: {line}")
    return 0 if c["measured"] == c["simulated"] == c["total"] else 1


if __name__ == "__main__":
    sys.exit(main())
