"""LoongServe's mechanism overheads on this machine (§7.5: scale-down < 2 %, scale-up < 10 %), measured on the
elastic instances' real code (`spindle_engine.esp`) with SmolLM2 on two gloo processes.

    python bench/loongserve_overheads.py     # bench/results/loongserve_overheads.json

- **Scale-down** (proactive, §4.1): a prompt computed over two members by one ring pass, each keeping half of
  its KV as the ring passes it by (`esp.prefill.prefill_part` + `keep`), against the same ring pass whose members
  keep what they computed (`SPPrefill` without retention, what `spindle verify` and the prefill instances run).
- **Scale-up / multi-master decode** (§4.2): one decode step of a batch whose KV is split over two members, each
  mastering half of the requests, against the same batch on one member: the engine's own directed step (the fast
  path an elastic instance takes for a group of one) and the ESP step on a group of one (the same code as the
  two-member step, without the exchange).

Each process gets one core (`torch.set_num_threads(1)`), so a two-member step has twice the cores of a
one-member one; absolute times mean little on this CPU, the ratios are what compares with the paper.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

RESULTS = Path(__file__).parent / "results"
PROMPTS = (1024, 2048, 4096)
BATCHES = (1, 8)
CONTEXT = 1024  # decode: tokens of context per request


def _engine():
    from spindle_engine import Engine, EngineConfig

    return Engine(EngineConfig(model="smollm2", kv_cache_tokens=24576, max_model_len=8192, allow_partial_kv=True))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _scale_down(engine, rank: int, world: int, repeat: int) -> dict[str, float]:
    from spindle_engine import SamplingParams
    from spindle_engine.esp import parts
    from spindle_engine.esp.exchange import Tags, Waiter
    from spindle_engine.esp.prefill import keep, prefill_part
    from spindle_engine.sp import SPChunk, SPPlan, SPPrefill

    params = SamplingParams(max_tokens=1, temperature=0.0)
    ranks = list(range(world))
    out: dict[str, float] = {}
    batch = 0
    for n in PROMPTS:
        prompt = _prompt(n, n)
        plan = SPPlan((SPChunk(0, n, tuple(ranks), "zigzag"),))
        plain, kept = [], []
        for r in range(repeat + 1):  # the first of each is a warm-up
            dist.barrier()
            t0 = time.perf_counter()
            sp = SPPrefill(
                engine.model, engine.cache, engine.allocator, "p", prompt, plan, rank, dict(enumerate(ranks))
            )
            sp.run()
            sp.release()
            dist.barrier()
            plain.append(time.perf_counter() - t0)
            engine.add_directed("k", prompt, params)
            retain = {m: (m * n // world, (m + 1) * n // world) for m in ranks}
            batch += 1
            dist.barrier()
            t0 = time.perf_counter()
            _, pos, kv = prefill_part(engine, "k", rank, ranks, retain, Tags.for_batch(batch), Waiter(120.0))
            keep(engine, "k", pos, kv)
            dist.barrier()
            kept.append(time.perf_counter() - t0)
            parts.drop(engine, "k")
            if r == 0:
                plain.clear()
                kept.clear()
        out[f"prefill_plain_s:{n}"] = statistics.median(plain)
        out[f"prefill_retain_s:{n}"] = statistics.median(kept)
    return out


def _decode(engine, rank: int, world: int, steps: int) -> dict[str, float]:
    from spindle_engine import SamplingParams
    from spindle_engine.esp import DecodeWork, PrefillWork, run_iteration

    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    out: dict[str, float] = {}
    batch_id = 1000
    for b in BATCHES:
        rids = [f"d{b}-{i}" for i in range(b)]
        prompts = {rid: _prompt(CONTEXT, i) for i, rid in enumerate(rids)}  # the same on every member
        kw = {"aborted": set(), "spec_of": lambda r: b"", "params_of": lambda _: params, "timeout_s": 120.0}
        # (1) one member: the engine's directed step, then the ESP step on a group of one (rank 0 only)
        if rank == 0:
            for rid in rids:
                engine.add_directed(rid, prompts[rid], params)
            engine.step_directed({rid: CONTEXT for rid in rids}, [])
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step_directed({}, rids)
            out[f"step_engine_s:{b}"] = (time.perf_counter() - t0) / steps
            for rid in rids:
                engine.abort(rid)
            for rid in rids:
                engine.add_directed(rid, prompts[rid], params)
            batch_id += 1
            run_iteration(
                engine, 0, [0], [PrefillWork(r, {0: (0, CONTEXT)}) for r in rids], [], batch_id=batch_id, **kw
            )
            t0 = time.perf_counter()
            for _ in range(steps):
                batch_id += 1
                run_iteration(engine, 0, [0], [], [DecodeWork(r, 0) for r in rids], batch_id=batch_id, **kw)
            out[f"step_esp1_s:{b}"] = (time.perf_counter() - t0) / steps
            for rid in rids:
                engine.abort(rid)
        else:
            batch_id += 1 + steps
        # (2) two members, KV split in halves, masters spread
        members = list(range(world))
        for rid in rids:
            engine.add_directed(rid, prompts[rid], params)
        half = {m: (m * CONTEXT // world, (m + 1) * CONTEXT // world) for m in members}
        batch_id += 1
        dist.barrier()
        run_iteration(engine, rank, members, [PrefillWork(r, half) for r in rids], [], batch_id=batch_id, **kw)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            batch_id += 1
            decodes = [DecodeWork(r, i % world) for i, r in enumerate(rids)]
            run_iteration(engine, rank, members, [], decodes, batch_id=batch_id, **kw)
        out[f"step_esp2_s:{b}"] = (time.perf_counter() - t0) / steps
        for rid in rids:
            engine.abort(rid)
        dist.barrier()
    return out


def worker(rank: int, world: int, repeat: int, steps: int) -> dict[str, torch.Tensor]:
    engine = _engine()
    res = _scale_down(engine, rank, world, repeat) | _decode(engine, rank, world, steps)
    return {k: torch.tensor([v]) for k, v in res.items()} if rank == 0 else {}


def main() -> None:
    import tempfile

    from spindle_model.testing import run_gloo

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="timed prefills per length (median; after a warm-up)")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per batch size (mean)")
    p.add_argument("--out", type=Path, default=RESULTS / "loongserve_overheads.json")
    args = p.parse_args()
    print(f"2 gloo processes, SmolLM2; prompts {PROMPTS}, decode batches {BATCHES} at {CONTEXT} tokens each ...")
    with tempfile.TemporaryDirectory() as d:
        res = {k: float(v) for k, v in run_gloo(worker, 2, Path(d), args.repeat, args.steps, timeout=1800)[0].items()}
    rows = []
    print(f"\n{'scale-down: prompt':>20} {'plain ring s':>13} {'retaining s':>12} {'overhead':>9}   (paper: < 2 %)")
    for n in PROMPTS:
        a, b = res[f"prefill_plain_s:{n}"], res[f"prefill_retain_s:{n}"]
        rows.append({"kind": "scale_down", "tokens": n, "plain_s": a, "retain_s": b, "overhead": b / a - 1})
        print(f"{n:>20} {a:>13.3f} {b:>12.3f} {b / a - 1:>+9.1%}")
    print(f"\n{'multi-master: batch':>20} {'engine 1 s':>11} {'ESP 1 s':>9} {'ESP 2 s':>9} {'2 vs ESP 1':>11} "
          f"{'2 vs engine':>12}   (paper: < 10 %)")  # fmt: skip
    for b in BATCHES:
        e, one, two = res[f"step_engine_s:{b}"], res[f"step_esp1_s:{b}"], res[f"step_esp2_s:{b}"]
        rows.append({"kind": "multi_master", "batch": b, "engine_s": e, "esp1_s": one, "esp2_s": two,
                     "vs_esp1": two / one - 1, "vs_engine": two / e - 1})  # fmt: skip
        print(f"{b:>20} {e:>11.4f} {one:>9.4f} {two:>9.4f} {two / one - 1:>+11.1%} {two / e - 1:>+12.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": "smollm2", "context": CONTEXT, "rows": rows}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
