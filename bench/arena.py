"""The arena: every paper strategy and `spindle` on mixed traffic, on two clusters, one cost model, one judge.

    .venv/bin/python bench/arena.py                 # every cell below: bench/results/arena/*.{json,png}, arena.json
    .venv/bin/python bench/arena.py --quick         # 200 requests, one seed, no tuning, A100 chat (a smoke run)
    .venv/bin/python bench/arena.py --cells a100:chat h100:batch --jobs 2
    .venv/bin/python bench/arena.py --papers --merge  # the table again from the cells' JSON (after a stopped run)

Each cell is one `spindle sim compare` of the strategies on one workload and cluster (the same command a user
runs; printed before it runs), under the comparison rules every strategy meets:
- every strategy's deployment knobs are searched the same way (`--tune`: the same budget of runs at the cell's load
  point on a tuning seed that is never evaluated), and each strategy also runs as the paper configured it
  (`NAME@paper`); no strategy is told the SLO it is scored on;
- each configuration runs on three evaluation seeds (`--seeds 1,2,3`): every number is the seeds' mean, with its
  range, and a strategy wins a metric only where its range does not overlap another's (else: a tie);
- one run at the cell's load point gives goodput, P50/P99 TTFT and TPOT and the batch job's completion time, then
  each strategy's max sustainable load: the highest rate at which >= 90 % of the interactive requests meet the SLO
  (DistServe's goodput rule; a rejected or unfinished request is a miss), every probed rate offering its load for
  at least 120 s, searched to 5 %.

Workloads (`workloads.py` says how each is fitted):
- chat: `mixed-chat`, ShareGPT-like turns with 2 % long documents (16K-256K tokens), Poisson arrivals;
- diurnal: `mixed-diurnal`, the long share drifting from 1 % to 20 % over the trace;
- bursty: `mixed-chat` with gamma arrivals of cv 4;
- batch: `mixed-batch`, the chat traffic plus a batch job of 10 % of the requests submitted at its midpoint.
Clusters: Llama-3-8B on 32 A100-80GB in 4 nodes; Llama-3-70B on 64 H100-SXM in 8 nodes.
SLO: TTFT <= 1 s + 0.05 s per 1,000 prompt tokens (a 128K document: 7.4 s), TPOT <= 0.1 s, the same for every
strategy.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
OUT = RESULTS / "arena"
SLO_TTFT, SLO_PER_KTOK, SLO_TPOT, ATTAINMENT = 1.0, 0.05, 0.1, 0.9
WINDOW_S = 120.0  # each probed rate offers its load for at least this long (`--max-load-window`)
REL_TOL = 0.05  # the max-load search's resolution
SEEDS = "1,2,3"  # evaluated; the tuning seed (`spindle sim compare --tune-seed`, 99) is not among them
TUNE_BUDGET = 8
STRATEGIES = ("spindle", "tetris", "loongserve", "medha", "csps", "seesaw")


@dataclass(frozen=True)
class Rules:
    """How a cell is judged (the module docstring); `--quick` relaxes them for a smoke run, and says so."""

    seeds: str = SEEDS
    window_s: float = WINDOW_S
    rel_tol: float = REL_TOL
    tune_budget: int = TUNE_BUDGET  # 0: no search (each strategy as configured)

    def argv(self, rate: float) -> list[str]:
        tune = ["--tune", "--tune-budget", str(self.tune_budget)] if self.tune_budget else []
        return [
            "--seeds", self.seeds, "--slo-ttft", f"{SLO_TTFT:g}", "--slo-ttft-per-ktok", f"{SLO_PER_KTOK:g}",
            "--slo-tpot", f"{SLO_TPOT:g}", "--max-load", "--max-load-attainment", f"{ATTAINMENT:g}",
            "--start-rate", f"{rate:g}", "--max-load-window", f"{self.window_s:g}", "--rel-tol", f"{self.rel_tol:g}",
            *tune,
        ]  # fmt: skip


@dataclass(frozen=True)
class Scenario:
    workload: str
    arrival: str
    cv: float
    about: str


@dataclass(frozen=True)
class Cluster:
    model: str
    hardware: str
    nodes: int
    rate: float  # the load point of the fixed-rate run (req/s)
    about: str


SCENARIOS = {
    "chat": Scenario("mixed-chat", "poisson", 1.0, "chat + 2 % long documents"),
    "diurnal": Scenario("mixed-diurnal", "poisson", 1.0, "long share drifting 1 % -> 20 %"),
    "bursty": Scenario("mixed-chat", "gamma", 4.0, "chat + 2 % documents, gamma arrivals cv 4"),
    "batch": Scenario("mixed-batch", "poisson", 1.0, "chat traffic + a batch job (10 %) midway"),
}


@dataclass(frozen=True)
class PaperCell:
    """A paper's own workload and cluster (as its `bench/paper_*.py` runs it), its strategy against `spindle`."""

    strategy: str
    workload: str
    model: str
    hardware: str
    nodes: int
    rate: float
    extra: tuple[str, ...] = ()  # further `spindle sim compare` flags


PAPERS = {
    "tetris": PaperCell("tetris", "tetris-medium", "llama3-8b", "a100-80g", 4, 4.0),
    "loongserve": PaperCell("loongserve", "loongserve-mixed", "lwm-1m-text", "a100-80g", 1, 0.2,
                            ("--decode-tp", "2")),
    "medha": PaperCell("medha", "medha-mix", "llama3-8b", "a100-80g", 2, 0.75),
    "csps": PaperCell("csps", "csps-needlebench", "glm-4-9b-1m", "a100-40g-p4d", 8, 0.5),
    "seesaw": PaperCell("seesaw", "seesaw-arxiv", "codellama-34b", "a10", 1, 4.0,
                        ("--decode-tp", "4", "--prefill-tp", "4")),
}  # fmt: skip

CLUSTERS = {
    "a100": Cluster("llama3-8b", "a100-80g", 4, 8.0, "Llama-3-8B, 32 A100-80GB (4 nodes)"),
    "h100": Cluster("llama3-70b", "h100-sxm", 8, 4.0, "Llama-3-70B, 64 H100-SXM (8 nodes)"),
}


def compare_argv(
    cluster: Cluster, scenario: Scenario, strategies: tuple[str, ...], n: int, stem: Path, rules: Rules
) -> list[str]:
    return [
        "--workload", scenario.workload, "--arrival", scenario.arrival, "--cv", f"{scenario.cv:g}",
        "--model", cluster.model, "--hardware", cluster.hardware, "--nodes", str(cluster.nodes),
        "--num-requests", str(n), "--rate", f"{cluster.rate:g}", *rules.argv(cluster.rate),
        "--strategies", *strategies, "--json", str(stem.with_suffix(".json")), "--plot", str(stem.with_suffix(".png")),
    ]  # fmt: skip


def paper_argv(cell: PaperCell, n: int, stem: Path, rules: Rules) -> list[str]:
    """The paper's workload and cluster, the arena's SLO and rules, the paper's strategy and `spindle`."""
    return [
        "--workload", cell.workload, "--model", cell.model, "--hardware", cell.hardware, "--nodes", str(cell.nodes),
        *cell.extra, "--num-requests", str(n), "--rate", f"{cell.rate:g}", *rules.argv(cell.rate),
        "--strategies", cell.strategy, "spindle",
        "--json", str(stem.with_suffix(".json")), "--plot", str(stem.with_suffix(".png")),
    ]  # fmt: skip


def run_cell(name: str, argv: list[str]) -> tuple[str, dict[str, Any], str, float]:
    """One `spindle sim compare` in this process: (cell, its JSON, what it printed, wall seconds)."""
    from spindle_sim.compare import compare_main

    started = time.perf_counter()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = compare_main(argv)
    if code != 0:
        raise RuntimeError(f"{name}: spindle sim compare exited {code}:\n{out.getvalue()}")
    doc = json.loads(Path(argv[argv.index("--json") + 1]).read_text())
    return name, doc, out.getvalue(), time.perf_counter() - started


def verdict(doc: dict[str, Any]) -> dict[str, Any]:
    """`spindle`'s standing in the cell on goodput and max load: "wins" (the best mean, its seeds' range clear of
    every other's), "tie" (ranges overlap the best's), or "trails" (another wins), with the ratio of its mean to the
    best other strategy's (its tuned configuration; `@paper` variants count as others)."""
    rows = doc["strategies"]
    ours = next((k for k in rows if k.split(":")[0] == "spindle"), None)
    if ours is None:
        return {"strategy": None, "skipped": doc["cluster"]["skipped"]}
    out: dict[str, Any] = {"strategy": ours}
    from spindle_sim.seeds import verdicts

    judged = verdicts(rows, len(doc["workload"].get("seeds") or [0]))  # the current rule, also on `--merge`
    for key in ("goodput_rps", "max_load_rps"):
        others = {k: v[key] for k, v in rows.items() if not k.startswith("spindle") and v[key] is not None}
        best = max(others, key=lambda k: others[k]) if others else None
        mine = rows[ours][key]
        ratio = None if best is None or not others[best] or mine is None else mine / others[best]
        v = judged.get(key)
        if v is None:
            standing = "one seed"
        elif v["best"] == ours:
            standing = "wins" if v["result"] == "wins" else "tie"
        else:
            standing = "tie" if ours in v["tied_with"] else "trails"
        out[key] = {"ours": mine, "best_other": best, "best_other_value": others.get(best), "ratio": ratio,
                    "standing": standing, "best": None if v is None else v["best"]}  # fmt: skip
    return out


def markdown_table(cells: dict[str, dict[str, Any]]) -> str:
    """Every strategy x cell: its configuration, goodput (range over the seeds), SLO attainment, rejected, P50/P99
    TTFT and TPOT, max load (range), batch JCT."""
    head = "| cluster | workload | strategy | configuration | goodput req/s | SLO att. | rejected | TTFT p50 / p99 s "
    head += "| TPOT p50 / p99 ms | max load req/s | batch JCT s |\n|---|---|---|---|---|---|---|---|---|---|---|"
    lines = [head]
    for cell, doc in cells.items():
        cluster, scenario = cell.split(":")
        for spec, d in doc["strategies"].items():
            ttft, tpot = d["interactive_ttft_s"] or {}, d["interactive_tpot_s"] or {}
            config = d.get("config") or {}
            tuned = config.get("tuned")
            what = config.get("gpus") or "-"
            if tuned:
                what += "; " + ", ".join(f"{k}={v}" for k, v in tuned.items())
            spread = d.get("spread") or {}
            jct = d["batch_jct_s"]
            lines.append(
                f"| {cluster} | {scenario} | {spec.split(':')[0]} | {what} | "
                f"{_ranged(d['goodput_rps'], spread.get('goodput_rps'), 2)} | {_pct(d['slo_attainment'])} | "
                f"{_f(d.get('rejected'), 1)} | {_f(ttft.get('p50'), 2)} / {_f(ttft.get('p99'), 1)} | "
                f"{_f(_ms(tpot.get('p50')), 0)} / {_f(_ms(tpot.get('p99')), 0)} | "
                f"{_ranged(d['max_load_rps'], spread.get('max_load_rps'), 1)} | "
                f"{'-' if jct is None and 'batch' not in scenario else _f(jct, 0)} |"
            )
    return "\n".join(lines)


def _ranged(mean: float | None, spread: list[float] | None, digits: int) -> str:
    """'8.31 (8.12-8.40)': the seeds' mean and range."""
    if mean is None or not spread or spread[0] == spread[1]:
        return _f(mean, digits)
    return f"{mean:.{digits}f} ({spread[0]:.{digits}f}-{spread[1]:.{digits}f})"


def _ms(x: float | None) -> float | None:
    return None if x is None else 1e3 * x


def _f(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def merged(
    path: Path, cells: dict[str, dict[str, Any]], jobs: dict[str, list[str]], walls: dict[str, float], rules: Rules
) -> dict[str, Any]:
    """The results file with this run's cells added (a run of some cells keeps the others' results)."""
    old = json.loads(path.read_text()) if path.exists() else {}
    all_cells = {**{k: v for k, v in old.get("cells", {}).items() if k not in cells}, **cells}
    commands = {k: "spindle sim compare " + shlex.join(a) for k, a in jobs.items()}
    slo = {"ttft_s": SLO_TTFT, "ttft_per_ktok_s": SLO_PER_KTOK, "tpot_s": SLO_TPOT, "attainment": ATTAINMENT}
    rule = asdict(rules)
    papers = {
        k: f"{v.strategy} on {v.workload}, {v.model} on {v.nodes} node(s) of {v.hardware}" for k, v in PAPERS.items()
    }
    counts = old.get("num_requests") if isinstance(old.get("num_requests"), dict) else {}
    return {
        "slo": slo,
        "rules": rule,
        "num_requests": counts | {k: int(a[a.index("--num-requests") + 1]) for k, a in jobs.items()},
        "clusters": {k: v.about for k, v in CLUSTERS.items()},
        "scenarios": {k: v.about for k, v in SCENARIOS.items()},
        "papers": papers,
        "commands": old.get("commands", {}) | commands,
        "wall_s": old.get("wall_s", {}) | walls,
        "verdicts": {name: verdict(doc) for name, doc in all_cells.items()},
        "cells": all_cells,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="+", help="cluster:scenario cells, or paper:NAME (default: every mixed cell)")
    p.add_argument("--papers", action="store_true", help="also each paper's own workload and cluster (paper:NAME)")
    p.add_argument("--num-requests", type=int, default=600)
    p.add_argument("--jobs", type=int, default=2, help="cells run in parallel (processes)")
    p.add_argument("--compare-jobs", type=int, default=1, metavar="N",
                   help="strategies of a cell simulated at once (`spindle sim compare --jobs`; default 1)")  # fmt: skip
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    p.add_argument("--seeds", default=SEEDS, help=f"evaluation seeds (default {SEEDS})")
    p.add_argument("--window", type=float, default=WINDOW_S, help=f"seconds of load per probed rate ({WINDOW_S:g})")
    p.add_argument(
        "--tune-budget", type=int, default=TUNE_BUDGET,
        help=f"runs of each strategy's configuration search (default {TUNE_BUDGET}; 0: no search, no @paper rows)",
    )  # fmt: skip
    p.add_argument(
        "--quick", action="store_true",
        help="a smoke run under relaxed rules: 200 requests, one seed, 20-s windows, no search, A100 chat",
    )  # fmt: skip
    p.add_argument(
        "--merge", action="store_true",
        help="run nothing: merge the cells' JSON already written in bench/results/arena/ (after a run that stopped)",
    )  # fmt: skip
    args = p.parse_args()
    names = args.cells or [f"{c}:{s}" for c in CLUSTERS for s in SCENARIOS]
    if args.papers:
        names += [f"paper:{k}" for k in PAPERS if f"paper:{k}" not in names]
    n = args.num_requests
    rules = Rules(args.seeds, args.window, REL_TOL, args.tune_budget)
    if args.quick:
        names, n = args.cells or ["a100:chat"], 200
        rules = Rules("1", 20.0, 0.1, 0)
    out_dir = OUT.with_name("arena_quick") if args.quick else OUT  # a smoke run keeps the real cells' files
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs: dict[str, list[str]] = {}
    for name in names:
        cluster, scenario = name.split(":")
        stem = out_dir / f"{cluster}-{scenario}"
        if cluster == "paper":
            jobs[name] = paper_argv(PAPERS[scenario], min(n, 300), stem, rules)
        else:
            jobs[name] = compare_argv(CLUSTERS[cluster], SCENARIOS[scenario], tuple(args.strategies), n, stem, rules)
        if args.compare_jobs != 1:
            jobs[name] += ["--jobs", str(args.compare_jobs)]
        print("spindle sim compare " + shlex.join(jobs[name]))
    cells: dict[str, dict[str, Any]] = {}
    walls: dict[str, float] = {}
    failed: dict[str, str] = {}
    if args.merge:
        for name, argv in jobs.items():
            written = Path(argv[argv.index("--json") + 1])
            if written.exists():
                cells[name] = json.loads(written.read_text())
            else:
                failed[name] = f"no {written}"
    else:
        from tqdm import tqdm

        with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {pool.submit(run_cell, name, argv): name for name, argv in jobs.items()}
            for f in tqdm(as_completed(futures), total=len(futures), desc="arena cells"):
                try:
                    name, doc, printed, wall = f.result()
                except RuntimeError as e:  # one cell failing keeps the others' results
                    failed[futures[f]] = str(e)
                    tqdm.write(f"\n== {futures[f]} FAILED\n{e}")
                    continue
                cells[name], walls[name] = doc, wall
                tqdm.write(f"\n== {name} ({wall:.0f} s)\n{printed}")
    cells = {name: cells[name] for name in jobs if name in cells}  # in the order asked
    jobs = {name: argv for name, argv in jobs.items() if name in cells}
    path = RESULTS / ("arena_quick.json" if args.quick else "arena.json")
    summary = merged(path, cells, jobs, walls, rules)
    table = markdown_table(summary["cells"])
    print(table)
    for name, v in summary["verdicts"].items():
        if v["strategy"] is None:
            print(f"{name}: spindle did not run: {v['skipped']}")
            continue
        g, m = v["goodput_rps"], v["max_load_rps"]
        print(f"{name}: goodput {g['standing']} (x{_f(g['ratio'], 2)} of {g['best_other']}), max load "
              f"{m['standing']} (x{_f(m['ratio'], 2)} of {m['best_other']})")  # fmt: skip
    path.write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "table.md").write_text(table + "\n")
    print(f"wrote {path}, {out_dir}/table.md and one PNG per cell in {out_dir}")
    if failed:
        raise SystemExit("cells that did not run: " + "; ".join(f"{k}: {v.splitlines()[0]}" for k, v in failed.items()))


if __name__ == "__main__":
    main()
