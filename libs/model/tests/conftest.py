"""Shared fixtures: the real SmolLM2 GGUF, converted once per test session into a temporary cache."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from gguf import GGUFReader

from spindle_model import Tokenizer
from spindle_model.sources import ModelSource, known_model_gguf, resolve_model

# Never reach for the hub, whatever a test does. spindle_model imports transformers lazily, so this still runs first.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@dataclass(frozen=True)
class Converted:
    source: ModelSource
    cache_dir: Path
    gguf_path: Path
    seconds: float


@pytest.fixture(scope="session")
def smollm2_converted(tmp_path_factory: pytest.TempPathFactory) -> Converted:
    cache_dir = tmp_path_factory.mktemp("spindle-cache")
    start = time.perf_counter()
    source = resolve_model("smollm2", cache_dir=cache_dir, progress=False)
    seconds = time.perf_counter() - start
    print(f"\n[spindle_model] first resolve of smollm2 (GGUF conversion): {seconds:.2f} s")
    return Converted(source, cache_dir, known_model_gguf("smollm2"), seconds)


@pytest.fixture(scope="session")
def smollm2_source(smollm2_converted: Converted) -> ModelSource:
    return smollm2_converted.source


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_converted: Converted) -> Path:
    return smollm2_converted.gguf_path


@pytest.fixture(scope="session")
def gguf_reader(smollm2_gguf: Path) -> GGUFReader:
    return GGUFReader(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_source: ModelSource) -> Tokenizer:
    return Tokenizer(smollm2_source.path)
