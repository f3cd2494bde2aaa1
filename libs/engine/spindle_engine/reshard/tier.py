"""A re-sharding group's host KV tier on one node (Seesaw Fig. 7): one `HostKV` file per request in a directory of
shared memory every process of the group maps. A prefill rank writes its layers x its KV heads of a prompt straight
from its paged cache; a decode rank reads every layer x its heads into its own. Each side moves exactly its shard.

`TierPut` names one write on the wire (inside a pipeline step or a tensor-parallel call); the receiving rank checks
that the file lies in its group's tier directory and that the table fits its cache before touching anything.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import torch
from torch import Tensor

from spindle_model import ModelConfig

from ..kv_cache import KVCache
from ..sampling_params import SamplingParams
from .host_kv import HostKV


class TierPut(msgspec.Struct, frozen=True):
    """Write the KV of a sequence's first `tokens` tokens (blocks `table`) to the tier file `name`, made for
    `capacity` tokens."""

    name: str
    table: list[int]
    tokens: int
    capacity: int


def tier_dir(instance_id: str, root: str = "") -> Path:
    """The group's tier directory (under /dev/shm where it exists: RAM, not disk)."""
    base = Path(root or ("/dev/shm" if Path("/dev/shm").is_dir() else "/tmp"))
    return base / f"spindle-{instance_id}-tier"


def weights_path(instance_id: str, root: str = "") -> Path:
    """Where the group's leader publishes the model's weights once (`HostWeights`)."""
    return tier_dir(instance_id, root) / "weights"


def open_kv(directory: Path, name: str, model: ModelConfig, capacity: int, dtype: torch.dtype, create: bool) -> HostKV:
    """The tier file `name` of `capacity` tokens; ValueError for a name that is not a plain file name."""
    if not name or "/" in name or name.startswith(".") or name == "weights":
        raise ValueError(f"not a tier file name: {name!r}")
    if capacity < 1:
        raise ValueError(f"a tier file of {capacity} tokens")
    return HostKV(directory / name, model.num_layers, model.num_kv_heads, capacity, model.head_dim, dtype, create)


def push_cache(store: HostKV, cache: KVCache, put: TierPut, first_layer: int, heads: tuple[int, int]) -> int:
    """This rank's layers (from `first_layer`) x `heads` of `put`'s sequence, from `cache` into `store`; the bytes."""
    if put.tokens > put.capacity or len(put.table) * cache.block_size < put.tokens:
        raise ValueError(f"a tier write of {put.tokens} tokens into {len(put.table)} blocks / {put.capacity} tokens")
    num_blocks = cache.k.shape[1]
    if any(not 0 <= b < num_blocks for b in put.table):
        raise ValueError(f"a tier write names a block outside [0, {num_blocks})")
    kv = cache.gather(put.table, put.tokens).cpu()  # [2, local layers, tokens, local kv heads, D]
    for layer in range(kv.shape[1]):
        store.push(first_layer + layer, heads, 0, kv[0, layer], kv[1, layer])
    return kv.numel() * kv.element_size()


def push_kv(store: HostKV, kv: Tensor, heads: tuple[int, int]) -> int:
    """Every layer of `heads` from `kv` `[2, layers, tokens, local kv heads, D]` (a decode rank's); the bytes."""
    for layer in range(kv.shape[1]):
        store.push(layer, heads, 0, kv[0, layer], kv[1, layer])
    return kv.numel() * kv.element_size()


@dataclass
class TierEntry:
    """A request whose KV is in the tier: what it needs to resume decoding."""

    name: str
    capacity: int  # tokens the file holds
    token_ids: list[int]  # prompt and outputs so far; the KV covers all but the last
    num_prompt_tokens: int
    params: SamplingParams


class HostTier:
    """The leader's index of the group's tier: which request's KV is in which file, and the room left."""

    def __init__(self, directory: Path, model: ModelConfig, dtype: torch.dtype, capacity_tokens: int) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"the host KV tier needs room for at least one token, got {capacity_tokens}")
        self.dir, self.model, self.dtype = directory, model, dtype
        self.capacity_tokens = capacity_tokens
        self.entries: dict[str, TierEntry] = {}
        self.reserved: dict[str, tuple[str, int]] = {}  # request -> (file, tokens) being written
        self._names = itertools.count()
        self.bytes_in = self.bytes_out = 0  # over the group: written to / read from the tier
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def used_tokens(self) -> int:
        return sum(e.capacity for e in self.entries.values()) + sum(n for _, n in self.reserved.values())

    def bytes_per_token(self) -> int:
        return KVCache.bytes_per_token(self.model.num_layers, self.model.num_kv_heads, self.model.head_dim, self.dtype)

    def reserve(self, request_id: str, tokens: int) -> str:
        """A new file for `tokens` tokens of `request_id`'s KV; ValueError when the tier has no room."""
        if request_id in self.entries or request_id in self.reserved:
            raise ValueError(f"{request_id} is in the host tier already")
        if self.used_tokens + tokens > self.capacity_tokens:
            raise ValueError(f"the host KV tier is full ({self.used_tokens} of {self.capacity_tokens} tokens held, "
                             f"{tokens} more asked)")  # fmt: skip
        name = f"{next(self._names)}.kv"
        open_kv(self.dir, name, self.model, tokens, self.dtype, create=True)
        self.reserved[request_id] = (name, tokens)
        return name

    def landed(
        self, request_id: str, token_ids: list[int], num_prompt_tokens: int, params: SamplingParams
    ) -> TierEntry:
        """Its KV is written (by every rank): the request waits in the tier."""
        name, tokens = self.reserved.pop(request_id)
        entry = self.entries[request_id] = TierEntry(name, tokens, list(token_ids), num_prompt_tokens, params)
        self.bytes_in += tokens * self.bytes_per_token()
        return entry

    def taken(self, request_id: str) -> TierEntry:
        """Onboarded (every rank read its heads): the file goes."""
        entry = self.entries.pop(request_id)
        self.bytes_out += (len(entry.token_ids) - 1) * self.bytes_per_token()
        self._unlink(entry.name)
        return entry

    def drop(self, request_id: str) -> bool:
        """Forget `request_id` (aborted, failed); False when the tier does not hold it."""
        entry = self.entries.pop(request_id, None)
        reserved = self.reserved.pop(request_id, None)
        for name in [e for e in (entry and entry.name, reserved and reserved[0]) if e]:
            self._unlink(name)
        return entry is not None or reserved is not None

    def close(self) -> None:
        for rid in [*self.entries, *self.reserved]:
            self.drop(rid)

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.dir / name)


def read_share(store: HostKV, heads: tuple[int, int], tokens: int) -> Tensor:
    """Every layer x `heads` of the first `tokens` tokens -> `[2, layers, tokens, local kv heads, D]` (what
    `Engine.resume` takes), as a plain byte copy in numpy (one thread: it runs beside the engine thread's OpenMP team
    without joining it)."""
    capacity = store.shape[3]
    if tokens > capacity:
        raise ValueError(f"{tokens} tokens asked of a tier file of {capacity}")
    part = store.kv[:, :, heads[0] : heads[1], :tokens]  # [L, 2, h, T, D]
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[part.element_size()]
    arr = np.ascontiguousarray(part.view(as_int).numpy().transpose(1, 0, 3, 2, 4))
    store.pulled += arr.nbytes
    return torch.from_numpy(arr).view(part.dtype)


class Prefetcher:
    """Seesaw's swap-in prefetcher (§5.2) for one rank: `start` reads the rank's heads of a request's KV out of its
    tier file on a background thread while the engine keeps stepping; `take` hands them over at the resume (waiting
    only for what is not read yet)."""

    def __init__(self, directory: Path, model: ModelConfig, dtype: torch.dtype, heads: tuple[int, int]) -> None:
        self.dir, self.model, self.dtype, self.heads = directory, model, dtype, heads
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tier-prefetch")
        self._reads: dict[str, Future[Tensor]] = {}
        self.busy_s = 0.0  # reading, on the background thread
        self.exposed_s = 0.0  # the resume waited for a read (or read itself, unprefetched)

    def start(self, request_id: str, put: TierPut) -> Future[Tensor]:
        store = open_kv(self.dir, put.name, self.model, put.capacity, self.dtype, create=False)
        future = self._reads[request_id] = self._pool.submit(self._read, store, put.tokens)
        return future

    def _read(self, store: HostKV, tokens: int) -> Tensor:
        t0 = time.perf_counter()
        try:
            return read_share(store, self.heads, tokens)
        finally:
            self.busy_s += time.perf_counter() - t0

    def take(self, request_id: str, put: TierPut, timeout_s: float) -> Tensor:
        t0 = time.perf_counter()
        future = self._reads.pop(request_id, None)
        if future is None:
            future = self.start(request_id, put)
            self._reads.pop(request_id)
        try:
            return future.result(timeout_s)
        finally:
            self.exposed_s += time.perf_counter() - t0

    def drop(self, request_id: str) -> bool:
        """Forget a read (aborted): it runs to its end unseen, so no one waiting on it is cancelled."""
        return self._reads.pop(request_id, None) is not None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reads

    def close(self) -> None:
        self._reads.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
