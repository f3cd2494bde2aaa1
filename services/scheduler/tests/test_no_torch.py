"""The scheduler plans; it never runs the model: none of its modules pulls in torch or the engine when imported.

Checked in a fresh interpreter, since this test session has long imported torch for other tests."""

from __future__ import annotations

import subprocess
import sys
import textwrap

FORBIDDEN = ("torch", "spindle_engine", "spindle_model", "spindle_transfer")
# Named so that a rename or a broken walk cannot skip them; every other module is found by walking the package.
MODULES = (
    "spindle_scheduler",
    "spindle_scheduler.__main__",  # imported as a module: its main() runs only as __main__
    "spindle_scheduler.service",
    "spindle_scheduler.sim.cli",
    "spindle_scheduler.sim.commands",
    "spindle_scheduler.profile_data",
    "spindle_scheduler.strategies",
)

CHECK = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    modules, forbidden = {modules!r}, {forbidden!r}
    for name in modules:
        importlib.import_module(name)
    import spindle_scheduler
    walked = [m.name for m in pkgutil.walk_packages(spindle_scheduler.__path__, "spindle_scheduler.")]
    assert any(name.startswith("spindle_scheduler.strategies.") for name in walked), "no strategy modules found"
    for name in walked:
        importlib.import_module(name)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in forbidden)
    assert not loaded, f"importing the scheduler loaded {{loaded}}"
    print(len(set(walked)), "modules")
    """
)


def test_scheduler_imports_without_torch_or_the_engine() -> None:
    code = CHECK.format(modules=MODULES, forbidden=FORBIDDEN)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[0]) > len(MODULES)
