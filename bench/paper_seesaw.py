"""Seesaw's evaluation (§6) in the simulator: its clusters, models, workloads, vLLM baselines and throughput metric.

    python bench/paper_seesaw.py           # bench/results/paper_seesaw.{json,png}
    python bench/paper_seesaw.py --quick   # one setup, fewer requests: a smoke run (paper_seesaw_quick.*)

- Clusters (§6.1): 8 x A10 and 8 x L4 over PCIe 4.0 x8 (16 GiB/s per GPU), 8 x A100-40G with NVLink (SXM) and
  over PCIe; 80 GiB of host memory per GPU, which holds a copy of the weights (the re-shards reload from it) and
  the host KV tier (90 % of the rest).
- Models: LLaMA2-13B on 4 GPUs (the paper's 15B LLaMA3 variety is not in the cost model: the closest size that
  is), CodeLLaMA-34B and LLaMA2-70B on 8; LLaMA3-70B on the A100s (Fig. 11).
- Workloads: `seesaw-arxiv` (500 requests) and a ShareGPT fit (`loongserve-sharegpt`, 2000 requests: Seesaw's
  own sample is only plotted), all submitted at once (offline); throughput = requests / the last one's finish.
- vLLM (v0.5.4 in the paper): every data-parallel group size g that fits and every `PPa x TPb` over g, with
  chunked prefill off (`prefill-first`) and on (512- and 2048-token chunks, the better kept: "tuned"), the best
  of all of them is "vLLM best". Seesaw: `seesaw` (transition-minimising, c_p / c_d from `configs.choose`) for
  every g, the best kept, labelled as the paper labels (`PP4 -> TP4`).
- Sensitivity: constant 3000-token prompts with 1-1000 output tokens on LLaMA2-70B / 8 x A10 (Fig. 13); the
  interconnect bandwidth scaled 0.1x-50x for CodeLLaMA-34B on arxiv / 8 x A10 (Fig. 14; the links between GPUs
  only: the host links stay PCIe 4.0 x8).
- Ablation (Fig. 2 / §4.2) on CodeLLaMA-34B, 4 x A10, arxiv: re-sharding with vLLM's prefill-first and with
  decode-first schedules; the prefill-prioritising, decode-prioritising and transition-minimising schedules without
  re-sharding (TP4, PP4); vLLM's best there (TP2PP2 with chunked prefill, Fig. 12).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from spindle_costmodel import CostModel, get_hardware, get_model
from spindle_policy.core import SchedulerConfig
from spindle_policy.strategies.seesaw.configs import candidates, label
from spindle_sim.executor import simulate
from spindle_sim.metrics import strict_json
from spindle_sim.named_cluster import ClusterSpec, SimSetup, named_cluster, with_reshard
from spindle_sim.workloads import TraceRequest, make_workload

RESULTS = Path(__file__).parent / "results"
GIB = 2**30
HOST_PER_GPU = 80 * GIB
WORKLOADS = {"arxiv": ("seesaw-arxiv", 500), "sharegpt": ("loongserve-sharegpt", 2000)}
FIG10 = [(hw, model, gpus) for hw in ("a10", "l4")
         for model, gpus in (("llama2-13b", 4), ("codellama-34b", 8), ("llama2-70b", 8))]  # fmt: skip
FIG11 = [("a100-40g", "llama3-70b", 8), ("a100-40g-pcie", "llama3-70b", 8)]
CHUNKS = (512, 2048)
FIG13_OUTPUTS = (1, 10, 30, 100, 300, 1000)
FIG14_SCALES = (0.1, 0.3, 1.0, 3.0, 10.0, 50.0)
PAPER = {"avg": 1.36, "max": 1.78, "a10_avg": 1.45, "l4_avg": 1.29, "l4_max": 1.52, "a100_sxm_sharegpt": 1.13,
         "a100_pcie_arxiv": 1.46, "a100_pcie_sharegpt": 1.30, "vllm_pcie_over_sxm": 0.6,
         "seesaw_pcie_over_sxm": (0.82, 0.89)}  # fmt: skip


def setup(
    hw_name: str, model: str, gpus: int, group: int, link_scale: float = 1.0, prefill: int = 2048, context: int = 2560
) -> SimSetup:
    """`gpus` GPUs of one node as gpus / group colocated instances of `group` GPUs, each a re-sharding group whose
    c_p and c_d are chosen for prompts of `prefill` tokens decoding at `context`."""
    base = get_hardware("a100-40g" if hw_name == "a100-40g-pcie" else hw_name)
    hw = replace(base, gpus_per_node=gpus, host_mem_bytes=HOST_PER_GPU * gpus)
    if hw_name == "a100-40g-pcie":
        hw = replace(hw, name=hw_name, intra=get_hardware("a100-80g-pcie").intra)
    if link_scale != 1.0:
        hw = replace(hw, intra=replace(hw.intra, bandwidth=hw.intra.bandwidth * link_scale))
    spec = ClusterSpec(
        base.name, model=model, nodes=1, gpus_per_node=gpus, decode_tp=group, num_colocated=gpus // group
    )
    plain = named_cluster(spec, True, scheduler=SchedulerConfig(max_num_requests=10**6))
    return with_reshard(plain, CostModel(get_model(model), hw), prefill, context)


def offline(workload: str, n: int, seed: int) -> list[TraceRequest]:
    return [replace(r, arrived_at=0.0) for r in make_workload(workload, n, 1.0, seed)]


def run_one(key: tuple[Any, ...], spec: str, hw: str, model: str, gpus: int, group: int, workload: str, n: int,
            seed: int, link_scale: float = 1.0) -> dict[str, Any]:  # fmt: skip
    trace = offline(workload, n, seed)
    prefill = round(sum(r.num_prefill_tokens for r in trace) / n)  # Seesaw chooses for the workload's mean lengths
    context = prefill + round(sum(r.num_decode_tokens for r in trace) / n)
    s = setup(hw, model, gpus, group, link_scale, prefill, context)
    t0 = time.perf_counter()
    result = simulate(trace, spec, s.latency, s.config)
    done = [r for r in result.records if r.state == "finished"]
    end = max((r.finished_at or 0.0 for r in done), default=0.0)
    tokens = sum(r.num_prefill_tokens + r.num_decode_tokens for r in done)
    model_ = s.latency.reshard
    assert model_ is not None
    return {
        "key": list(key), "spec": spec, "group": group, "dp": gpus // group, "completed": len(done), "requests": n,
        "makespan_s": end, "throughput_rps": len(done) / end if end else 0.0,
        "throughput_tok_s": tokens / end if end else 0.0, "tier": result.tier,
        "choice": f"{model_.prefill} -> {model_.decode}", "wall_s": time.perf_counter() - t0,
    }  # fmt: skip


def groups(model: str, hw: str, gpus: int) -> dict[int, list[str]]:
    """Each data-parallel group size whose weights fit some configuration, and the labels that fit."""
    out = {}
    for g in (d for d in (1, 2, 4, 8) if d <= gpus and gpus % d == 0):
        try:
            s = setup(hw, model, gpus, g)
        except ValueError:
            continue
        assert s.latency.reshard is not None
        out[g] = sorted(s.latency.reshard.configs)
    return out


def vllm_specs(labels: list[str]) -> list[str]:
    specs = [f"seesaw:schedule=prefill-first,static={c}" for c in labels]
    return specs + [f"seesaw:schedule=chunked,static={c},chunk_size={k}" for c in labels for k in CHUNKS]


def tasks(args: argparse.Namespace) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    out: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    scale = 0.1 if args.quick else 1.0
    fig10 = FIG10[1:2] if args.quick else FIG10 + FIG11
    for hw, model, gpus in fig10:
        for g, labels in groups(model, hw, gpus).items():
            for wname, (workload, n) in WORKLOADS.items():
                n = max(20, int(n * scale))
                for spec in ["seesaw", *vllm_specs(labels)]:
                    key = ("e2e", hw, model, wname, g, spec)
                    out[key] = (key, spec, hw, model, gpus, g, workload, n, args.seed)
    if args.quick:
        return out
    for d in FIG13_OUTPUTS:
        for spec in ["seesaw", *(f"seesaw:schedule=prefill-first,static={label(p)}" for p in candidates(8, 8))]:
            key = ("fig13", d, spec)
            out[key] = (key, spec, "a10", "llama2-70b", 8, 8, f"constant:3000:{d}", 200, args.seed)
    for s in FIG14_SCALES:
        for spec in ["seesaw", *(f"seesaw:schedule=prefill-first,static={label(p)}" for p in candidates(8, 8))]:
            key = ("fig14", s, spec)
            out[key] = (key, spec, "a10", "codellama-34b", 8, 8, "seesaw-arxiv", 500, args.seed, s)
    static = [f"seesaw:schedule={s},static={c}" for s in ("prefill-first", "decode-first") for c in ("TP4", "PP4")]
    for spec in ("seesaw", "seesaw:schedule=prefill-first", "seesaw:schedule=decode-first", "seesaw:static=TP4",
                 "seesaw:static=PP4", *static, "seesaw:schedule=chunked,static=TP2PP2,chunk_size=2048"):  # fmt: skip
        key = ("ablation", spec)
        out[key] = (key, spec, "a10", "codellama-34b", 4, 4, "seesaw-arxiv", 500, args.seed)
    return out


def evaluate(args: argparse.Namespace) -> list[dict[str, Any]]:
    todo = tasks(args)
    runs = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool, tqdm(total=len(todo), desc="simulations") as bar:
        futures = {pool.submit(run_one, *a): key for key, a in todo.items()}
        for f in as_completed(futures):
            try:
                runs.append(f.result())
            except Exception as e:  # a crashing run is reported, the rest goes on
                runs.append({"key": list(futures[f]), "error": f"{type(e).__name__}: {e}"})
            bar.update()
    return sorted(runs, key=lambda r: json.dumps(r["key"]))


def _name(spec: str, group: int, dp: int) -> str:
    """vLLM's and the paper's spelling of a run: `DP2 TP4 chunked 512`, `DP2 PP4 -> TP4`."""
    opts = dict(o.split("=") for o in spec.partition(":")[2].split(",") if o)
    dp_text = f"DP{dp} " if dp > 1 else ""
    if "static" not in opts:
        return dp_text + "{c}"  # Seesaw: filled with its choice
    chunk = f" chunked {opts['chunk_size']}" if opts.get("schedule") == "chunked" else ""
    return f"{dp_text}{opts['static']}{chunk}"


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r and r["completed"] == r["requests"]]
    e2e: dict[str, dict[str, Any]] = {}
    for r in (r for r in ok if r["key"][0] == "e2e"):
        _, hw, model, wname, g, spec = r["key"]
        row = e2e.setdefault(f"{hw} {model} {wname}", {"hardware": hw, "model": model, "workload": wname})
        name = _name(spec, g, r["dp"]).format(c=r["choice"])
        side = "seesaw" if spec == "seesaw" else "vllm"
        if r["throughput_rps"] > row.get(side, {}).get("throughput_rps", 0.0):
            row[side] = {"config": name, "throughput_rps": r["throughput_rps"],
                         "throughput_tok_s": r["throughput_tok_s"], "tier": r["tier"]}  # fmt: skip
    for row in e2e.values():
        if "seesaw" in row and "vllm" in row:
            row["speedup"] = row["seesaw"]["throughput_rps"] / row["vllm"]["throughput_rps"]

    def geomean(xs: list[float]) -> float | None:
        return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None

    pcie = [r["speedup"] for r in e2e.values() if r["hardware"] in ("a10", "l4") and "speedup" in r]
    by_hw = {hw: [r["speedup"] for r in e2e.values() if r["hardware"] == hw and "speedup" in r]
             for hw in ("a10", "l4", "a100-40g", "a100-40g-pcie")}  # fmt: skip
    a100 = {}
    for wname in WORKLOADS:
        sxm, pc = e2e.get(f"a100-40g llama3-70b {wname}"), e2e.get(f"a100-40g-pcie llama3-70b {wname}")
        if sxm and pc and "vllm" in sxm and "vllm" in pc and "seesaw" in pc:
            vllm_sxm = sxm["vllm"]["throughput_rps"]
            a100[wname] = {"vllm_pcie_over_sxm": pc["vllm"]["throughput_rps"] / vllm_sxm,
                           "seesaw_pcie_over_vllm_sxm": pc["seesaw"]["throughput_rps"] / vllm_sxm}  # fmt: skip
    headline = {
        "pcie_geomean": geomean(pcie), "pcie_max": max(pcie, default=None),
        **{f"{hw}_geomean": geomean(v) for hw, v in by_hw.items()}, "a100_pcie_vs_sxm": a100,
    }  # fmt: skip
    sweeps: dict[str, dict[str, dict[str, float]]] = {"fig13": {}, "fig14": {}}
    for r in (r for r in ok if r["key"][0] in sweeps):
        fig, x, spec = r["key"]
        name = "Seesaw" if spec == "seesaw" else spec.rpartition("=")[2]
        sweeps[fig].setdefault(name, {})[str(x)] = r["throughput_rps"]
    ablation = {r["key"][1]: {"throughput_rps": r["throughput_rps"], "makespan_s": r["makespan_s"], "tier": r["tier"]}
                for r in ok if r["key"][0] == "ablation"}  # fmt: skip
    errors = [r for r in runs if "error" in r or r["completed"] != r["requests"]]
    incomplete = [{"key": r["key"], "error": r.get("error"), "completed": r.get("completed")} for r in errors]
    return {"e2e": e2e, "headline": headline, "paper": PAPER, **sweeps, "ablation": ablation,
            "incomplete": incomplete}  # fmt: skip


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def table(s: dict[str, Any]) -> str:
    lines = ["setup                                   | vLLM best (config)          | Seesaw (config)           | x",
             "-" * 110]  # fmt: skip
    for name, row in s["e2e"].items():
        v, w = row.get("vllm", {}), row.get("seesaw", {})
        lines.append(
            f"{name:39s} | {_f(v.get('throughput_rps')):>6} {v.get('config', '-'):20s} | "
            f"{_f(w.get('throughput_rps')):>6} {w.get('config', '-'):18s} | {_f(row.get('speedup'))}"
        )
    h = s["headline"]
    lines.append(f"\nPCIe geomean {_f(h['pcie_geomean'])} (paper {PAPER['avg']}), max {_f(h['pcie_max'])} (paper "
                 f"{PAPER['max']}); A10 {_f(h['a10_geomean'])} (paper {PAPER['a10_avg']}), L4 {_f(h['l4_geomean'])} "
                 f"(paper {PAPER['l4_avg']})")  # fmt: skip
    for wname, a in h["a100_pcie_vs_sxm"].items():
        lines.append(f"A100 {wname}: vLLM PCIe / SXM {_f(a['vllm_pcie_over_sxm'])} (paper 0.6); Seesaw PCIe / vLLM "
                     f"SXM {_f(a['seesaw_pcie_over_vllm_sxm'])} (paper 0.82-0.89)")  # fmt: skip
    for fig, what in (("fig13", "output tokens (3000-token prompts)"), ("fig14", "interconnect bandwidth x")):
        if s[fig]:
            xs = sorted({x for v in s[fig].values() for x in v}, key=float)
            lines.append(f"\n{fig}: throughput (req/s) by {what}: " + " ".join(f"{x:>7}" for x in xs))
            for name, v in s[fig].items():
                lines.append(f"  {name:10s} " + " ".join(f"{_f(v.get(x)):>7}" for x in xs))
    if s["ablation"]:
        lines.append("\nablation (34B, 4 x A10, arxiv; Fig. 12's breakdown: seconds in prefill / mixed / decode "
                     "iterations, re-shards)")  # fmt: skip
        for k, v in s["ablation"].items():
            t = v["tier"]
            busy = " / ".join(f"{t.get(f'{kind}_busy_s', 0.0):.0f}" for kind in ("prefill", "mixed", "decode"))
            lines.append(f"  {k:55s} {_f(v['throughput_rps']):>6} req/s  {busy} s  {int(t.get('reshards', 0))} "
                         f"re-shards ({t.get('reshard_s', 0.0):.1f} s)")  # fmt: skip
    if s["incomplete"]:
        lines.append(f"\n{len(s['incomplete'])} run(s) incomplete: {s['incomplete'][:3]}")
    return "\n".join(lines)


def plot(s: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6), gridspec_kw={"width_ratios": [2.2, 1, 1]})
    ax = axes[0]  # Fig. 10 / 11: throughput normalised to vLLM's best, configurations above the bars
    rows = [(n, r) for n, r in s["e2e"].items() if "speedup" in r]
    for i, (_, r) in enumerate(rows):
        ax.bar(i - 0.2, 1.0, 0.4, color="tab:gray", label="vLLM (best static)" if i == 0 else None)
        ax.bar(i + 0.2, r["speedup"], 0.4, color="tab:red", label="Seesaw" if i == 0 else None)
        ax.text(i - 0.2, 1.02, r["vllm"]["config"], rotation=90, ha="center", va="bottom", fontsize=6)
        ax.text(i + 0.2, r["speedup"] + 0.02, r["seesaw"]["config"], rotation=90, ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(rows)), [n.replace(" ", "\n", 1) for n, _ in rows], fontsize=6, rotation=60)
    ax.set_ylabel("throughput / vLLM best")
    ax.set_ylim(0, max([2.0, *(r["speedup"] + 0.8 for _, r in rows)]))
    ax.set_title("end-to-end throughput (Fig. 10 / 11)")
    ax.legend(fontsize=7, loc="upper right")
    for ax, fig_key, xlabel, title in (
        (axes[1], "fig13", "output tokens (input 3000)", "70B, 8 x A10 (Fig. 13)"),
        (axes[2], "fig14", "interconnect bandwidth (x PCIe)", "34B arxiv, 8 x A10 (Fig. 14)"),
    ):
        for name, v in s[fig_key].items():
            xs = sorted(v, key=float)
            ax.plot([float(x) for x in xs], [v[x] for x in xs], "o-" if name == "Seesaw" else ".--", label=name,
                    color="black" if name == "Seesaw" else None)  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("requests / s")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one setup (34B on 8 x A10), 10 %% of the requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="simulations at once")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/paper_seesaw.json)")
    args = parser.parse_args()
    out = args.out or RESULTS / ("paper_seesaw_quick.json" if args.quick else "paper_seesaw.json")
    t0 = time.perf_counter()
    runs = evaluate(args)
    summary = summarize(runs)
    summary["setup"] = {"workloads": WORKLOADS, "host_per_gpu_gib": HOST_PER_GPU / GIB, "chunks": CHUNKS,
                        "seed": args.seed, "quick": args.quick, "wall_s": time.perf_counter() - t0}  # fmt: skip
    summary["runs"] = runs
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(strict_json(summary), indent=1))
    plot(summary, out.with_suffix(".png"))
    print(table(summary))
    print(f"\nwrote {out} and {out.with_suffix('.png')} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
