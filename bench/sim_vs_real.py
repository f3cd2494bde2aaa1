"""Check the judge: one trace through the real stack on this machine and through `spindle sim`, per strategy.

For each strategy (`--strategies`) a stack is started here in a layout it runs on (below), a few untimed requests
warm it up, and the trace is replayed through the gateway at its arrival times (`serve_trace.run_trace`: token-id
prompts of exact lengths, `ignore_eos`, exact output lengths). The same trace then runs in the simulator with this
machine's profile (`--profile`, default bench/results/sim_vs_real_profile.json: `spindle profile` with one torch
thread, as the engines run here, SP sizes 1 and 2) on the instances the stack reported (their roles and KV blocks),
with the same strategy. Per strategy it prints real and simulated P50 / P90 TTFT, P50 / P90 TPOT and output
throughput, and the error (sim - real) / real, and writes `{"strategies": {S: {"real": {...}, "sim": {...},
"error": {...}}}}` (keys ttft_p50, ttft_p90, tpot_p50, tpot_p90, throughput_tok_s) with the trace, the layouts and
the machine. `--profile-now` profiles the machine first, in the same run (a profile taken at another time can be
off by tens of percent on a shared machine); by hand:

    OMP_NUM_THREADS=1 .venv/bin/spindle profile --out bench/results/sim_vs_real_profile.json --sp-sizes 1,2 \
        --histories 0,256,512 --chunks 32,128,256,512 --decode-batches 1,2,4,8 --decode-kv-tokens 64,256,512

    .venv/bin/python bench/sim_vs_real.py                                   # single and chunked, 24 requests
    .venv/bin/python bench/sim_vs_real.py --strategies single chunked fixed-sp:sp=2 loongserve --requests 30

Layouts (SmolLM2 on 2 cores, one torch thread per engine): single, fixed-sp, request-sp, tetris, spindle, csps:
2 prefill + 1 decode; chunked, medha: 1 elastic instance; loongserve: 2 elastic instances. Every process shares the
two cores, which a GPU cluster's instances do not: the simulator prices each instance as if it had the machine to
itself (the profile's numbers), so contention between processes is one cause of error the table shows.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as the engine services set it (see bench_serve.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
from bench_engine import machine_info, write_json
from bench_sim_replay import build_trace, instance_capacities, kv_bytes_per_token, replay, warm_up
from tqdm import tqdm

from spindle_launcher.plan import StackConfig
from spindle_launcher.stack import Stack
from spindle_policy.core import SchedulerConfig
from spindle_policy.profile_data import load_profile
from spindle_policy.strategy import parse_strategy_spec
from spindle_sim import SimConfig, simulate
from spindle_sim.workloads import TraceRequest

log = logging.getLogger("bench.sim_vs_real")
ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = ROOT / "results" / "sim_vs_real.json"
DEFAULT_PROFILE = ROOT / "results" / "sim_vs_real_profile.json"
SPLIT = {"prefill": 2, "decode": 1, "elastic": 0}
LAYOUTS = {
    "single": SPLIT, "fixed-sp": SPLIT, "request-sp": SPLIT, "tetris": SPLIT, "spindle": SPLIT, "csps": SPLIT,
    "chunked": {"prefill": 0, "decode": 0, "elastic": 1}, "medha": {"prefill": 0, "decode": 0, "elastic": 1},
    "loongserve": {"prefill": 0, "decode": 0, "elastic": 2},
}  # fmt: skip
KEYS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "throughput_tok_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--strategies",
        nargs="+",
        default=["single", "chunked"],
        metavar="S",
        help=f"strategy specs whose name has a layout here ({', '.join(LAYOUTS)}); default single chunked",
    )
    p.add_argument("--requests", type=int, default=24, help="requests in the trace (default: %(default)s)")
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate, req/s (default: %(default)s)")
    p.add_argument("--prompt-lens", default="64,512", help="prompt length range LO,HI (default: %(default)s)")
    p.add_argument("--output-lens", default="8,48", help="output length range LO,HI (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="trace and prompt seed (default: %(default)s)")
    p.add_argument("--profile", type=Path, default=DEFAULT_PROFILE, help="this machine's `spindle profile` JSON")
    p.add_argument(
        "--profile-now", action="store_true",
        help="profile this machine first, in the same run (~1.5 min), into --profile: a profile taken at another time "
        "can be off by tens of percent on a shared machine",
    )  # fmt: skip
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-tokens", type=int, default=8192)
    p.add_argument("--engine-threads", type=int, default=1, help="OMP_NUM_THREADS of each engine (default: 1)")
    p.add_argument("--log-dir", type=Path, help="service logs (default: a temp dir)")
    p.add_argument("--json", type=Path, default=DEFAULT_OUT, help=f"the result (default: {DEFAULT_OUT})")
    args = p.parse_args(argv)
    for spec in args.strategies:
        if parse_strategy_spec(spec)[0] not in LAYOUTS:
            p.error(f"no layout here for {spec!r}; known: {', '.join(LAYOUTS)}")
    try:
        args.prompt_lens = tuple(int(x) for x in args.prompt_lens.split(","))
        args.output_lens = tuple(int(x) for x in args.output_lens.split(","))
    except ValueError:
        p.error("--prompt-lens and --output-lens take LO,HI")
    if args.requests < 2 or not args.rate > 0:
        p.error("--requests must be >= 2 and --rate > 0")
    return args


def _metrics(ttfts: list[float], tpots: list[float], tokens: int, span: float) -> dict[str, float]:
    return {
        "ttft_p50": float(np.percentile(ttfts, 50)), "ttft_p90": float(np.percentile(ttfts, 90)),
        "tpot_p50": float(np.percentile(tpots, 50)) if tpots else float("nan"),
        "tpot_p90": float(np.percentile(tpots, 90)) if tpots else float("nan"),
        "throughput_tok_s": tokens / span if span > 0 else float("nan"),
    }  # fmt: skip


def real_metrics(rows: list[dict[str, Any]], trace: list[TraceRequest]) -> dict[str, float]:
    ok = [(r, t) for r, t in zip(rows, trace, strict=True) if r["success"]]
    ttfts = [r["ttft"] for r, _ in ok]
    tpots = [(r["e2e"] - r["ttft"]) / (t.num_decode_tokens - 1) for r, t in ok if t.num_decode_tokens > 1]
    end = max(r["sent_at"] + r["e2e"] for r, _ in ok)
    return _metrics(ttfts, tpots, sum(t.num_decode_tokens for _, t in ok), end - min(r["sent_at"] for r, _ in ok))


def sim_run(spec: str, trace: list[TraceRequest], profile: Path, caps: dict[str, list[int]], kv_bytes: int,
            max_model_len: int) -> dict[str, float]:  # fmt: skip
    latency = load_profile(profile)
    config = SimConfig(
        num_prefill=len(caps.get("prefill", [])), num_decode=len(caps.get("decode", [])),
        num_colocated=len(caps.get("elastic", [])), block_size=16,
        prefill_kv_blocks=min(caps.get("prefill", [1])), decode_kv_blocks=min(caps.get("decode", caps.get("elastic"))),
        kv_bytes_per_token=kv_bytes, max_model_len=max_model_len,
        scheduler=SchedulerConfig(max_num_requests=len(trace)),
    )  # fmt: skip
    records = simulate(trace, spec, latency, config).records
    done = [r for r in records if r.state == "finished"]
    tpots = [(r.e2e - r.ttft) / (r.num_decode_tokens - 1) for r in done if r.num_decode_tokens > 1]
    end = max(r.finished_at for r in done)
    tokens = sum(r.num_decode_tokens for r in done)
    return _metrics([r.ttft for r in done], tpots, tokens, end - min(r.arrived_at for r in done))


def run_strategy(spec: str, args: argparse.Namespace, trace: list[TraceRequest], log_dir: Path) -> dict[str, Any]:
    layout = LAYOUTS[parse_strategy_spec(spec)[0]]
    config = StackConfig(
        model=args.model, dtype="float32", port=0, strategy=spec, profile=str(args.profile),
        max_model_len=args.max_model_len, kv_cache_tokens=args.kv_cache_tokens, kvstore_memory_gb=0.5,
        log_dir=str(log_dir / spec.replace(":", "_").replace(",", "_")),
        env={"OMP_NUM_THREADS": str(args.engine_threads)}, **layout,
    )  # fmt: skip
    stack = Stack(config).start()
    try:
        caps = instance_capacities(stack.url)
        asyncio.run(warm_up(stack.url, args.model, args.seed))
        measured = asyncio.run(replay(stack.url, args.model, trace, args.seed))
    finally:
        stack.stop()
    rows = measured["requests"]
    failed = [r for r in rows if not r["success"]]
    if failed:
        raise RuntimeError(f"{spec}: {len(failed)} request(s) failed on the stack: {failed[0].get('error')}")
    real = real_metrics(rows, trace)
    sim = sim_run(spec, trace, args.profile, caps, kv_bytes_per_token(args.model, "float32"), args.max_model_len)
    error = {k: (sim[k] - real[k]) / real[k] if real[k] else float("nan") for k in KEYS}
    return {"layout": layout, "instances_kv_blocks": caps, "real": real, "sim": sim, "error": error,
            "length_mismatches": measured["length_mismatches"]}  # fmt: skip


PROFILE_ARGS = ("--sp-sizes", "1,2", "--histories", "0,256,512", "--chunks", "32,128,256,512", "--decode-batches",
                "1,2,4,8", "--decode-kv-tokens", "64,256,512")  # fmt: skip


def profile_machine(out: Path) -> None:
    """`spindle profile` with one torch thread per process (as the engines run here), written to `out`."""
    import subprocess

    cmd = [sys.executable, "-m", "spindle_launcher", "profile", "--out", str(out), *PROFILE_ARGS]
    log.info("profiling this machine: %s", " ".join(cmd))
    done = subprocess.run(cmd, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"spindle profile failed ({done.returncode}):\n{done.stderr[-2000:]}")


def format_table(results: dict[str, Any]) -> str:
    lines = [f"{'strategy':22s} {'metric':16s} {'real':>10s} {'sim':>10s} {'error':>8s}"]
    for spec, r in results.items():
        if "skipped" in r:
            lines.append(f"{spec:22s} skipped: {r['skipped']}")
            continue
        for k in KEYS:
            unit, scale = ("tok/s", 1.0) if k == "throughput_tok_s" else ("ms", 1e3)
            lines.append(f"{spec:22s} {k:16s} {r['real'][k] * scale:>7.1f} {unit:<2s} {r['sim'][k] * scale:>7.1f} "
                         f"{unit:<2s} {r['error'][k]:>+7.0%}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    t0 = time.perf_counter()
    if args.profile_now:
        profile_machine(args.profile)
    trace = build_trace(args.requests, args.rate, args.prompt_lens, args.output_lens, args.seed)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="spindle-sim-vs-real-"))
    results: dict[str, Any] = {}
    for spec in tqdm(args.strategies, desc="sim_vs_real", unit="strategy"):
        try:
            results[spec] = run_strategy(spec, args, trace, log_dir)
        except (RuntimeError, ValueError) as e:
            log.error("%s", e)
            results[spec] = {"skipped": str(e)}
    doc = {
        "machine": machine_info() | {"load_average_1m": os.getloadavg()[0]},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "trace": [vars(r) | {"hash_ids": list(r.hash_ids)} for r in trace],
        "strategies": results,
        "wall_s": time.perf_counter() - t0,
    }
    write_json(args.json, doc)
    print(f"{args.requests} requests ({args.prompt_lens[0]}-{args.prompt_lens[1]} prompt, {args.output_lens[0]}-"
          f"{args.output_lens[1]} output tokens) at {args.rate:g} req/s; profile {args.profile}")  # fmt: skip
    print(format_table(results))
    print(f"wrote {args.json} in {doc['wall_s']:.0f} s")
    return 0 if all("skipped" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
