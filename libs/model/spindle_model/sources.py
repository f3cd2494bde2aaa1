"""Resolving a model name or path to a Hugging Face style directory (config.json, safetensors, tokenizer files).

Accepted inputs, in this order:
  * a known model name (see `known_model_names()`), e.g. "smollm2", served from a GGUF shipped in a pip package;
  * a path to a `.gguf` file, converted once and cached;
  * a path to a directory with `config.json` and safetensors weights, used as is.

Where things are is `spindle_tokenizer.locate` (torch-free, so that the gateway finds the tokenizer without this
package): GGUF conversions are cached under `<cache>/models/<stem>-<key>`, where `<cache>` is `cache_dir`, else
`$SPINDLE_CACHE_DIR`, else `~/.cache/spindle`, and `<key>` identifies the source file cheaply (size, mtime, a hash
of its first and last MiB, and the converter version).

One conversion per machine: the processes that resolve the same GGUF at once (the services of `spindle up`, all
starting together) take an exclusive `flock` on `<cache>/locks/<stem>-<key>.lock`; the first converts, the others
wait and then find the result. The kernel drops the lock of a process that dies, so a killed conversion blocks
nobody (and its temporary directory is removed by the next conversion).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from spindle_model.config import ModelConfig
from spindle_model.gguf_convert import convert_gguf
from spindle_model.weights import safetensors_files
from spindle_tokenizer.locate import (
    CONVERTER_VERSION,
    ModelLocation,
    default_cache_dir,
    gguf_cache_key,
    is_converted,
    known_model_gguf,
    known_model_names,
    locate_model,
)

__all__ = [
    "CONVERTER_VERSION",
    "ModelSource",
    "default_cache_dir",
    "gguf_cache_key",
    "known_model_gguf",
    "known_model_names",
    "resolve_model",
]

logger = logging.getLogger("spindle.model")


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: a display name, its Hugging Face style directory, its config, and the GGUF file it was
    converted from (None for a Hugging Face directory)."""

    name: str
    path: Path
    config: ModelConfig
    gguf: Path | None = None


def _remove_stale_temporaries(dest: Path, older_than_s: float = 3600.0) -> None:
    # convert_gguf builds in `.<name>.tmp-*` beside `dest`; a killed conversion leaves one behind. An hour-old one
    # cannot belong to a conversion still running (they take seconds); under the conversion lock, none can.
    for tmp in dest.parent.glob(f".{dest.name}.tmp-*"):
        try:
            if time.time() - tmp.stat().st_mtime >= older_than_s:
                logger.info("removing leftover temporary directory %s", tmp)
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


@contextlib.contextmanager
def _conversion_lock(dest: Path) -> Iterator[None]:
    """Hold the exclusive lock of converting into `dest`, waiting for whoever holds it (logged once)."""
    # Beside models/, not in it: lock files are never removed (unlinking a flock'd file races with its waiters).
    locks = dest.parent.parent / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    fd = os.open(locks / f"{dest.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process converting into %s", dest)
            start = time.perf_counter()
            fcntl.flock(fd, fcntl.LOCK_EX)
            logger.info("waited %.1f s for the conversion into %s", time.perf_counter() - start, dest)
        yield
    finally:
        os.close(fd)  # releases the lock


def _from_gguf(location: ModelLocation, progress: bool) -> ModelSource:
    dest, gguf_path = location.path, location.gguf
    assert gguf_path is not None
    if is_converted(dest):
        logger.debug("using cached conversion %s of %s", dest, gguf_path)
    else:
        with _conversion_lock(dest):
            if dest.exists() and not is_converted(dest):
                logger.warning("removing incomplete cached conversion %s", dest)
                shutil.rmtree(dest)
            if is_converted(dest):  # another process converted it while this one waited
                logger.info("using %s, converted by another process", dest)
            else:
                if dest.parent.is_dir():
                    _remove_stale_temporaries(dest, older_than_s=0.0)
                logger.info("converting %s into %s (first use of this file)", gguf_path, dest)
                start = time.perf_counter()
                convert_gguf(gguf_path, dest, progress=progress)
                logger.info("model %s ready in %.1f s", location.name, time.perf_counter() - start)
    return ModelSource(name=location.name, path=dest, config=ModelConfig.from_dir(dest), gguf=gguf_path)


def resolve_model(name_or_path: str, *, cache_dir: Path | None = None, progress: bool = True) -> ModelSource:
    """Resolve a known model name, a `.gguf` file or a Hugging Face model directory to a `ModelSource`, converting
    a GGUF on its first use (see `spindle_tokenizer.locate_model` for what is accepted).

    Known names win over same-named relative paths; write `./smollm2` to mean the directory.
    """
    location = locate_model(name_or_path, cache_dir=cache_dir)
    if location.gguf is not None:
        return _from_gguf(location, progress)
    config = ModelConfig.from_dir(location.path)
    safetensors_files(location.path)  # fail now, not at load time, when there are no weights
    return ModelSource(name=location.name, path=location.path, config=config)
