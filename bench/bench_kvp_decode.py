"""KV-parallel decode step time vs KVP degree and context, and bytes per step (q sent vs KV moved).

Each configuration runs a lockstep group of K local gloo processes (`spindle_engine.kvp.KVPMember`, one
thread each) on SmolLM2 fp32. The prompt KV is random (decode cost does not depend on its values), split
evenly over the K members. Two batch shapes:
- `single`: one request, mastered by member 0 (the others only hold KV and serve queries);
- `multi`: K requests, each mastered by a different member, each split over all K (LoongServe multi-master).
K = 1 is one process decoding alone: the peer every KVP degree is compared with, in the same run.
Step times are the median over the timed steps of the slowest member. Bytes are what member 0 sent per step,
against what moving the remote KV to the master every step would cost (CSPS Table 3's comparison).

    python bench/bench_kvp_decode.py                   # writes bench/results/kvp_decode.json
    python bench/bench_kvp_decode.py --contexts 1024 --degrees 1,2 --steps 4   # quick
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from spindle_engine.kvp import KVPMember, KVPRequest
from spindle_engine.sampling_params import SamplingParams
from spindle_model import LlamaModel, load_state_dict, resolve_model
from spindle_model.testing import run_gloo


def _worker(rank: int, world: int, model: str, ctx: int, shape: str, steps: int) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    source = resolve_model(model)
    cfg = source.config
    m = LlamaModel(cfg)
    m.load_weights(load_state_dict(source.path))
    requests = world if shape == "multi" else 1
    bounds = [ctx * k // world for k in range(world + 1)]
    blocks = requests * (-(-(ctx + steps + 2) // 16) + world + 2)
    dec = KVPMember(m, rank, {k: k for k in range(world)}, num_blocks=blocks, max_model_len=ctx + steps + 2)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for r in range(requests):
        req = KVPRequest.split(f"r{r}", r, list(range(world)), bounds)
        mine = req.range_of(rank)
        kv = None
        if mine is not None:
            kv = torch.randn(2, cfg.num_layers, mine.num_tokens, cfg.num_kv_heads, cfg.head_dim, generator=gen)
        ids = torch.randint(0, cfg.vocab_size, (ctx + 1,), generator=gen).tolist()
        dec.add_request(req, kv, token_ids=ids if r == rank else None, num_prompt_tokens=ctx, params=params)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        dec.step()
        times.append(time.perf_counter() - t0)
    s = dec.stats
    dec.abort_all()
    return {
        "step_s": torch.tensor(times[1:] if len(times) > 1 else times, dtype=torch.float64),
        "bytes": torch.tensor([s.q_bytes, s.kv_bytes, s.result_bytes, s.control_bytes, s.kv_move_bytes, steps]),
    }


def run_case(model: str, k: int, ctx: int, shape: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        outs = run_gloo(_worker, k, Path(tmp), model, ctx, shape, steps, timeout=600.0)
    step_s = statistics.median(max(float(o["step_s"][i]) for o in outs) for i in range(len(outs[0]["step_s"])))
    q, kv, res, ctl, move, n = (int(x) for x in outs[0]["bytes"])
    return {
        "kvp": k,
        "context": ctx,
        "shape": shape,
        "step_s": step_s,
        "member0_sent_bytes_per_step": (q + kv + res + ctl) / n,
        "member0_q_and_new_kv_bytes_per_step": (q + kv) / n,
        "kv_move_bytes_per_step": move / n,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--degrees", default="1,2,3", help="KVP degrees (comma-separated)")
    ap.add_argument("--contexts", default="1024,4096,16384", help="context lengths (comma-separated)")
    ap.add_argument("--shapes", default="single,multi")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per case (the first is not timed)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kvp_decode.json")
    args = ap.parse_args(argv)
    degrees = [int(x) for x in args.degrees.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    shapes = args.shapes.split(",")
    if min(degrees) < 1 or min(contexts) < max(degrees) or args.steps < 2:
        ap.error("degrees >= 1, contexts >= the largest degree, steps >= 2")
    cases = [(k, c, s) for c in contexts for s in shapes for k in degrees if not (s == "multi" and k == 1)]
    rows = []
    for k, ctx, shape in tqdm(cases, desc="kvp decode", unit="case"):
        rows.append(run_case(args.model, k, ctx, shape, args.steps))
    base = {r["context"]: r["step_s"] for r in rows if r["kvp"] == 1}
    head = ("context", "shape", "kvp", "step ms", "vs kvp1", "sent/step", "KV move/step")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (8, 6, 3, 9, 7, 11, 13), strict=True)))
    for r in rows:
        r["vs_kvp1"] = r["step_s"] / base[r["context"]] if r["context"] in base else None
        ratio = "-" if r["vs_kvp1"] is None else f"{r['vs_kvp1']:.2f}"
        print(
            f"{r['context']:>8} {r['shape']:>6} {r['kvp']:>3} {r['step_s'] * 1e3:>9.1f} {ratio:>7} "
            f"{r['member0_sent_bytes_per_step']:>11,.0f} {r['kv_move_bytes_per_step']:>13,.0f}"
        )
    result = {
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(), "torch": torch.__version__},
        "model": args.model,
        "settings": vars(args) | {"out": str(args.out)},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
