"""Serving benchmark: the Spindle stack under load, and what it adds on top of the engine.

Scenarios (--scenarios, default both):
- overhead: one request at a time. TTFT of a --ttft-prompt-len (16) token prompt through the stack minus the
  engine's own prefill step for it, measured in this process (target <= 20 ms); and the median ITL of a single
  stream (--itl-output-len 64 tokens) minus the engine's own batch-1 decode step (target <= 2 ms).
- load: --num-prompts random token-id prompts of --input-len tokens, --output-len tokens each (greedy, EOS
  ignored), sent at Poisson arrival times at --request-rate (inf = all at once) and streamed over SSE from
  POST /v1/completions. Reported with `vllm bench serve`'s result field names (TTFT, TPOT, ITL, E2EL: mean,
  median, std, p99; throughput). With --trace FILE (CSV or JSONL, spindle_sim.traces) the load replays
  the trace instead: each request at its arrived_at offset, with exactly its prompt and output token counts;
  per-request times go to the JSON under "requests".

Without --url the script starts a stack itself (spindle_launcher's Stack: nats-server, kvstore, scheduler,
--prefill prefill and --decode decode instances, gateway on a free port) and stops it at the end.

    python bench/bench_serve.py                                       # full run, writes bench/results/serve.json
    python bench/bench_serve.py --url http://127.0.0.1:8000           # against a running `spindle up`
    python bench/bench_serve.py --scenarios load --num-prompts 8 --input-len 64 --output-len 8 \\
        --request-rate inf --out /tmp/serve_smoke.json                # smoke test
    python bench/bench_serve.py --scenarios load --trace trace.csv    # replay a trace file
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# The in-process engine runs with the OpenMP setting the prefill/decode services give themselves (see
# spindle_prefill/__init__.py); otherwise its threads spin after each step and slow the stack it is paired with.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import httpx
import torch
from bench_engine import default_threads, machine_info, write_json
from serve_client import make_client, random_token_prompts, run_load, stream_completion
from serve_overhead import TARGETS_MS, EngineProbe, itl_report, ttft_report
from serve_stats import DEFAULT_PERCENTILES, compute_metrics, percentile_key
from serve_trace import length_mismatches, load_trace, request_rows, run_trace
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from spindle_launcher.plan import StackConfig
from spindle_launcher.stack import Stack

log = logging.getLogger("bench.serve")

ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = ROOT / "results" / "serve.json"
SCENARIOS = ("overhead", "load")
ITL_WARMUP_STREAMS = 1


# ----------------------------------------------------------------------------------------------- arguments


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of requests/s or inf, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"the request rate must be positive, got {text!r}")
    return value


def _scenarios(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in values if v not in SCENARIOS]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"scenarios must be among {','.join(SCENARIOS)}, got {text!r}")
    return values


def _percentiles(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated percentiles in (0, 100], got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    description, _, examples = __doc__.partition("\n\n    python")
    p = argparse.ArgumentParser(
        description=description,
        epilog="examples:\n    python" + examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", help="gateway root URL of a running stack (default: start one)")
    p.add_argument("--model", default="smollm2", help="model of the started stack and the engine (default: smollm2)")
    p.add_argument("--served-model-name", help="`model` field of the requests (default: the first of /v1/models)")
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="default: %(default)s"
    )
    p.add_argument("--prefill", type=int, default=2, help="prefill instances of the started stack (default: 2)")
    p.add_argument("--decode", type=int, default=1, help="decode instances of the started stack (default: 1)")
    p.add_argument("--stack-timeout", type=float, default=300.0, help="seconds to wait for the stack (default: 300)")
    p.add_argument("--log-dir", type=Path, help="service logs of the started stack (default: a temp dir)")
    p.add_argument(
        "--stack-log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="default: INFO"
    )
    p.add_argument("--scenarios", type=_scenarios, default=list(SCENARIOS), help="default: overhead,load")
    load = p.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=32, help="default: %(default)s")
    load.add_argument("--input-len", type=int, default=256, help="prompt tokens per request (default: %(default)s)")
    load.add_argument("--output-len", type=int, default=32, help="tokens generated per request (default: %(default)s)")
    load.add_argument("--request-rate", type=_rate, default=4.0, help="requests/s, or inf (default: %(default)s)")
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps; 1 = Poisson (default)"
    )
    load.add_argument(
        "--trace",
        type=Path,
        help="replay this trace instead of --num-prompts/--input-len/--output-len/--request-rate/--burstiness: "
        "Mooncake / AIPerf JSONL (timestamp ms, input_length, output_length), BurstGPT CSV, or Spindle's own .csv "
        "(arrived_at,num_prefill_tokens,num_decode_tokens) / .jsonl; e.g. examples/traces/mooncake_example.jsonl",
    )
    load.add_argument("--metric-percentiles", type=_percentiles, default=list(DEFAULT_PERCENTILES), help="default: 99")
    over = p.add_argument_group("overhead")
    over.add_argument("--ttft-prompt-len", type=int, default=16, help="default: %(default)s")
    over.add_argument(
        "--ttft-max-tokens", type=int, default=2, help="max_tokens of the TTFT requests (default: %(default)s)"
    )
    over.add_argument("--ttft-repeats", type=int, default=30, help="timed TTFT requests (default: %(default)s)")
    over.add_argument("--itl-prompt-len", type=int, default=16, help="default: %(default)s")
    over.add_argument("--itl-output-len", type=int, default=64, help="default: %(default)s")
    over.add_argument("--itl-streams", type=int, default=4, help="timed single streams (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed requests before each measurement (default: 3)")
    p.add_argument(
        "--threads",
        type=int,
        default=default_threads(),
        help="torch threads of the in-process engine (default: all usable cores, here %(default)s)",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="client timeout, s (default: 600)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times (default: 0)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default: {DEFAULT_OUT})")
    args = p.parse_args(argv)
    positive = ("num_prompts", "input_len", "output_len", "ttft_prompt_len", "ttft_max_tokens", "ttft_repeats")
    positive += ("itl_prompt_len", "itl_streams", "threads", "prefill", "decode")
    for name in positive:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.itl_output_len < 2 or args.warmup < 0 or not args.burstiness > 0:
        p.error("--itl-output-len must be >= 2, --warmup >= 0 and --burstiness > 0")
    return args


# ----------------------------------------------------------------------------------------------- stack


def start_stack(args: argparse.Namespace) -> Stack:
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="spindle-bench-serve-"))
    config = StackConfig(
        model=args.model,
        dtype=args.dtype,
        prefill=args.prefill,
        decode=args.decode,
        port=0,
        ready_timeout=args.stack_timeout,
        log_dir=str(log_dir),
        log_level=args.stack_log_level,
    )
    log.info(
        "starting the stack (%d prefill + %d decode, %s); service logs in %s (kept if the run fails)",
        args.prefill,
        args.decode,
        args.model,
        log_dir,
    )
    return Stack(config).start()


async def served_model(url: str, fallback: str) -> str:
    try:
        async with make_client(30.0) as client:
            response = await client.get(url + "/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        log.warning("could not read /v1/models (%s); using model %r", e, fallback)
        return fallback


# ----------------------------------------------------------------------------------------------- scenarios


class Progress:
    """One tqdm bar over every timed unit of the run; each phase renames it."""

    def __init__(self, total: int) -> None:
        self.bar = tqdm(total=total, desc="bench", unit="req", file=sys.stderr)

    def phase(self, name: str) -> None:
        self.bar.set_description(name)

    def tick(self, n: int = 1) -> None:
        self.bar.update(n)


def count_units(args: argparse.Namespace) -> int:
    total = 0
    if "overhead" in args.scenarios:
        total += 2 * (args.ttft_repeats + args.itl_streams)  # in-process engine + through the stack
    if "load" in args.scenarios:
        total += len(args.trace_requests) if args.trace_requests else args.num_prompts
    return total


async def run_overhead(args: argparse.Namespace, url: str, model: str, probe: EngineProbe, progress: Progress) -> dict:
    """Engine and stack alternate, request by request (see serve_overhead)."""
    api = url + "/v1/completions"
    ttft_prompts = random_token_prompts(args.warmup + args.ttft_repeats, args.ttft_prompt_len, args.seed)
    itl_prompt = random_token_prompts(1, args.itl_prompt_len, args.seed + 1)[0]
    engine_ttft, stack_ttft, engine_itl, stack_itl = [], [], [], []
    async with make_client(args.request_timeout) as client:
        progress.phase("overhead: TTFT")
        for i, prompt in enumerate(ttft_prompts):
            engine = probe.prefill(prompt)
            stack = await stream_completion(client, api, model, prompt, args.ttft_max_tokens)
            if i >= args.warmup:
                engine_ttft.append(engine)
                stack_ttft.append(stack)
                progress.tick(2)
        progress.phase("overhead: ITL")
        for i in range(ITL_WARMUP_STREAMS + args.itl_streams):
            engine_steps = probe.stream(itl_prompt, args.itl_output_len)
            stack = await stream_completion(client, api, model, itl_prompt, args.itl_output_len)
            if i >= ITL_WARMUP_STREAMS:
                engine_itl.append(engine_steps)
                stack_itl.append(stack)
                progress.tick(2)
    settings = {
        "ttft_prompt_len": args.ttft_prompt_len,
        "ttft_max_tokens": args.ttft_max_tokens,
        "itl_prompt_len": args.itl_prompt_len,
        "itl_output_len": args.itl_output_len,
    }
    return {
        "ttft": ttft_report(engine_ttft, stack_ttft, settings),
        "itl": itl_report(engine_itl, stack_itl, settings),
    }


async def run_load_scenario(args: argparse.Namespace, url: str, model: str, progress: Progress) -> dict[str, Any]:
    api = url + "/v1/completions"
    progress.phase("load")
    trace = args.trace_requests
    prompts = random_token_prompts(args.num_prompts, args.input_len, args.seed + 2)
    async with make_client(args.request_timeout) as client:
        if args.warmup:  # like vLLM: one test request first
            warm = await stream_completion(client, api, model, prompts[0], args.output_len)
            if not warm.success:
                raise RuntimeError(f"the warm-up request failed: {warm.error}")
        if trace:
            results, duration, start = await run_trace(
                client, api, model, trace, args.seed + 2, on_done=lambda _: progress.tick()
            )
            rows = request_rows(trace, results, start)
            metrics = compute_metrics(results, duration, args.metric_percentiles)
            return metrics | {"requests": rows, "length_mismatches": length_mismatches(rows)}
        results, duration = await run_load(
            client,
            api,
            model,
            prompts,
            args.output_len,
            args.request_rate,
            args.seed,
            args.burstiness,
            on_done=lambda _: progress.tick(),
        )
    return compute_metrics(results, duration, args.metric_percentiles)


# ----------------------------------------------------------------------------------------------- report


def _ms(x: float) -> str:
    return f"{x:.1f} ms"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_overhead(overhead: dict[str, Any]) -> str:
    t, i = overhead["ttft"], overhead["itl"]
    rows = [("overhead", "stack p50", "engine p50", "overhead", "paired", "target")]
    rows.append(
        (
            f"TTFT, {t['prompt_len']}-token prompt",
            _ms(t["stack_ttft_ms"]["median"]),
            _ms(t["engine_prefill_ms"]["median"]) + " (prefill)",
            _ms(t["overhead_ms"]),
            _ms(t["paired_overhead_ms"]),
            f"<= {t['target_ms']:g} ms " + ("ok" if t["pass"] else "MISS"),
        )
    )
    rows.append(
        (
            f"ITL, 1 stream x {i['output_len']} tokens",
            _ms(i["stack_itl_ms"]["median"]),
            _ms(i["engine_decode_step_ms"]["median"]) + " (decode step)",
            _ms(i["overhead_p50_ms"]),
            _ms(i["paired_overhead_ms"]),
            f"<= {i['target_ms']:g} ms " + ("ok" if i["pass"] else "MISS"),
        )
    )
    return _table(rows)


def format_load(r: dict[str, Any], percentiles: list[float]) -> str:
    lines = [
        f"requests: {r['completed']} completed, {r['failed']} failed in {r['duration']:.1f} s; "
        f"peak concurrency {r['max_concurrent_requests']}",
        f"throughput: {r['request_throughput']:.2f} req/s, {r['output_throughput']:.1f} output tok/s, "
        f"{r['total_token_throughput']:.1f} total tok/s",
    ]
    pkeys = [percentile_key(p) for p in percentiles]
    rows = [("latency (ms)", "mean", "median", "std", *pkeys)]
    for name in ("ttft", "tpot", "itl", "e2el"):
        keys = ["mean", "median", "std", *pkeys]
        rows.append((name.upper(), *(f"{r[f'{k}_{name}_ms']:.1f}" for k in keys)))
    return "\n".join(lines) + "\n" + _table(rows)


def build_result(args: argparse.Namespace, url: str, started: bool, measured: dict[str, Any]) -> dict[str, Any]:
    rate = args.request_rate if args.request_rate != float("inf") else "inf"
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S"),
        "backend": "spindle",
        "endpoint": "/v1/completions",
        "model_id": measured.get("model_id"),
        "machine": machine_info() | {"load_average_1m": measured.get("load_average_1m")},
        "stack": {
            "url": url,
            "started_by_bench": started,
            **(
                {
                    "model": args.model,
                    "dtype": args.dtype,
                    "prefill": args.prefill,
                    "decode": args.decode,
                    "log_level": args.stack_log_level,
                }
                if started
                else {}
            ),
        },
        "settings": {
            "scenarios": args.scenarios,
            "seed": args.seed,
            "warmup": args.warmup,
            "engine_dtype": args.dtype,
            "engine_threads": args.threads,
            "ttft_prompt_len": args.ttft_prompt_len,
            "ttft_max_tokens": args.ttft_max_tokens,
            "ttft_repeats": args.ttft_repeats,
            "itl_prompt_len": args.itl_prompt_len,
            "itl_output_len": args.itl_output_len,
            "itl_streams": args.itl_streams,
            "prompt_token_range": [1000, 40000],
        },
        "targets": TARGETS_MS,
    }
    if "overhead" in measured:
        result["overhead"] = measured["overhead"]
    if "load" in measured and args.trace_requests:
        result |= {
            "trace": str(args.trace),
            "num_prompts": len(args.trace_requests),
            "input_len": None,
            "output_len": None,
            "request_rate": None,
            "burstiness": None,
            "max_concurrency": None,
            **measured["load"],
        }
    elif "load" in measured:
        result |= {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "request_rate": rate,
            "burstiness": args.burstiness,
            "max_concurrency": None,
            **measured["load"],
        }
    return result


# ----------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.trace_requests = load_trace(args.trace, args.model) if args.trace and "load" in args.scenarios else None
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    torch.set_num_threads(args.threads)
    measured: dict[str, Any] = {"load_average_1m": {"start": os.getloadavg()[0]}}
    if measured["load_average_1m"]["start"] > 0.5:
        log.warning(
            "the machine is busy (load average %.1f over 1 min, %d cores): timings will be noisy",
            measured["load_average_1m"]["start"],
            default_threads(),
        )
    stack: Stack | None = None
    with logging_redirect_tqdm():
        progress = Progress(count_units(args))
        try:
            probe = None
            if "overhead" in args.scenarios:  # loaded before the stack, so the loads do not compete
                progress.phase("loading the engine")
                log.info("in-process engine: %s %s, %d threads", args.model, args.dtype, args.threads)
                max_len = max(args.ttft_prompt_len + args.ttft_max_tokens, args.itl_prompt_len + args.itl_output_len)
                probe = EngineProbe(args.model, args.dtype, max_len)
            if args.url:
                url = args.url.rstrip("/")
            else:
                progress.phase("starting the stack")
                stack = start_stack(args)
                url = stack.url
            log.info("benchmarking %s", url)
            measured["model_id"] = model = args.served_model_name or asyncio.run(served_model(url, args.model))
            if probe is not None:
                measured["overhead"] = asyncio.run(run_overhead(args, url, model, probe, progress))
                probe = None  # frees the engine before the load
            if "load" in args.scenarios:
                measured["load"] = asyncio.run(run_load_scenario(args, url, model, progress))
        finally:
            measured["load_average_1m"]["end"] = os.getloadavg()[0]
            progress.bar.close()
            if stack is not None:
                log.info("stopping the stack")
                stack.stop()
        if stack is not None and args.log_dir is None:  # it went well: the temp logs are not needed
            shutil.rmtree(stack.config.log_dir, ignore_errors=True)
    result = build_result(args, url, stack is not None, measured)
    write_json(args.out, result)
    print(f"\nSpindle serving benchmark ({result['model_id']} at {url}, {torch.get_num_threads()} engine threads)")
    if "overhead" in result:
        print("\nserving overhead, one request at a time (p50 = median; paired = median of stack - engine pairs):")
        print(format_overhead(result["overhead"]))
    if "load" in args.scenarios and args.trace_requests:
        trace = args.trace_requests
        print(
            f"\nload: trace {args.trace}, {len(trace)} requests over {max(r.arrived_at for r in trace):.1f} s, "
            f"{sum(r.num_prefill_tokens for r in trace)} tokens in, {sum(r.num_decode_tokens for r in trace)} out"
        )
        print(format_load(result, args.metric_percentiles))
        for line in result["length_mismatches"][:5]:
            print(f"length mismatch: {line}")
    elif "load" in args.scenarios:
        rate = "all at once" if args.request_rate == float("inf") else f"{args.request_rate:g} req/s (Poisson)"
        print(f"\nload: {args.num_prompts} prompts, {args.input_len} tokens in, {args.output_len} out, {rate}")
        print(format_load(result, args.metric_percentiles))
    failed = result.get("failed", 0)
    if failed:
        errors = [e for e in result["errors"] if e]
        print(f"\n{failed} request(s) failed, e.g.: {errors[0]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
