"""The leader -> follower control channel of a tensor-parallel engine (point-to-point on the default group).

Before each step the leader sends every follower one `Control`: the engine-mutating calls since the last one,
in order, and whether to step. On the wire, per follower: an int64 `[nbytes]`, then the msgspec (msgpack)
bytes as a uint8 tensor, then one KV tensor per `Resume` call that is not `direct` (that follower's heads, in
call order). A `direct` resume's KV came to the follower from the prefill holders themselves (`ReceiveKV`,
direct.py); a resume from the host tier's (Seesaw) the follower reads from the tier file itself. The follower
answers each `Control`, after applying it and stepping, with an int64 `Ack`: `[seq,
used blocks, total blocks, checksum of the step's tokens, KV bytes received directly so far]`; the first four
must equal the leader's, so the leader notices a diverged or dead follower at once.

Tags: `RANK_GROUP_TAG + CONTROL_TAG + 0..3` (length, payload, KV parts, ack); the all-reduce of the model
uses `RANK_GROUP_TAG + 8192 + [0, 2T)` (spindle_model.parallel), KVP `RANK_GROUP_TAG + 4096 + ...`.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor

from spindle_attention.distributed import p2p
from spindle_attention.distributed.comm import RANK_GROUP_TAG

from ..control_frames import encode_frame, recv_frame, send_ints, wait_all
from ..engine import StepOutput
from ..errors import EngineFatal
from ..reshard.tier import TierPut
from ..sampling_params import SamplingParams

CONTROL_TAG = 12288
_LENGTH, _PAYLOAD, _KV, _ACK = (RANK_GROUP_TAG + CONTROL_TAG + i for i in range(4))
ACK_WORDS = 5
CHECKED_ACK_WORDS = 4  # the last word (direct KV bytes) is a counter, not compared


class AddRequest(msgspec.Struct, frozen=True, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill_only: bool = False


class Reserve(msgspec.Struct, frozen=True, tag="reserve"):
    request_id: str
    num_tokens: int
    choices: int = 1


class CancelReservation(msgspec.Struct, frozen=True, tag="cancel"):
    request_id: str


class Resume(msgspec.Struct, frozen=True, tag="resume"):
    """`Engine.resume`; the follower's KV heads for `len(token_ids) - 1` tokens follow the message, or, when
    `direct`, were received from the holders the `ReceiveKV` calls named."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    direct: bool = False
    tier: TierPut | None = None  # each rank reads its heads from this host-tier file (Seesaw's onboarding)


class ReceiveKV(msgspec.Struct, frozen=True, tag="receive_kv"):
    """Post a receive from holder `src` of this rank's KV heads for the positions `runs` ([start, end) runs in
    the part's order), under `tags[tp rank]`; the request's `Resume` (direct) uses every part posted."""

    request_id: str
    src: int
    tags: list[int]
    runs: list[list[int]]


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    request_id: str


class Park(msgspec.Struct, frozen=True, tag="park"):
    """Take the decoding request out (`Engine.preempt_out`) and write this rank's heads of its KV to the host-tier
    file `put.name` (Seesaw: a decode going back to the tier before a switch); `put.table` is unused."""

    request_id: str
    put: TierPut


class Prefetch(msgspec.Struct, frozen=True, tag="prefetch"):
    """Start reading this rank's heads of `put.tokens` tokens from the host-tier file `put.name` on the prefetcher's
    thread; the request's tier `Resume` takes them (Seesaw's swap-in, overlapped with the steps before it)."""

    request_id: str
    put: TierPut


Call = AddRequest | Reserve | CancelReservation | Resume | ReceiveKV | Abort | Park | Prefetch


class Control(msgspec.Struct, frozen=True):
    seq: int
    calls: list[Call]
    step: bool
    stop: bool = False


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Control)


class TPError(EngineFatal):
    """A tensor-parallel peer is gone, timed out or diverged; the instance cannot go on."""


def _wait(works: list[dist.Work], timeout_s: float, what: str) -> None:
    wait_all(works, timeout_s, what, TPError)


def send_control(control: Control, kv_parts: list[list[Tensor]], followers: tuple[int, ...], timeout_s: float) -> None:
    """Send `control` to every follower; `kv_parts[f]` are follower f's tensors for the Resume calls."""
    length, payload = encode_frame(_encoder, control)
    works = []
    for f, peer in enumerate(followers):
        works += [p2p.isend(length, peer, tag=_LENGTH), p2p.isend(payload, peer, tag=_PAYLOAD)]
        works += [p2p.isend(t, peer, tag=_KV) for t in kv_parts[f]]
    _wait(works, timeout_s, f"control message {control.seq} to ranks {followers}")


def recv_control(
    leader: int, kv_shape: Callable[[int], tuple[int, ...]], kv_dtype: torch.dtype, timeout_s: float
) -> tuple[Control, list[Tensor]]:
    """The next `Control` from `leader` and its KV parts; `kv_shape(num_tokens)` is this rank's KV shape."""
    control = recv_frame(leader, (_LENGTH, _PAYLOAD), _decoder, timeout_s, "control message", TPError)
    parts = []
    for call in control.calls:
        if isinstance(call, Resume) and not call.direct and call.tier is None:
            t = torch.empty(kv_shape(len(call.token_ids) - 1), dtype=kv_dtype)
            _wait([p2p.irecv(t, leader, tag=_KV)], timeout_s, f"KV of {call.request_id} from rank {leader}")
            parts.append(t)
    return control, parts


def checksum(outputs: list[StepOutput]) -> int:
    """A position-weighted sum of a step's tokens: equal on every rank that sampled the same."""
    return sum((i + 1) * (t + 1) for i, o in enumerate(outputs) for t in o.new_token_ids) % (1 << 62)


def send_ack(ack: list[int], leader: int, timeout_s: float) -> None:
    send_ints(ack, leader, _ACK, timeout_s, f"ack to rank {leader}", TPError)


def recv_acks(followers: tuple[int, ...], timeout_s: float) -> list[list[int]]:
    bufs = [torch.empty(ACK_WORDS, dtype=torch.int64) for _ in followers]
    works = [p2p.irecv(b, peer, tag=_ACK) for b, peer in zip(bufs, followers, strict=True)]
    _wait(works, timeout_s, f"acks from ranks {followers}")
    return [b.tolist() for b in bufs]
