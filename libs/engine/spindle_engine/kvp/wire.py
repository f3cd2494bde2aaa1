"""The leader -> follower control channel of a KVP decode group (point-to-point on the default group).

Before each step the leader sends every follower one `Control`: the placement calls since the last one, in
order, and whether to step. On the wire, per follower: an int64 `[nbytes]`, the msgspec (msgpack) bytes as a
uint8 tensor, then one KV tensor per `Place` that gives this follower a non-empty range (its tokens only, every
layer and KV head, in call order). After applying it and stepping, the follower answers with an int64 ack
`[seq, used blocks, checksum of the step's tokens]`, so the leader notices a diverged or dead member at once.

Tags: `RANK_GROUP_TAG + 12288 + 16..19` (the tensor-parallel control channel uses `+ 0..3`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor

from spindle_attention.distributed.comm import RANK_GROUP_TAG

from ..sampling_params import SamplingParams
from .plan import KVPRequest, KVRange

_LENGTH, _PAYLOAD, _KV, _ACK = (RANK_GROUP_TAG + 12288 + 16 + i for i in range(4))
ACK_WORDS = 3


class Place(msgspec.Struct, frozen=True, tag="place"):
    """A request joins the group: its ranges `[[member, start, end], ...]`, master and tokens so far."""

    request_id: str
    master: int
    ranges: list[tuple[int, int, int]]
    token_ids: list[int]  # prompt + outputs so far; the KV of all but the last is placed
    num_prompt_tokens: int
    params: SamplingParams

    @classmethod
    def of(cls, req: KVPRequest, token_ids: list[int], num_prompt_tokens: int, params: SamplingParams) -> Place:
        ranges = [(r.member, r.start, r.end) for r in req.ranges]
        return cls(req.request_id, req.master, ranges, list(token_ids), num_prompt_tokens, params)

    def request(self) -> KVPRequest:
        return KVPRequest(self.request_id, self.master, tuple(KVRange(*r) for r in self.ranges))


class ScaleUp(msgspec.Struct, frozen=True, tag="scale_up"):
    request_id: str
    member: int


class Drop(msgspec.Struct, frozen=True, tag="drop"):
    """Aborted, or failed: every member frees its ranges of it."""

    request_id: str


Call = Place | ScaleUp | Drop


class Control(msgspec.Struct, frozen=True):
    seq: int
    calls: list[Call]
    step: bool
    stop: bool = False


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Control)


class KVPError(RuntimeError):
    """A member of the KVP group is gone, timed out or diverged; the group cannot go on."""


def wait_all(works: list[dist.Work], timeout_s: float, what: str) -> None:
    try:
        for w in works:
            w.wait(timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise KVPError(f"{what} failed: {e}") from e


def send_control(
    control: Control, kv_parts: dict[int, list[Tensor]], followers: dict[int, int], timeout_s: float
) -> None:
    """Send `control` to every follower (member -> rank); `kv_parts[member]` are its Place tensors."""
    payload = torch.frombuffer(bytearray(_encoder.encode(control)), dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    works = []
    for m, peer in followers.items():
        works += [dist.isend(length, peer, tag=_LENGTH), dist.isend(payload, peer, tag=_PAYLOAD)]
        works += [dist.isend(t, peer, tag=_KV) for t in kv_parts.get(m, [])]
    wait_all(works, timeout_s, f"KVP control message {control.seq} to ranks {sorted(followers.values())}")


def recv_control(
    leader: int, member: int, kv_shape: Callable[[int], tuple[int, ...]], kv_dtype: torch.dtype, timeout_s: float
) -> tuple[Control, list[Tensor]]:
    """The next `Control` from `leader` and this member's KV parts (`kv_shape(num_tokens)` each)."""
    length = torch.empty(1, dtype=torch.int64)
    wait_all([dist.irecv(length, leader, tag=_LENGTH)], timeout_s, f"KVP control length from rank {leader}")
    payload = torch.empty(int(length.item()), dtype=torch.uint8)
    wait_all([dist.irecv(payload, leader, tag=_PAYLOAD)], timeout_s, f"KVP control message from rank {leader}")
    control = _decoder.decode(payload.numpy().tobytes())
    parts = []
    for call in control.calls:
        if isinstance(call, Place) and (mine := call.request().range_of(member)) is not None and mine.num_tokens:
            t = torch.empty(kv_shape(mine.num_tokens), dtype=kv_dtype)
            wait_all([dist.irecv(t, leader, tag=_KV)], timeout_s, f"KV of {call.request_id} from rank {leader}")
            parts.append(t)
    return control, parts


def checksum(tokens: list[tuple[str, int, bool]]) -> int:
    """A position-weighted sum of a step's (request, token, finished): equal on members that agree."""
    return sum((i + 1) * (t + 1) * (2 if done else 1) for i, (_, t, done) in enumerate(tokens)) % (1 << 62)


def send_ack(ack: list[int], leader: int, timeout_s: float) -> None:
    t = torch.tensor(ack, dtype=torch.int64)
    wait_all([dist.isend(t, leader, tag=_ACK)], timeout_s, f"KVP ack to rank {leader}")


def recv_acks(followers: dict[int, int], timeout_s: float) -> dict[int, list[int]]:
    bufs = {m: torch.empty(ACK_WORDS, dtype=torch.int64) for m in followers}
    works = [dist.irecv(bufs[m], peer, tag=_ACK) for m, peer in followers.items()]
    wait_all(works, timeout_s, f"KVP acks from ranks {sorted(followers.values())}")
    return {m: b.tolist() for m, b in bufs.items()}
