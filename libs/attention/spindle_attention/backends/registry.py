"""The registry of attention backends, and the choice of one per device.

Backends register under a name (`@register_backend("triton")`, as mini-sglang registers its attention
backends). `select_backend(device, requested)` returns one, bound to the device and wired to a fallback:

- `auto` takes the first usable backend of the device's preference order: on CUDA `flash-attn`, then `triton`,
  then `reference`; on CPU `cpu` (the native kernels), then `reference`; elsewhere `reference`. Each backend it
  skips is named, with the reason, in one info line of the logger `spindle.attention`, once per process.
- A backend asked for by name must be usable on the device, else `ValueError` says why (not installed, no
  CUDA, a KV block size its paged kernels cannot read, ...): the choice fails when it is made, not mid-step.
- The fallback (which runs the calls a backend's kernels cannot express) is the next usable backend of the
  device's order after the chosen one, else the reference; the reference itself has none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from .base import AttentionBackend, log

AUTO = "auto"
PREFERENCE: dict[str, tuple[str, ...]] = {
    "cuda": ("flash-attn", "triton", "reference"),
    "cpu": ("cpu", "reference"),
}
DEFAULT_PREFERENCE = ("reference",)

_BACKENDS: dict[str, type[AttentionBackend]] = {}
_skips_logged: set[str] = set()  # backends whose skip by `auto` this process has logged

B = TypeVar("B", bound=type[AttentionBackend])


def register_backend(name: str) -> Callable[[B], B]:
    """Class decorator: register an `AttentionBackend` subclass under `name`."""

    def register(cls: B) -> B:
        if not name or name == AUTO:
            raise ValueError(f"{name!r} cannot name an attention backend")
        if name in _BACKENDS:
            raise ValueError(f"attention backend {name!r} is already registered ({_BACKENDS[name].__name__})")
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return register


def backend_names() -> tuple[str, ...]:
    """Every registered backend's name, sorted."""
    return tuple(sorted(_BACKENDS))


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered under `name`; ValueError listing the known names otherwise."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of: {', '.join((AUTO, *backend_names()))}"
        ) from None


def parse_device(device: str | torch.device) -> torch.device:
    """Parse "cpu", "cuda", "cuda:N" or a torch.device; ValueError when malformed."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be such as 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e


def preference(device: torch.device) -> tuple[str, ...]:
    """The order in which `auto` tries backends on this kind of device."""
    return PREFERENCE.get(device.type, DEFAULT_PREFERENCE)


def available_backends(device: str | torch.device, *, block_size: int | None = None) -> list[str]:
    """The backends usable on `device` (and for a paged cache of `block_size`, when given): the device's
    preference order first, then any other usable ones."""
    dev = parse_device(device)
    order = preference(dev)
    names = list(order) + [n for n in backend_names() if n not in order]
    return [n for n in names if get_backend(n).unavailable(dev, block_size) is None]


def select_backend(
    device: str | torch.device, requested: str = AUTO, *, block_size: int | None = None
) -> AttentionBackend:
    """The backend to run on `device`: `requested` by name, or `auto` (see the module doc).

    `block_size`, the paged KV cache's tokens per block when the caller has one, lets a backend whose paged
    kernels need another block size refuse now. ValueError for an unknown name, a malformed device, or a
    requested backend that cannot run here (with the reason)."""
    dev = parse_device(device)
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if requested != AUTO:
        reason = get_backend(requested).unavailable(dev, block_size)
        if reason is not None:
            raise ValueError(f"attention backend {requested!r} cannot run on {dev}: {reason}")
        return _build(requested, dev, block_size)
    skipped: list[tuple[str, str]] = []
    for name in preference(dev):
        reason = get_backend(name).unavailable(dev, block_size)
        if reason is None:
            for skipped_name, why in skipped:
                if skipped_name not in _skips_logged:
                    _skips_logged.add(skipped_name)
                    log.info("attention backend %r skipped on %s: %s; using %r", skipped_name, dev, why, name)
            return _build(name, dev, block_size)
        skipped.append((name, reason))
    raise AssertionError(f"no attention backend can run on {dev}: {skipped}")  # the reference always can


def _build(name: str, device: torch.device, block_size: int | None) -> AttentionBackend:
    order = preference(device)
    if name in order:
        later = order[order.index(name) + 1 :]
    elif name != "reference":
        later = ("reference",)
    else:
        later = ()
    fallback = next(
        (_build(n, device, block_size) for n in later if get_backend(n).unavailable(device, block_size) is None),
        None,
    )
    return get_backend(name)(device, fallback)
