import importlib.util
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="session")
def stand_ins() -> ModuleType:
    """tests/stand_ins.py (stand-in services), loaded by path: the tests folder is not a package."""
    spec = importlib.util.spec_from_file_location(
        "spindle_launcher_stand_ins", Path(__file__).with_name("stand_ins.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
