"""The leader -> follower control channel of a KVP decode group (point-to-point on the default group).

Before each step the leader sends every follower one `Control`: the placement calls since the last one, in
order, and whether to step. On the wire, per follower: an int64 `[nbytes]`, the msgspec (msgpack) bytes as a
uint8 tensor, then one KV tensor per `Place` that gives this follower a non-empty range (its tokens only, every
layer and KV head, in call order). After applying it and stepping, the follower answers with an int64 ack
`[seq, used blocks, checksum of the step's tokens, bitmask of the members it lost]`, so the leader notices a
diverged or dead member at once.

A peer whose process died closes its connections, and gloo fails every operation with it at once while the
pairs between the others keep working: such a peer is *lost* (`wait_peers`), its operations are skipped and the
leader tells everyone `Gone` before the next step. A peer that stays connected but silent ends in a gloo timeout
instead, and a gloo timeout closes every pair of the process ("Application timeout caused pair closure"): that
one is a `KVPError`, as is any failure talking to the leader.

Tags: `RANK_GROUP_TAG + 12288 + 16..19` (the tensor-parallel control channel uses `+ 0..3`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor

from spindle_attention.distributed import p2p
from spindle_attention.distributed.comm import RANK_GROUP_TAG

from .. import control_frames
from ..sampling_params import SamplingParams
from .plan import KVPRequest, KVRange

_LENGTH, _PAYLOAD, _KV, _ACK = (RANK_GROUP_TAG + 12288 + 16 + i for i in range(4))
ACK_WORDS = 4


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


class ScaleDown(msgspec.Struct, frozen=True, tag="scale_down"):
    """`member` leaves the holders of `request_id`; its range merges into `into`'s. The KV moves member to member
    at the start of the next step (decoder.py), not over this channel."""

    request_id: str
    member: int
    into: int


class Drop(msgspec.Struct, frozen=True, tag="drop"):
    """Aborted, or failed: every member frees its ranges of it."""

    request_id: str


class Gone(msgspec.Struct, frozen=True, tag="gone"):
    """`member` died: every member drops the requests it masters or holds KV of, and never talks to it again."""

    member: int


Call = Place | ScaleUp | ScaleDown | Drop | Gone


class Control(msgspec.Struct, frozen=True):
    seq: int
    calls: list[Call]
    step: bool
    stop: bool = False


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Control)


class KVPError(RuntimeError):
    """A member of the KVP group is gone, timed out or diverged; the group cannot go on."""


def peer_gone(e: BaseException) -> bool:
    """A failed operation whose peer closed its connection (it died), not a timeout (which closed every pair)."""
    text = str(e).lower()
    return "timed out" not in text and "timeout" not in text


def wait_peers(works: list[tuple[int, dist.Work | None]], timeout_s: float | None, lost: set[int] | None) -> None:
    """Wait for each `(peer, work)`; a peer that died is added to `lost` (its other operations are skipped), or
    raises `KVPError` when `lost` is None (a group that cannot go on without a member)."""
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    for peer, w in works:
        if w is None or (lost is not None and peer in lost):
            continue
        try:
            w.wait() if timeout is None else w.wait(timeout)
        except RuntimeError as e:
            if lost is None or not peer_gone(e):
                raise KVPError(f"waiting for member {peer} failed: {e}") from e
            lost.add(peer)


def post(op: Callable[[], dist.Work], peer: int, lost: set[int] | None) -> tuple[int, dist.Work | None]:
    """Start a send or receive with `peer` unless it is lost (or found lost now; `lost` None: raise)."""
    if lost is not None and peer in lost:
        return peer, None
    try:
        return peer, op()
    except RuntimeError as e:
        if lost is None or not peer_gone(e):
            raise KVPError(f"talking to member {peer} failed: {e}") from e
        lost.add(peer)
        return peer, None


def lost_mask(lost: set[int]) -> int:
    return sum(1 << m for m in lost)


def mask_members(mask: int) -> set[int]:
    return {m for m in range(63) if mask >> m & 1}


def wait_all(works: list[dist.Work], timeout_s: float, what: str) -> None:
    control_frames.wait_all(works, timeout_s, what, KVPError)


def send_control(
    control: Control, kv_parts: dict[int, list[Tensor]], followers: dict[int, int], timeout_s: float
) -> set[int]:
    """Send `control` to every follower (member -> rank); `kv_parts[member]` are its Place tensors.

    Returns the followers found dead (their connection closed); a timeout raises `KVPError`."""
    length, payload = control_frames.encode_frame(_encoder, control)
    works, lost = [], set()
    for m, peer in followers.items():
        works.append(post(lambda peer=peer: p2p.isend(length, peer, tag=_LENGTH), m, lost))
        works.append(post(lambda peer=peer: p2p.isend(payload, peer, tag=_PAYLOAD), m, lost))
        works += [post(lambda t=t, peer=peer: p2p.isend(t, peer, tag=_KV), m, lost) for t in kv_parts.get(m, [])]
    try:
        wait_peers(works, timeout_s, lost)
    except KVPError as e:
        raise KVPError(f"KVP control message {control.seq} to ranks {sorted(followers.values())}: {e}") from e
    return lost


def recv_control(
    leader: int, member: int, kv_shape: Callable[[int], tuple[int, ...]], kv_dtype: torch.dtype, timeout_s: float
) -> tuple[Control, list[Tensor]]:
    """The next `Control` from `leader` and this member's KV parts (`kv_shape(num_tokens)` each)."""
    tags = (_LENGTH, _PAYLOAD)
    control = control_frames.recv_frame(leader, tags, _decoder, timeout_s, "KVP control message", KVPError)
    parts = []
    for call in control.calls:
        if isinstance(call, Place) and (mine := call.request().range_of(member)) is not None and mine.num_tokens:
            t = torch.empty(kv_shape(mine.num_tokens), dtype=kv_dtype)
            wait_all([p2p.irecv(t, leader, tag=_KV)], timeout_s, f"KV of {call.request_id} from rank {leader}")
            parts.append(t)
    return control, parts


def checksum(tokens: list[tuple[str, int, bool]]) -> int:
    """A position-weighted sum of a step's (request, token, finished): equal on members that agree."""
    return sum((i + 1) * (t + 1) * (2 if done else 1) for i, (_, t, done) in enumerate(tokens)) % (1 << 62)


def send_ack(ack: list[int], leader: int, timeout_s: float) -> None:
    control_frames.send_ints(ack, leader, _ACK, timeout_s, f"KVP ack to rank {leader}", KVPError)


def recv_acks(followers: dict[int, int], timeout_s: float, lost: set[int]) -> dict[int, list[int]]:
    """The acks of the followers not in `lost`; those found dead meanwhile join `lost` (and have none)."""
    bufs = {m: torch.empty(ACK_WORDS, dtype=torch.int64) for m in followers if m not in lost}
    works = [post(lambda m=m, peer=peer: p2p.irecv(bufs[m], peer, tag=_ACK), m, lost) for m, peer in followers.items()
             if m in bufs]  # fmt: skip
    try:
        wait_peers(works, timeout_s, lost)
    except KVPError as e:
        raise KVPError(f"KVP acks from ranks {sorted(followers.values())}: {e}") from e
    return {m: b.tolist() for m, b in bufs.items() if m not in lost}
