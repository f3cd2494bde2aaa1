"""Length-prefixed msgspec frames and int64 acks over torch.distributed point-to-point: the framing shared by
the leader -> follower control channels of lockstep groups (tp/control.py, kvp/wire.py). Each channel brings its
own tags, message types and error class."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor

from spindle_attention.distributed import p2p


def wait_all(works: list[dist.Work], timeout_s: float, what: str, error: type[Exception]) -> None:
    """Wait for every operation; a failure or timeout raises `error` naming `what`."""
    try:
        for w in works:
            w.wait(timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise error(f"{what} failed: {e}") from e


def encode_frame(encoder: msgspec.msgpack.Encoder, message: Any) -> tuple[Tensor, Tensor]:
    """`(length [1] int64, payload uint8)`: what a sender posts, length first."""
    payload = torch.frombuffer(bytearray(encoder.encode(message)), dtype=torch.uint8)
    return torch.tensor([payload.numel()], dtype=torch.int64), payload


def recv_frame(
    src: int,
    tags: tuple[int, int],
    decoder: msgspec.msgpack.Decoder,
    timeout_s: float,
    what: str,
    error: type[Exception],
) -> Any:
    """The next frame from `src` under `tags` (length tag, payload tag), decoded."""
    length = torch.empty(1, dtype=torch.int64)
    wait_all([p2p.irecv(length, src, tag=tags[0])], timeout_s, f"{what} length from rank {src}", error)
    payload = torch.empty(int(length.item()), dtype=torch.uint8)
    wait_all([p2p.irecv(payload, src, tag=tags[1])], timeout_s, f"{what} from rank {src}", error)
    return decoder.decode(payload.numpy().tobytes())


def send_ints(values: list[int], dst: int, tag: int, timeout_s: float, what: str, error: type[Exception]) -> None:
    wait_all([p2p.isend(torch.tensor(values, dtype=torch.int64), dst, tag=tag)], timeout_s, what, error)
