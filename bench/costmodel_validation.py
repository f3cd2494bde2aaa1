"""The cost model against every published and measured number it is held to: a table, JSON and a plot.

    python bench/costmodel_validation.py [--cpu-profile bench/results/cpu_profile.json]

Rows come from `spindle_costmodel.validation` (the same checks the tests assert): Tetris Table 1 and Fig. 2,
Medha Fig. 2 and 11, LoongServe Sec. 2.4 and Fig. 2/3, Seesaw Fig. 1 and 3, CSPS Table 3, whole decoder layers
measured on an H100 (`bench/gpu_ops.py`), and, with a profile of this machine, the CPU engine's held-out
samples. Writes bench/results/costmodel_validation.json and .png (predicted vs published/measured, log-log).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spindle_costmodel.validation import Check, h100_layers, paper_checks

RESULTS = Path(__file__).parent / "results"


def cpu_checks(profile: Path) -> list[Check]:
    """The held-out samples of a `spindle profile` run (its "device" section), as measured checks."""
    doc = json.loads(profile.read_text())
    device = doc.get("device")
    if not device:
        raise SystemExit(f"{profile} has no device section: run `spindle profile` again")
    checks = []
    for r in device["validation"]:
        if r.get("split", "heldout") != "heldout":
            continue
        what = f"C{r['history']} L{r['tokens']}" if r["kind"] == "prefill" else f"b{r['batch']} kv{r['kv_tokens']}"
        name = f"CPU {r['kind']} SP{r.get('sp', 1)} {what}"
        checks.append(Check(name, "spindle profile", r["measured_s"], r["predicted_s"], 0.2, unit="s", kind="cpu"))
    return checks


def table(checks: list[Check]) -> str:
    lines = [f"{'source':<25}{'check':<42}{'reference':>12}{'model':>12}{'error':>9}{'tol':>6}  ok"]
    for c in checks:
        tol = "dir" if c.tolerance is None else f"{c.tolerance:.0%}"
        err = f"{c.error:+.1%}" if c.tolerance is not None else ""
        ok = "yes" if c.passed else "NO"
        lines.append(f"{c.source:<25}{c.name:<42}{c.reference:>12.4g}{c.model:>12.4g}{err:>9}{tol:>6}  {ok}")
    return "\n".join(lines)


def plot(checks: list[Check], path: Path) -> None:
    """Left: predicted vs reference seconds (log-log). Right: every magnitude check's error, by source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sized = [c for c in checks if c.tolerance is not None]
    sources = list(dict.fromkeys(c.source for c in sized))
    colors = dict(zip(sources, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 2, strict=False))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [1, 1.3]})
    seconds = [c for c in sized if c.unit == "s"]
    for source in dict.fromkeys(c.source for c in seconds):
        pts = [c for c in seconds if c.source == source]
        left.scatter([c.reference for c in pts], [c.model for c in pts], color=colors[source], label=source, s=22)
    lo, hi = min(c.reference for c in seconds) / 2, max(c.reference for c in seconds) * 2
    left.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    left.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="grey", alpha=0.2, label="±15 %")
    left.set(xscale="log", yscale="log", xlabel="published / measured seconds", ylabel="cost model seconds")
    left.set_title("latencies")
    left.legend(fontsize=8)
    left.grid(True, which="both", alpha=0.3)
    for i, source in enumerate(sources):
        pts = [c for c in sized if c.source == source]
        xs = [i + (j - len(pts) / 2) * 0.6 / max(len(pts), 1) for j in range(len(pts))]
        right.scatter(xs, [100 * c.error for c in pts], color=colors[source], s=18)
        tol = max(c.tolerance for c in pts)  # type: ignore[type-var]
        right.hlines([-100 * tol, 100 * tol], i - 0.4, i + 0.4, colors=colors[source], linestyles="dashed", lw=1)
    right.axhline(0, color="k", lw=0.8)
    right.set_xticks(range(len(sources)), sources, rotation=30, ha="right", fontsize=8)
    right.set_ylabel("model / reference - 1 (%); dashed: tolerance")
    right.set_title("every magnitude check")
    right.grid(True, axis="y", alpha=0.3)
    fig.suptitle("spindle_costmodel against the papers and measurements")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-profile", type=Path, help="a `spindle profile` JSON with a device section")
    p.add_argument("--h100", type=Path, default=RESULTS / "gpu_ops_h100.json", help="a bench/gpu_ops.py run")
    p.add_argument("--out", type=Path, default=RESULTS / "costmodel_validation.json")
    args = p.parse_args()
    checks = paper_checks() + h100_layers(args.h100)
    if args.cpu_profile:
        checks += cpu_checks(args.cpu_profile)
    print(table(checks))
    failed = [c.name for c in checks if not c.passed]
    print(f"\n{len(checks) - len(failed)}/{len(checks)} checks pass" + (f"; failing: {failed}" if failed else ""))
    args.out.write_text(json.dumps({"checks": [c.to_dict() for c in checks]}, indent=1))
    plot(checks, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
