"""Medha on the real stack, beside `chunked` and `single`: short prompts arriving while a long one prefills.

    .venv/bin/python bench/medha_stack.py     # table + bench/results/medha_stack.json (~2 min on 2 cores)

One long prompt (6,000 tokens, 16 out) at t = 0, then a short one (64 tokens, 16 out) every 0.5 s for 8 s, all
greedy with EOS ignored, streamed through the gateway. Each layout starts fresh on this machine:
- `medha`: one elastic instance as a replica, iterations named by the scheduler (`medha:tpot_slo=0.15,
  min_chunk=32`; its predictor from this machine's profile, `bench/results/sim_replay_profile.json`);
- `medha-spp2`: the same, the instance a sequence pipeline of two stage processes (`spindle up --spp 2`);
- `chunked`: the default layout here (one elastic instance, 2048-token steps, 512-token shared chunks);
- `chunked-spp2`: the same as a sequence pipeline of two stage processes;
- `single`: one prefill and one decode instance (FCFS prefill, KV handed off).
Reports the short prompts' TTFT (median, P90, max) and TPOT, the long prompt's TTFT, the long prompt's TTFT with
nothing beside it (sent once before the mixed run: where a pipeline's stages overlap its chunks), and checks that
every layout gives every prompt the same tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from spindle_launcher.plan import StackConfig
from spindle_launcher.stack import Stack

ROOT = Path(__file__).resolve().parent
PROFILE = ROOT / "results" / "sim_replay_profile.json"
LAYOUTS = {
    "medha": {"prefill": 0, "decode": 0, "elastic": 1, "strategy": "medha:tpot_slo=0.15,min_chunk=32",
              "profile": str(PROFILE)},
    "medha-spp2": {"prefill": 0, "decode": 0, "elastic": 1, "elastic_spp": 2,
                   "strategy": "medha:tpot_slo=0.15,min_chunk=32", "profile": str(PROFILE)},
    "chunked": {"prefill": 0, "decode": 0, "elastic": 1, "strategy": "chunked"},
    "chunked-spp2": {"prefill": 0, "decode": 0, "elastic": 1, "elastic_spp": 2, "strategy": "chunked"},
    "single": {"prefill": 1, "decode": 1, "strategy": "single"},
}  # fmt: skip
LONG, SHORT, OUT = 6000, 64, 16


def stream(url: str, prompt: list[int]) -> tuple[float, list[float], list[str]]:
    """(TTFT, token times, token ids) of one streamed greedy completion."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": OUT, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0}  # fmt: skip
    t0 = time.monotonic()
    times: list[float] = []
    ids: list[str] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice.get("logprobs") and choice["logprobs"].get("tokens"):
                times.append(time.monotonic() - t0)
                ids += choice["logprobs"]["tokens"]
    return (times[0] if times else float("nan")), times, ids


def run_layout(name: str, prompts: list[list[int]], gaps: list[float], log_dir: str) -> dict[str, Any]:
    config = StackConfig(port=0, max_model_len=8192, kv_cache_tokens=32768, log_dir=f"{log_dir}/{name}",
                         **LAYOUTS[name])  # fmt: skip
    stack = Stack(config).start()
    try:
        stream(stack.url, prompts[1])  # warm-up
        alone = stream(stack.url, prompts[0])[0]  # the long prompt with nothing beside it
        results: dict[int, tuple[float, list[float], list[str]]] = {}

        def one(i: int) -> None:
            time.sleep(gaps[i])
            results[i] = stream(stack.url, prompts[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stack.stop()
    short = [results[i] for i in range(1, len(prompts))]
    ttfts = sorted(r[0] for r in short)
    tpots = [(r[1][-1] - r[1][0]) / (len(r[1]) - 1) for r in short if len(r[1]) > 1]
    return {
        "layout": name, "config": LAYOUTS[name], "long_ttft_s": results[0][0], "long_alone_ttft_s": alone,
        "short_ttft_s": {"p50": statistics.median(ttfts), "p90": ttfts[int(0.9 * (len(ttfts) - 1))],
                         "max": ttfts[-1]},
        "short_tpot_s": {"p50": statistics.median(tpots), "max": max(tpots)},
        "tokens": {i: results[i][2] for i in results},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "medha_stack.json")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(LONG)]]
    prompts += [[rng.randrange(100, 40000) for _ in range(SHORT)] for _ in range(16)]
    gaps = [0.0] + [0.5 * (i + 1) for i in range(16)]
    runs = []
    with tempfile.TemporaryDirectory() as logs:
        for name in args.layouts.split(","):
            print(f"running {name} ...", flush=True)
            runs.append(run_layout(name, prompts, gaps, logs))
    same = all(r["tokens"] == runs[0]["tokens"] for r in runs[1:])
    print(
        f"\n{'layout':10s} {'short TTFT p50 / p90 / max (s)':>32s} {'short TPOT p50 (ms)':>20s} {'long TTFT (s)':>14s}"
        f" {'long alone (s)':>15s}"
    )
    for r in runs:
        t = r["short_ttft_s"]
        print(f"{r['layout']:10s} {t['p50']:10.2f} / {t['p90']:5.2f} / {t['max']:5.2f} "
              f"{1e3 * r['short_tpot_s']['p50']:20.0f} {r['long_ttft_s']:14.2f}"
              f" {r['long_alone_ttft_s']:15.2f}")  # fmt: skip
    print(f"every layout gave every prompt the same tokens: {same}")
    for r in runs:
        del r["tokens"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"runs": runs, "same_tokens": same, "long": LONG, "short": SHORT, "out": OUT}, indent=1)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
