"""Shared fixtures: the real SmolLM2 GGUF converted once per session (by spindle_model: the tests may use torch,
the package may not) into a temporary cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spindle_tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from spindle_model import resolve_model

    cache = tmp_path_factory.mktemp("spindle-cache")
    resolve_model("smollm2", cache_dir=cache, progress=False)
    return cache


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_cache: Path) -> Path:
    (path,) = (smollm2_cache / "models").iterdir()
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)
