"""Loading safetensors checkpoints (single file, sharded with an index, or loose shards) into a state dict."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def safetensors_files(path: Path) -> list[Path]:
    """The safetensors files making up the checkpoint at `path` (a directory or one `.safetensors` file)."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"not a safetensors file: {path}")
        return [path]
    if not path.is_dir():
        raise ValueError(f"checkpoint path not found: {path}")
    index = path / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"cannot read shard index {index}: {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"shards listed in {index} are missing: {missing}")
        return files
    if (path / _SINGLE).is_file():
        return [path / _SINGLE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {path} (expected {_SINGLE}, {_INDEX} or *.safetensors)")
    return files


def load_state_dict(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Load every tensor of the checkpoint at `path` on CPU; floating-point tensors are cast to `dtype`."""
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        try:
            tensors = load_file(str(file), device="cpu")
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"cannot read safetensors file {file}: {e}") from e
        for name, tensor in tensors.items():
            if name in state:
                raise ValueError(f"tensor {name!r} appears in more than one file under {path}")
            state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state
