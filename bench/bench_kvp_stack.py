"""KV-parallel decode in the real stack: how often a KVP decode group scales up under a small KV pool.

Starts `spindle up --decode-kvp K --kvp-tokens N` with a small per-member KV cache, sends requests whose
prompts fill members nearly to the limit (so each tail member soon runs out of room for new tokens), a few at a
time, and reads the group leader's counters (`kvp_scale_ups`, `kvp_scale_downs`, `kvp_dropped`, placements) and
every member's blocks from `/v1/spindle/instances`. Prints a table and writes JSON.

    python bench/bench_kvp_stack.py                        # K=3, 512 tokens per member, 9 requests
    python bench/bench_kvp_stack.py --kvp 2 --requests 6 --out /tmp/kvp_stack.json
    python bench/bench_kvp_stack.py --strategy single:kvp_merge_tokens=64 --kvp-tokens 300 --prompt-lens 310,600
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from spindle_launcher.plan import StackConfig
from spindle_launcher.stack import Stack

log = logging.getLogger("bench.kvp_stack")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "kvp_stack.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kvp", type=int, default=3, help="member processes of the decode instance (default 3)")
    p.add_argument("--member-tokens", type=int, default=512, help="KV tokens per member (default 512)")
    p.add_argument("--kvp-tokens", type=int, default=500, help="per-member token limit of a new request's ranges")
    p.add_argument("--prompt-lens", default="520,760,1000", help="prompt lengths, cycled (default 520,760,1000)")
    p.add_argument("--max-tokens", type=int, default=48, help="output tokens per request (default 48)")
    p.add_argument("--strategy", default="single", help="the scheduler's strategy spec (default single; "
                   "e.g. single:kvp_merge_tokens=64 to merge short shards)")  # fmt: skip
    p.add_argument("--requests", type=int, default=9, help="requests in all (default 9)")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight at once (default 2)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    args.prompt_lens = [int(x) for x in args.prompt_lens.split(",")]
    if min(args.kvp - 1, args.member_tokens, args.max_tokens, args.requests, args.concurrency, *args.prompt_lens) < 1:
        p.error("need --kvp >= 2 and positive sizes")
    return args


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 48000 + 100 for i in range(n)]


def _complete(stack: Stack, ids: list[int], max_tokens: int) -> dict[str, Any]:
    t0 = time.monotonic()
    body = {"model": "smollm2", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(stack.base_url + "/completions", json=body, timeout=600)
    out = {"prompt_tokens": len(ids), "status": r.status_code, "seconds": time.monotonic() - t0}
    if r.status_code == 200:
        out["completion_tokens"] = r.json()["usage"]["completion_tokens"]
    else:
        out["error"] = r.text[:300]
    return out


def decode_stats(stack: Stack) -> list[dict[str, Any]]:
    """The group's members' stats, the leader (decode-0, which carries the counters) first."""
    r = httpx.get(stack.url + "/v1/spindle/instances", timeout=10)
    r.raise_for_status()
    members = [i for i in r.json()["instances"] if i["instance_id"].startswith("decode-0")]
    return sorted(members, key=lambda i: i["instance_id"] != "decode-0")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    config = StackConfig(
        port=0,
        prefill=1,
        decode=1,
        decode_kvp=args.kvp,
        kvp_tokens=args.kvp_tokens,
        strategy=args.strategy,
        decode_kv_cache_tokens=args.member_tokens,
        kv_cache_tokens=4096,
        max_model_len=max(args.prompt_lens) + args.max_tokens + 16,
        kvstore_memory_gb=0.5,
        log_dir=tempfile.mkdtemp(prefix="spindle-bench-kvp-"),
    )
    log.info("starting the stack (decode-kvp %d, %d tokens per member); logs in %s", args.kvp, args.member_tokens,
             config.log_dir)  # fmt: skip
    stack = Stack(config).start()
    try:
        prompts = [_prompt(args.prompt_lens[i % len(args.prompt_lens)], i) for i in range(args.requests)]
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(args.concurrency) as pool, tqdm(total=len(prompts), desc="requests") as bar:
            futures = [pool.submit(_complete, stack, ids, args.max_tokens) for ids in prompts]
            for _ in cf.as_completed(futures):
                bar.update()
            results = [f.result() for f in futures]
        wall = time.monotonic() - t0
        members = decode_stats(stack)
    finally:
        stack.stop()
    counters = members[0].get("counters", {})
    ok = sum(r["status"] == 200 for r in results)
    result = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "requests": results,
        "completed": ok,
        "failed": len(results) - ok,
        "wall_s": wall,
        "kvp_scale_ups": counters.get("kvp_scale_ups", 0),
        "kvp_scale_downs": counters.get("kvp_scale_downs", 0),
        "kvp_dropped": counters.get("kvp_dropped", 0),
        "kvp_placed_as_given": counters.get("kvp_placed_as_given", 0),  # where the scheduler placed them
        "kvp_placed_by_group": counters.get("kvp_placed_by_group", 0),
        "kv_blocks_total": sum(m["kv_blocks_total"] for m in members),
        "blocks_left": sum(m["kv_blocks_used"] for m in members),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nKVP decode group: {args.kvp} members x {args.member_tokens} tokens, --kvp-tokens {args.kvp_tokens}, "
          f"strategy {args.strategy}")  # fmt: skip
    print(f"requests {len(results)} ({ok} completed, {len(results) - ok} failed) in {wall:.1f} s")
    print(f"scale-ups {result['kvp_scale_ups']} ({result['kvp_scale_ups'] / len(results):.2f} per request), "
          f"scale-downs {result['kvp_scale_downs']}, dropped {result['kvp_dropped']}, "
          f"placed by the scheduler {result['kvp_placed_as_given']} / by the group {result['kvp_placed_by_group']}, "
          f"blocks held at the end {result['blocks_left']}")  # fmt: skip
    log.info("wrote %s", args.out)
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
