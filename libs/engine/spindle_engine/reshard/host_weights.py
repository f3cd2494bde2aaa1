"""The model's weights once in shared host memory: one flat file (on Linux under /dev/shm, so RAM) mapped by every
process of a group with `MAP_SHARED`, so a re-sharding process rebuilds its shard from RAM instead of re-reading
the checkpoint, and N processes hold one copy between them (Seesaw §4.1)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor

ALIGN = 64  # bytes: every tensor starts aligned


class HostWeights(Mapping[str, Tensor]):
    """Read-only name -> tensor view of a published weight file."""

    def __init__(self, path: Path) -> None:
        index = json.loads(Path(str(path) + ".json").read_text())
        self.path, self.nbytes = Path(path), int(index["bytes"])
        flat = torch.from_file(str(path), shared=True, size=self.nbytes, dtype=torch.uint8)  # [bytes], mapped
        self._views: dict[str, Tensor] = {}
        for name, (dtype, shape, offset) in index["tensors"].items():
            dt = getattr(torch, dtype)
            n = int(torch.Size(shape).numel()) * dt.itemsize
            self._views[name] = flat[offset : offset + n].view(dt).view(shape)

    @staticmethod
    def publish(state: Mapping[str, Tensor], path: Path) -> HostWeights:
        """Write `state` once to `path` (+ `path.json`, the index) and map it."""
        tensors, offset = {}, 0
        for name, t in state.items():
            tensors[name] = (str(t.dtype).removeprefix("torch."), list(t.shape), offset)
            offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        tmp = Path(str(path) + ".tmp")
        with open(tmp, "wb") as f:
            f.truncate(offset)
        flat = torch.from_file(str(tmp), shared=True, size=offset, dtype=torch.uint8)
        for name, t in state.items():
            _, _, start = tensors[name]
            flat[start : start + t.numel() * t.element_size()].copy_(t.contiguous().view(-1).view(torch.uint8))
        del flat
        os.replace(tmp, path)
        Path(str(path) + ".json").write_text(json.dumps({"bytes": offset, "tensors": tensors}))
        return HostWeights(path)

    @staticmethod
    def remove(path: Path) -> None:
        for p in (Path(path), Path(str(path) + ".json")):
            p.unlink(missing_ok=True)

    def __getitem__(self, name: str) -> Tensor:
        return self._views[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)
