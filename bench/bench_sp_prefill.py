"""Sequence-parallel prefill of the real model under SP plans: time per chunk, bytes moved vs theory, exactness.

    .venv/bin/python bench/bench_sp_prefill.py [--tokens 1001] [--cases single,grow,tp]

Every case is one `spindle verify` run (`spindle_engine.sp.verify.verify`): one gloo process per plan member
plus the decode instance's TP ranks, SmolLM2 in fp32 with 1 torch thread per process, a random-token prompt
(fixed seed), then the same prompt on the single-instance engine; the case reports MATCH when the last
token's logits, 8 greedy tokens and the whole prompt KV the decode side received equal the single instance's.

- single: one chunk with SP = 1, 2, 3, 4 (zigzag ring) and SP = 4 with stripe / contiguous / all-to-all:
  time per chunk (slowest member) relative to SP = 1 in the same run, and bytes each member sent (ring or
  all-to-all) vs the theoretical volume. Ring: member i forwards every block of the group but its successor's,
  i.e. on average (sp - 1) / sp of the group's KV (chunk + history) per layer, at 2 * Hkv * D * 4 bytes plus
  an 8-byte position per token. All-to-all: q/k/v of the other members' heads, then their out + lse back.
- grow: 1 -> 2 -> 4 members (chunks at 30 % / 60 % of the prompt) and 2 -> 3 (at 50 %): bytes re-balanced
  before each grown chunk vs theory (moved tokens from `SPPlan.steps()` * layers * 2 * Hkv * D * 4) and the
  re-balancing wait (time spent waiting for moved history that compute did not hide).
- tp: SP = 2 into a decode instance with TP = 2: KV bytes each decode rank received vs its heads' share.
Every case also reports the KV hand-off to decode: prompt tokens * layers * 2 * Hkv * D * 4 bytes in total.

This machine has 2 CPU cores and every process runs 1 torch thread: SP = 2 can use both cores (so it may beat
SP = 1), but SP >= 3 shares them between more member processes than cores, so it cannot be faster than SP = 2
here and its times show overhead, not speed-up (on a GPU per member it would scale). What the numbers do show
is the bytes moved (which must equal theory) and the share of time spent waiting.

A member's chunk time starts when it reaches the chunk, so a member that arrives early (it loaded the model
sooner, or sat out the previous chunk) also counts the wait for its peers, in its attention time or, for a
member new to the group, in its re-balancing wait. All members end a chunk together, so the chunk time shown
is the shortest member's (the last to arrive); the longest is shown beside it. The net re-balancing wait
subtracts each member's arrival skew (its time minus the shortest) from its wait: an estimate of the moved
history that compute did not hide. Each process loads the model fresh, so every chunk is equally cold. The
single-instance reference is computed once and reused by every case. Writes bench/results/sp_prefill.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from spindle_attention.distributed.ulysses import head_split
from spindle_engine.sp import SPPlan, decode_heads
from spindle_engine.sp import verify as sp_verify
from spindle_engine.sp.verify_worker import VerifySpec
from spindle_model import ModelConfig, resolve_model

SECTIONS = ("single", "grow", "tp")
META_INTS = 6  # ints each member all-gathers per layer before ring / all-to-all attention


def cases(n: int) -> list[dict]:
    """(section, name, plan, default layout, decode TP) of every case for an n-token prompt."""
    a, b, h = round(0.3 * n), round(0.6 * n), round(0.5 * n)
    if not 0 < a < b < n:
        raise ValueError(f"--tokens must be at least 4 for the growing plans, got {n}")
    out = [dict(section="single", name="sp1", plan="0:@0", layout="zigzag", decode_tp=1)]
    for sp in (2, 3, 4):
        members = ",".join(map(str, range(sp)))
        out.append(dict(section="single", name=f"sp{sp}-zigzag", plan=f"0:@{members}", layout="zigzag", decode_tp=1))
    for layout in ("stripe", "contiguous", "all-to-all"):
        out.append(dict(section="single", name=f"sp4-{layout}", plan="0:@0,1,2,3", layout=layout, decode_tp=1))
    out.append(dict(section="grow", name="grow-1-2-4", plan=f"0:{a}@0;{a}:{b}@0,1;{b}:@0,1,2,3", layout="zigzag"))
    out.append(dict(section="grow", name="grow-2-3", plan=f"0:{h}@0,1;{h}:@0,1,2", layout="zigzag"))
    out.append(dict(section="tp", name="sp2-tp2", plan="0:@0,1", layout="zigzag", decode_tp=2))
    for c in out:
        c.setdefault("decode_tp", 1)
    return out


def comm_theory(plan: SPPlan, config: ModelConfig) -> list[dict[int, int]]:
    """Per chunk: member -> bytes it must send for attention over all layers (ring or all-to-all payload)."""
    L, hkv, hq, d, elem = config.num_layers, config.num_kv_heads, config.num_heads, config.head_dim, 4
    out = []
    for step in plan.steps():
        c = step.chunk
        if c.sp == 1:
            out.append({c.members[0]: 0})
            continue
        tq = [step.shards[m].numel() for m in c.members]
        tk = [step.history[m].numel() + step.shards[m].numel() for m in c.members]  # a member's block
        per: dict[int, int] = {}
        for i, m in enumerate(c.members):
            if c.attention == "ring":  # forwards every block but its successor's, each once
                per[m] = (sum(tk) - tk[(i + 1) % c.sp]) * (8 + 2 * hkv * d * elem) * L
                continue
            runs = head_split(hq, hkv, c.sp)
            nq = [qe - qs for (qs, qe), _ in runs]
            nk = [ke - ks for _, (ks, ke) in runs]
            fwd = sum(
                8 * (tq[i] + tk[i]) + elem * d * (tq[i] * nq[p] + 2 * tk[i] * nk[p]) for p in range(c.sp) if p != i
            )
            back = sum((4 + elem * d) * tq[p] * nq[i] for p in range(c.sp) if p != i)
            per[m] = (fwd + back) * L
        out.append(per)
    return out


def chunk_rows(case: dict, plan: SPPlan, config: ModelConfig, ranks: list[dict]) -> list[dict]:
    """One row per chunk from the members' ChunkReports, with the theoretical bytes beside the measured ones."""
    kv_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4  # bytes of one token's KV
    theory = comm_theory(plan, config)
    prefill = {r["member"]: {c["index"]: c for c in r["chunks"]} for r in ranks if r.get("role") == "prefill"}
    rows = []
    for step in plan.steps():
        c = step.chunk
        reps = {m: prefill[m][step.index] for m in c.members}
        moved = sum(mv.count for mv in step.moves)
        # A member's clock starts when it reaches the chunk, so early arrivers also count the wait for late peers
        # (model loading, the previous chunk): every member ends the chunk together, so the member that started
        # last (the shortest time) measured the chunk itself; the others' surplus is their arrival skew.
        slowest = max(r["seconds"] for r in reps.values())
        seconds = min(r["seconds"] for r in reps.values())
        wait = max(r["rebalance_wait_s"] for r in reps.values())
        wait_net = max(max(0.0, r["rebalance_wait_s"] - (r["seconds"] - seconds)) for r in reps.values())
        last = min(reps.values(), key=lambda r: r["seconds"])
        rows.append(
            {
                "case": case["name"],
                "chunk": step.index,
                "tokens": c.num_tokens,
                "history": sum(h.numel() for h in step.history.values()),
                "sp": c.sp,
                "layout": c.layout if c.sp > 1 else "-",
                "seconds": seconds,
                "seconds_max": slowest,
                "seconds_by_member": {m: r["seconds"] for m, r in reps.items()},
                "attention_s": last["attention_s"],
                "comm_bytes": {m: r["ring_bytes"] for m, r in reps.items()},
                "comm_payload_bytes": {m: r["ring_payload_bytes"] for m, r in reps.items()},
                "comm_theory_bytes": theory[step.index],
                "comm_meta_bytes": META_INTS * 8 * (c.sp - 1) * config.num_layers,
                "payload_equals_theory": all(reps[m]["ring_payload_bytes"] == theory[step.index][m] for m in reps),
                "moved_tokens": moved,
                "rebalance_bytes": sum(r["rebalance_bytes"] for r in reps.values()),
                "rebalance_theory_bytes": moved * kv_token,
                "rebalance_wait_s": wait,
                "rebalance_wait_net_s": wait_net,
                "rebalance_wait_share": wait_net / seconds if seconds > 0 else 0.0,
            }
        )
    return rows


def transfer(case: dict, n: int, config: ModelConfig, ranks: list[dict]) -> dict:
    """KV hand-off to decode: what the holders sent and each decode rank received, vs theory."""
    per_head = n * config.num_layers * 2 * config.head_dim * 4
    heads = decode_heads(config, case["decode_tp"])
    received = {r["tp_rank"]: r["received_bytes"] for r in ranks if r.get("role") == "decode"}
    return {
        "sent_bytes": sum(r["transfer_bytes"] for r in ranks if r.get("role") == "prefill"),
        "theory_bytes": per_head * config.num_kv_heads,
        "held_tokens": {r["member"]: r["held_tokens"] for r in ranks if r.get("role") == "prefill"},
        "decode_ranks": [
            {
                "tp_rank": t,
                "kv_heads": [lo, hi],
                "received_bytes": received.get(t),
                "theory_bytes": per_head * (hi - lo),
            }
            for t, (lo, hi) in enumerate(heads)
        ],
    }


def reuse_reference() -> None:
    """`verify` recomputes the single-instance reference (model load, prefill, decode: ~10 s at 1001 tokens) on
    every call; it depends only on the model, dtype, prompt and greedy length, which all cases share."""
    compute, cache = sp_verify.reference, {}

    def reference(spec: VerifySpec) -> tuple:
        key = (spec.model, spec.dtype, tuple(spec.token_ids), spec.max_new_tokens)
        if key not in cache:
            cache[key] = compute(spec)
        return cache[key]

    sp_verify.reference = reference


def mean(values: dict | list) -> float:
    vals = list(values.values()) if isinstance(values, dict) else values
    return sum(vals) / len(vals) if vals else 0.0


def print_tables(results: dict) -> None:
    mb = 1e6
    runs = results["cases"]
    sp1 = next((r for r in runs if r["name"] == "sp1" and r.get("chunks")), None)
    sp1_s = sp1["chunks"][0]["seconds"] if sp1 else None
    print(
        "\nPer chunk. s: the chunk's time on the member that reached it last (the others also count waiting for it; "
        "max s is theirs).\ncomm: ring or all-to-all bytes sent per member (mean over the group) vs theory, '=' when "
        "every member's payload equals it exactly; meta: the rest (per-layer size exchange).\nrebal: bytes re-balanced "
        "before the chunk (all members) vs theory; wait: longest re-balancing wait; net: less arrival skew."
    )
    print(
        f"{'case':14} {'chunk':>5} {'tokens':>6} {'hist':>5} {'sp':>2} {'layout':10} {'s':>6} {'max s':>6} "
        f"{'vs sp1':>6} {'attn%':>5} {'comm MB':>8} {'theory':>8} {'=':>1} {'meta B':>6} {'rebal MB':>8} "
        f"{'theory':>7} {'wait s':>6} {'net s':>6} {'net%':>5}"
    )
    for run in runs:
        for c in run.get("chunks", []):
            ratio = f"{c['seconds'] / sp1_s:6.2f}" if sp1_s and run["section"] == "single" else f"{'-':>6}"
            attn = 100 * c["attention_s"] / c["seconds"] if c["seconds"] else 0.0
            print(
                f"{c['case']:14} {c['chunk']:5} {c['tokens']:6} {c['history']:5} {c['sp']:2} {c['layout']:10} "
                f"{c['seconds']:6.2f} {c['seconds_max']:6.2f} {ratio} {attn:5.0f} {mean(c['comm_bytes']) / mb:8.3f} "
                f"{mean(c['comm_theory_bytes']) / mb:8.3f} {'y' if c['payload_equals_theory'] else 'N'} "
                f"{mean(c['comm_bytes']) - mean(c['comm_payload_bytes']):6.0f} {c['rebalance_bytes'] / mb:8.3f} "
                f"{c['rebalance_theory_bytes'] / mb:7.3f} {c['rebalance_wait_s']:6.3f} "
                f"{c['rebalance_wait_net_s']:6.3f} {100 * c['rebalance_wait_share']:5.1f}"
            )
    print("\nPer case (prefill s: sum of the chunks' s; KV MB: sent to decode by all holders together)")
    print(
        f"{'case':14} {'plan':44} {'procs':>5} {'prefill s':>9} {'vs sp1':>6} {'KV MB':>7} {'theory':>7} "
        f"{'decode ranks MB (theory)':26} {'logit diff':>10} {'KV diff':>9} result"
    )
    for run in runs:
        if "error" in run:
            print(f"{run['name']:14} {run['plan']:44} ERROR {run['error'].splitlines()[0]}")
            continue
        total = sum(c["seconds"] for c in run["chunks"])
        ratio = f"{total / sp1_s:6.2f}" if sp1_s else f"{'-':>6}"
        t = run["transfer"]
        dec = " ".join(f"{d['received_bytes'] / mb:.2f}({d['theory_bytes'] / mb:.2f})" for d in t["decode_ranks"])
        kv = run["kv_max_abs_diff"]
        print(
            f"{run['name']:14} {run['plan_formatted'][:44]:44} {run['processes']:5} {total:9.2f} {ratio} "
            f"{t['sent_bytes'] / mb:7.2f} {t['theory_bytes'] / mb:7.2f} {dec:26} {run['logit_max_abs_diff']:10.2e} "
            f"{kv if kv is None else f'{kv:.2e}':>9} {'MATCH' if run['match'] else 'MISMATCH'}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1001, help="prompt length (default: %(default)s)")
    p.add_argument("--cases", default=",".join(SECTIONS), help="sections to run (default: %(default)s)")
    p.add_argument("--model", default="smollm2", help="model name (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="greedy tokens compared (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per verify run (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("bench/results/sp_prefill.json"))
    a = p.parse_args()
    sections = [s.strip() for s in a.cases.split(",") if s.strip()]
    if bad := [s for s in sections if s not in SECTIONS]:
        p.error(f"unknown sections {bad}; expected some of {SECTIONS}")
    if a.tokens < 4:
        p.error("--tokens must be at least 4")
    config = resolve_model(a.model).config
    ids = torch.randint(0, config.vocab_size, (a.tokens,), generator=torch.Generator().manual_seed(a.seed)).tolist()
    todo = [c for c in cases(a.tokens) if c["section"] in sections]
    print(
        f"{a.model}: {config.num_layers} layers, {config.num_heads}/{config.num_kv_heads} heads, head dim "
        f"{config.head_dim}, fp32; {a.tokens} random prompt tokens; 1 torch thread per process; "
        f"{os.cpu_count()} CPU cores.\nSP up to {os.cpu_count()} may beat SP = 1 (1 thread); larger SP shares the "
        "cores and cannot be faster here: read its times as overhead, the bytes against theory and the wait shares.",
        flush=True,
    )
    results: dict = {
        "settings": {"model": a.model, "dtype": "float32", "tokens": a.tokens, "seed": a.seed, "threads": 1,
                     "max_new_tokens": a.max_new_tokens},
        "machine": {"cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                    "torch": torch.__version__},
        "model": {"layers": config.num_layers, "q_heads": config.num_heads, "kv_heads": config.num_kv_heads,
                  "head_dim": config.head_dim, "kv_bytes_per_token": config.num_layers * 2 * config.num_kv_heads
                  * config.head_dim * 4},
        "cases": [],
    }  # fmt: skip
    reuse_reference()
    t_all = time.perf_counter()
    for i, case in enumerate(todo, 1):
        spec = VerifySpec(
            a.model, "float32", case["plan"], case["layout"], ids, case["decode_tp"], None, a.max_new_tokens,
            dump_kv=True, threads=1,
        )  # fmt: skip
        plan = spec.parsed_plan()
        run = dict(case, plan_formatted=plan.format(), processes=spec.world_size())
        print(f"[{i}/{len(todo)}] {case['name']}: {plan.format()}, decode TP {case['decode_tp']}, "
              f"{spec.world_size()} processes ... ", end="", flush=True)  # fmt: skip
        t0 = time.perf_counter()
        try:
            res = sp_verify.verify(spec, timeout_s=a.timeout)
        except RuntimeError as e:
            run["error"] = str(e)
            print(f"ERROR after {time.perf_counter() - t0:.1f} s", flush=True)
            results["cases"].append(run)
            continue
        run.update(
            match=res.match, logit_max_abs_diff=res.logit_max_abs_diff, kv_max_abs_diff=res.kv_max_abs_diff,
            tokens=res.tokens, reference_tokens=res.reference_tokens, ranks_seconds=res.seconds,
            chunks=chunk_rows(case, plan, config, res.ranks), transfer=transfer(case, a.tokens, config, res.ranks),
            ranks=res.ranks,
        )  # fmt: skip
        results["cases"].append(run)
        print(f"{time.perf_counter() - t0:.1f} s, {'MATCH' if res.match else 'MISMATCH'}", flush=True)
    results["total_seconds"] = time.perf_counter() - t_all
    print_tables(results)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1))
    print(f"total {results['total_seconds']:.0f} s; wrote {a.out}")


if __name__ == "__main__":
    main()
