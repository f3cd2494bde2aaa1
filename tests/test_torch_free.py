"""The policy plans and the simulator simulates without torch: `spindle_policy`, `spindle_sim` and the
scheduler service never pull in torch or the engine when imported, `spindle sim` / `spindle sim compare` /
`spindle cost` run with torch made unimportable, and the launcher's base install (no `[serve]` extra) needs no
package that depends on torch.

Checked in fresh interpreters, since this test session has long imported torch for other tests."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("torch", "spindle_engine", "spindle_model", "spindle_transfer", "spindle_tokenizer")
PACKAGES = ("spindle_policy", "spindle_sim", "spindle_scheduler")
# Named so that a rename or a broken walk cannot skip them; every other module is found by walking the packages.
MODULES = (
    "spindle_scheduler.__main__",  # imported as a module: its main() runs only as __main__
    "spindle_scheduler.service",
    "spindle_sim.cli",
    "spindle_sim.commands",
    "spindle_policy.profile_data",
    "spindle_policy.strategies",
)

IMPORTS = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    modules, packages, forbidden = {modules!r}, {packages!r}, {forbidden!r}
    for name in modules:
        importlib.import_module(name)
    walked = []
    for package in packages:
        root = importlib.import_module(package)
        walked += [m.name for m in pkgutil.walk_packages(root.__path__, package + ".")]
    assert any(name.startswith("spindle_policy.strategies.") for name in walked), "no strategy modules found"
    for name in walked:
        if not name.endswith("__main__"):
            importlib.import_module(name)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in forbidden)
    assert not loaded, f"importing the policy, the simulator or the scheduler service loaded {{loaded}}"
    print(len(set(walked)), "modules")
    """
)

# torch and the engine made unimportable, then the `spindle` command line as a user types it
BLOCKED_CLI = textwrap.dedent(
    """
    import sys
    for name in {forbidden!r}:
        sys.modules[name] = None
    from spindle_launcher.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def _run(code: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_policy_sim_and_scheduler_import_without_torch_or_the_engine() -> None:
    result = _run(IMPORTS.format(modules=MODULES, packages=PACKAGES, forbidden=FORBIDDEN))
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[0]) > 60


def test_spindle_sim_and_cost_run_without_torch() -> None:
    code = BLOCKED_CLI.format(forbidden=FORBIDDEN)
    sim = _run(code, "sim", "--strategy", "tetris", "--num-requests", "20", "--rate", "2", "--seed", "1")
    assert sim.returncode == 0, sim.stderr
    assert "tetris on tetris-short" in sim.stdout and "throughput" in sim.stdout
    compare = _run(
        code, "sim", "compare", "--strategies", "spindle", "medha", "--num-requests", "20", "--rate", "2", "--seed", "1"
    )
    assert compare.returncode == 0, compare.stderr
    assert "medha" in compare.stdout and "spindle" in compare.stdout
    cost = _run(code, "cost", "prefill", "--model", "llama3-8b", "--hardware", "a100-80g", "--tokens", "100000")
    assert cost.returncode == 0, cost.stderr
    assert "attention" in cost.stdout


def test_spindle_up_without_the_serving_extra_says_what_to_install() -> None:
    result = _run(BLOCKED_CLI.format(forbidden=FORBIDDEN), "up", "--model", "smollm2")
    assert result.returncode != 0
    assert "[serve]" in result.stderr and "Traceback" not in result.stderr


def _workspace() -> dict[str, dict]:
    """Every package of the checkout: its name -> its pyproject's [project] table."""
    tables = [tomllib.loads(p.read_text())["project"] for p in ROOT.glob("*/*/pyproject.toml")]
    return {t["name"]: t for t in tables}


def _closure(name: str, workspace: dict[str, dict], seen: set[str]) -> set[str]:
    """`name` and everything its base dependencies pull in (workspace packages followed; others as named)."""
    if name in seen:
        return seen
    seen.add(name)
    for requirement in workspace.get(name, {}).get("dependencies", []):
        _closure(Requirement(requirement).name, workspace, seen)
    return seen


def test_the_launchers_base_install_needs_no_torch() -> None:
    workspace = _workspace()
    assert {"spindle-policy", "spindle-sim", "spindle-scheduler", "spindle-launcher"} <= set(workspace)
    for package in ("spindle-launcher", "spindle-sim", "spindle-policy", "spindle-scheduler"):
        pulled = _closure(package, workspace, set())
        torchy = {p for p in pulled if p in ("torch", "triton") or p in ("spindle-engine", "spindle-model")}
        assert not torchy, f"{package}'s base install pulls {sorted(torchy)}"
    # ...and the serving extra is what brings the engine in
    assert "spindle-engine" in workspace["spindle-launcher"]["optional-dependencies"]["serve"]
