"""CSPS (seed 001) §5 in the simulator: Sarathi-Serve against SP prefill without CSA, CSPS, CSPS-NTP and CSPS-TP on
the paper's cluster and models, plus Table 3 (moving Q vs KV in decode) and CSA's savings at the drop ratio our
quality study supports.

    .venv/bin/python bench/paper_csps.py            # table + bench/results/paper_csps.{json,png} (~15 s)
    .venv/bin/python bench/paper_csps.py --quick    # 24 requests, GLM-4 only

Setup (§3.1/§5.2): 64 A100-40GB on 8 AWS p4d servers (NVLink inside, 400 Gb/s EFA per server:
`a100-40g-p4d`), GLM-4-9B-Chat-1M and InternLM2.5-7B-Chat-1M (`glm-4-9b-1m`, `internlm2.5-7b-1m`), NeedleBench and
BookCorpus lengths (`csps-needlebench`, `csps-bookcorpus`: lognormals through Table 2's median and P99), Poisson
arrivals at 1 req/s, the same trace for every configuration.

- Sarathi-Serve: `chunked:chunk_size=256` on 8 colocated instances of TP4 x PP2 (the paper's setting). The
  simulator pipelines a pipeline instance's iterations that sample nothing (consecutive chunks of a prompt), which
  Sarathi-Serve's PP does not do for one request: generous to the baseline.
- SP without CSA: `csps` with CSA off (drop 0): 48 prefill GPUs (TP1) in all-to-all SP groups, the SP size per
  request with the lowest predicted TTFT (up to 16); 16 decode GPUs (TP1), a long prompt's KV split over
  KV-parallel decode members of at most `KVP_TOKENS` each (§4: the query moves to the KV). The paper does not say
  how it splits its GPUs; "CSPS, 32+32" is CSPS on half and half.
- CSPS: the same with `accuracy_loss=0`: the (levels, drop) our measured quality table allows at zero loss on
  SmolLM2 (`strategies/csps/data/quality.json`: p <= 0.1 at SP 4, 0.05 at SP 8, nothing measured above SP 8, so
  groups of 16+ run dense), not the paper's 22 %.
- CSPS p=0.05: CSA at the largest drop with no measurable loss at SP 8 (McNemar p = 1.0, 39/40 against 40/40),
  on every SP group (groups of 16 are beyond what was measured: an extrapolation, labelled as such).
- CSPS-NTP and CSPS-TP: CSPS with every SP group priced as SP-NTP (all-to-all) or SP-TP (all-gather /
  reduce-scatter around tensor-parallel attention, hierarchical: across servers then within). On TP-1 prefill
  instances §3.2.2's rule always picks SP-NTP (no parameters move), so CSPS = CSPS-NTP here.

Metrics as the paper averages them: TTFT, TBT (every gap between tokens), response time; prefill throughput =
mean over requests of prompt tokens / TTFT, decode throughput = mean of (output tokens - 1) / decode time.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from spindle_costmodel import Chunk, CostModel, get_hardware, get_model
from spindle_costmodel.csa import alltoall_bytes, max_levels, pair_fraction
from spindle_costmodel.parallel import Parallelism
from spindle_sim.executor import simulate
from spindle_sim.named_cluster import ClusterSpec, named_cluster
from spindle_sim.workloads import TraceRequest, make_workload

RESULTS = Path(__file__).parent / "results"
HARDWARE, NODES = "a100-40g-p4d", 8
MODELS = ("glm-4-9b-1m", "internlm2.5-7b-1m")
WORKLOADS = ("csps-needlebench", "csps-bookcorpus")
KVP_TOKENS = 131_072  # the SPT length of §5.2 (64K-128K): a decode member holds at most this much of one prompt
PREFILL_GPUS = 48  # of 64 for SP prefill, the rest decode (the paper does not say; decode needs far less compute)
# name: (strategy spec, SP pricing, prefill GPUs (0: colocated instances of TP4 x PP2))
CONFIGS: dict[str, tuple[str, str, int]] = {
    "Sarathi-Serve": ("chunked:chunk_size=256", "ring", 0),
    "SP (no CSA)": (f"csps:kvp_tokens={KVP_TOKENS}", "ulysses", PREFILL_GPUS),
    "CSPS": (f"csps:accuracy_loss=0,kvp_tokens={KVP_TOKENS}", "ulysses", PREFILL_GPUS),
    "CSPS-TP": (f"csps:accuracy_loss=0,kvp_tokens={KVP_TOKENS}", "sp-tp", PREFILL_GPUS),
    "CSPS p=0.05": (f"csps:drop=0.05,kvp_tokens={KVP_TOKENS}", "ulysses", PREFILL_GPUS),
    "CSPS, 32+32": (f"csps:accuracy_loss=0,kvp_tokens={KVP_TOKENS}", "ulysses", 32),
}
CONTEXT = 1 << 20  # both models' context window: an SP group and a KV-parallel decode group hold a 1M prompt
ALONE = 1_000_000  # one request of this many tokens on an idle cluster (the paper's Fig. 2 at 1M)
PAPER = {  # vs Sarathi-Serve, from §5.3 and Table 4 (ranges over models and workloads)
    "ttft": "6.1-7.5x", "tbt": "1.6-1.92x", "response": "8.3-9.8x", "prefill_tput": "7.1-8.2x",
    "decode_tput": "4.3-5.2x", "ntp_vs_tp_ttft": "1.32-1.51x (TP slower)",
}  # fmt: skip


def run_one(model: str, workload: str, config: str, n: int, rate: float, seed: int) -> dict[str, Any]:
    """One configuration on one workload (`workload` "alone": one ALONE-token request, 348 output tokens)."""
    spec, sp_kind, prefill = CONFIGS[config]
    if prefill:
        gpus = NODES * get_hardware(HARDWARE).gpus_per_node
        cluster = ClusterSpec(HARDWARE, model, NODES, num_prefill=prefill, num_decode=gpus - prefill, sp_kind=sp_kind)
    else:
        cluster = ClusterSpec(HARDWARE, model, NODES, decode_tp=4, spp=2)
    setup = named_cluster(cluster, not prefill, max_model_len=CONTEXT)
    trace = [TraceRequest(0.0, ALONE, 348)] if workload == "alone" else make_workload(workload, n, rate, seed)
    t0 = time.perf_counter()
    result = simulate(trace, spec, setup.latency, setup.config)
    s = result.summary(workload, rate)
    done = [r for r in result.records if r.state == "finished" and r.ttft]
    prefill_tput = [r.num_prefill_tokens / r.ttft for r in done]  # type: ignore[operator]
    decode_tput = [
        (len(r.token_times) - 1) / (r.token_times[-1] - r.token_times[0]) for r in done if len(r.token_times) > 1
    ]
    return {
        "model": model, "workload": workload, "config": config, "spec": spec, "shape": setup.shape.text,
        "requests": len(trace), "completed": s.completed, "rejected": s.rejected, "failed": s.failed,
        "ttft_mean_s": s.ttft_s.mean, "ttft_p99_s": s.ttft_s.p99, "tbt_mean_s": s.tbt_s.mean,
        "response_mean_s": s.e2e_s.mean,
        "prefill_tput_tok_s": float(np.mean(prefill_tput)) if prefill_tput else None,
        "decode_tput_tok_s": float(np.mean(decode_tput)) if decode_tput else None,
        "max_sp": sorted({r.max_sp for r in done}), "wall_s": time.perf_counter() - t0,
    }  # fmt: skip


def table3() -> list[dict[str, Any]]:
    """Moving one decode token's Q vs gathering a request's KV, one layer, 8 GPUs of a p4d server (Table 3): the
    owner broadcasts q to 7 peers, or the 7 peers send it their KV shards (it receives 7/8 of the KV)."""
    hw = get_hardware(HARDWARE)
    rows = []
    for name in MODELS:
        m = get_model(name)
        for tokens in (1_000_000, 406_000):
            q = m.q_dim * m.dtype_bytes
            kv = tokens * 2 * m.kv_dim * m.dtype_bytes
            rows.append({
                "model": name, "tokens": tokens, "q_bytes": q, "kv_bytes": kv,
                "q_ms": 1e3 * 7 * hw.intra.transfer_s(q), "kv_ms": 1e3 * hw.intra.transfer_s(kv * 7 / 8),
                "kv_ms_across_servers": 1e3 * hw.inter.transfer_s(kv * 7 / 8),
            })  # fmt: skip
    return rows


def csa_savings(sp: int = 8, tokens: int = 1_000_000, drop: float = 0.05) -> list[dict[str, Any]]:
    """What CSA at the supported drop saves on one prompt (cost model), against the paper's 19 % communication /
    28 % computation: attention compute by the share of pairs attended; the all-to-all by the bytes CSA's
    all-to-all sends (`spindle_costmodel.csa.alltoall_bytes`, which gives what `spindle verify --layout all-to-all
    --csa-drop` measured on SmolLM2), against plain Ulysses and against CSA with nothing dropped (causality
    alone: members with no earlier keys send no queries)."""
    hw = get_hardware(HARDWARE)
    levels = max_levels(sp)
    keep = pair_fraction(sp, levels, drop)
    out = []
    for name in MODELS:
        m = get_model(name)
        cm = CostModel(m, hw)
        par = Parallelism(sp=sp, sp_kind="ulysses")
        dense = cm.step([Chunk(tokens)], (), par)
        sparse = cm.step([Chunk(tokens)], (), par, keep=keep)
        att = dense.op("attention_prefill").s, sparse.op("attention_prefill").s  # type: ignore[union-attr]
        comm = dense.op("sp_alltoall").s  # type: ignore[union-attr]
        moved = [alltoall_bytes(tokens, sp, lv, p, m.heads, m.kv_heads, m.head_dim, m.dtype_bytes)
                 for lv, p in ((1, 0.0), (levels, 0.0), (levels, drop))]  # fmt: skip
        comm_csa = comm * moved[2] / moved[0]  # the same links, fewer bytes
        out.append({
            "model": name, "sp": sp, "tokens": tokens, "drop": drop, "pairs_kept": keep,
            "attention_saved": 1 - att[1] / att[0], "bytes_per_layer": moved,
            "bytes_saved_vs_plain": 1 - moved[2] / moved[0], "bytes_saved_by_drop": 1 - moved[2] / moved[1],
            "prefill_saved": 1 - (sparse.total_s - comm + comm_csa) / dense.total_s,
        })  # fmt: skip
    return out


def evaluate(models: tuple[str, ...], n: int, rate: float, seed: int, jobs: int) -> list[dict[str, Any]]:
    tasks = [(m, w, c, n, rate, seed) for m in models for w in ("alone", *WORKLOADS) for c in CONFIGS]
    out = []
    with ProcessPoolExecutor(max_workers=jobs) as pool, tqdm(total=len(tasks), desc="simulations") as bar:
        for f in as_completed([pool.submit(run_one, *t) for t in tasks]):
            out.append(f.result())
            bar.update()
    configs, workloads = list(CONFIGS), ["alone", *WORKLOADS]
    return sorted(out, key=lambda r: (r["model"], workloads.index(r["workload"]), configs.index(r["config"])))


def _over(base: dict[str, Any], run: dict[str, Any], key: str, inverse: bool = False) -> float | None:
    """base / run (inverse: run / base), or None where either is missing."""
    a, b = base[key], run[key]
    if not a or not b:
        return None
    return b / a if inverse else a / b


def ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, workload): Sarathi-Serve's metric over each configuration's (x lower or x higher)."""
    out = []
    base = {(r["model"], r["workload"]): r for r in runs if r["config"] == "Sarathi-Serve"}
    for r in runs:
        b = base[r["model"], r["workload"]]
        if r is b:
            continue
        out.append({
            "model": r["model"], "workload": r["workload"], "config": r["config"],
            "ttft": _over(b, r, "ttft_mean_s"), "tbt": _over(b, r, "tbt_mean_s"),
            "response": _over(b, r, "response_mean_s"), "prefill_tput": _over(b, r, "prefill_tput_tok_s", True),
            "decode_tput": _over(b, r, "decode_tput_tok_s", True),
        })  # fmt: skip
    return out


def tables(runs: list[dict[str, Any]], rat: list[dict[str, Any]], t3: list[dict[str, Any]], csa: list[dict[str, Any]]
           ) -> str:  # fmt: skip
    def f(x: float | None, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    lines = ["| model | workload | config | done | TTFT mean (s) | TBT mean (s) | response (s) | prefill tok/s | "
             "decode tok/s | SP sizes |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        where = f"| {r['model']} | {r['workload'].removeprefix('csps-')} | {r['config']} |"
        lines.append(f"{where} {r['completed']}/{r['requests']} | "
                     f"{f(r['ttft_mean_s'])} | {f(r['tbt_mean_s'], '.3f')} | {f(r['response_mean_s'])} | "
                     f"{f(r['prefill_tput_tok_s'], '.0f')} | {f(r['decode_tput_tok_s'], '.1f')} | "
                     f"{r['max_sp']} |")  # fmt: skip
    lines += ["", "Sarathi-Serve / config (x better; the paper's CSPS in the last row)",
              "| model | workload | config | TTFT | TBT | response | prefill tput | decode tput |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rat:
        where = f"| {r['model']} | {r['workload'].removeprefix('csps-')} | {r['config']} |"
        lines.append(f"{where} {f(r['ttft'])} | {f(r['tbt'])} | "
                     f"{f(r['response'])} | {f(r['prefill_tput'])} | {f(r['decode_tput'])} |")  # fmt: skip
    p = PAPER
    lines.append(f"| paper | both | CSPS | {p['ttft']} | {p['tbt']} | {p['response']} | {p['prefill_tput']} | "
                 f"{p['decode_tput']} |")  # fmt: skip
    lines += ["", "Table 3: one layer's Q vs KV moved in decode, 8 GPUs of one server (paper: 1 ms vs 1,173 / 1,085 ms "
              "at 1M, 984 / 879 ms at 406K)", "| model | tokens | Q bytes | KV bytes | Q (ms) | KV (ms) | "
              "KV across servers (ms) |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in t3:
        lines.append(f"| {r['model']} | {r['tokens']:,} | {r['q_bytes']:,} | {r['kv_bytes'] / 1e9:.2f} GB | "
                     f"{r['q_ms']:.3f} | {r['kv_ms']:.1f} | {r['kv_ms_across_servers']:.0f} |")  # fmt: skip
    lines += ["", "CSA at the supported drop (cost model; paper at its 22 % drop: -28 % computation, -19 % "
              "communication)", "| model | SP | tokens | drop | pairs kept | attention time saved | all-to-all bytes "
              "saved (vs plain / vs CSA at p = 0) | prefill saved |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in csa:
        lines.append(f"| {r['model']} | {r['sp']} | {r['tokens']:,} | {r['drop']} | {r['pairs_kept']:.3f} | "
                     f"{r['attention_saved']:.1%} | {r['bytes_saved_vs_plain']:.1%} / {r['bytes_saved_by_drop']:.1%} "
                     f"| {r['prefill_saved']:.1%} |")  # fmt: skip
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Fig. 14-16 as the paper draws them: average TTFT, TBT and response time, bars per configuration, grouped by
    workload and model (log scale: the configurations span an order of magnitude)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(m, w) for m in dict.fromkeys(r["model"] for r in runs) for w in WORKLOADS]
    configs = [c for c in CONFIGS if any(r["config"] == c for r in runs)]
    metrics = (("ttft_mean_s", "average TTFT (s)"), ("tbt_mean_s", "average TBT (s)"),
               ("response_mean_s", "average response time (s)"))  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    width = 0.8 / len(configs)
    for ax, (key, label) in zip(axes, metrics, strict=True):
        for k, config in enumerate(configs):
            values = [next((r[key] for r in runs if (r["model"], r["workload"], r["config"]) == (*g, config)), 0)
                      for g in groups]  # fmt: skip
            ax.bar([i + k * width for i in range(len(groups))], values, width, label=config)
        ax.set_xticks([i + width * (len(configs) - 1) / 2 for i in range(len(groups))])
        ax.set_xticklabels([f"{w.removeprefix('csps-')}\n{m}" for m, w in groups], fontsize=8)
        ax.set_ylabel(label)
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    gpus = NODES * get_hardware(HARDWARE).gpus_per_node
    fig.suptitle(f"CSPS §5 in the simulator: {HARDWARE} x {gpus}, 1 req/s (bench/paper_csps.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="24 requests, GLM-4 only (a smoke run)")
    parser.add_argument("--requests", type=int, default=100, help="requests per run (default 100)")
    parser.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second (default 1, the paper's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="simulations in parallel (default 2)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/paper_csps.json)")
    args = parser.parse_args()
    if args.requests < 1 or args.rate <= 0 or args.jobs < 1:
        parser.error("--requests and --jobs must be >= 1 and --rate > 0")
    models, n = (MODELS[:1], 24) if args.quick else (MODELS, args.requests)
    runs = evaluate(models, n, args.rate, args.seed, args.jobs)
    rat, t3, csa = ratios(runs), table3(), csa_savings()
    print(tables(runs, rat, t3, csa))
    out = args.out or RESULTS / ("paper_csps_quick.json" if args.quick else "paper_csps.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"hardware": HARDWARE, "nodes": NODES, "rate": args.rate, "seed": args.seed, "configs": CONFIGS,
           "paper": PAPER, "runs": runs, "ratios": rat, "table3": t3, "csa": csa}  # fmt: skip
    out.write_text(json.dumps(doc, indent=1))
    plot(runs, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
