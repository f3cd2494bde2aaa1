"""Point-to-point exchanges of an elastic group's iteration (torch.distributed on the default group).

Every message size follows from the iteration's command (the same on every member) or from a fixed-size
length message sent first, so no member waits for a message another does not send.

A member may give up on an iteration (a peer died, or a peer gave up and said so): its posted operations stay
posted. So each iteration talks under its own tags (`Tags`, from the batch id), and a later iteration between
the same members never matches an abandoned one's messages. Waits never let gloo time out (that closes every
pair of the process): each op is waited for on a helper thread, and `Waiter` gives up at its deadline or when
`cancel` is set.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor

from spindle_attention.distributed import p2p
from spindle_attention.distributed.comm import RANK_GROUP_TAG

MAX_HANDOVER_BYTES = 1 << 20  # a request's encoded spec
ESP_TAG = RANK_GROUP_TAG + 20480  # above the RankGroup and KVP ranges
TAG_STRIDE = 512  # tags of one iteration: the ring's 0..3, ours 8..15, two per layer from 16 (layers <= 248)
TAG_CYCLE = 1 << 16  # batch ids share tags this many iterations apart
_FOREVER = timedelta(days=3650)
_POLL_S = 0.01


class ESPError(RuntimeError):
    """An exchange of the group failed (a member died, gave up, or stopped answering)."""


@dataclass(frozen=True)
class Tags:
    """The tags of one iteration."""

    base: int

    @classmethod
    def for_batch(cls, batch_id: int) -> Tags:
        return cls(ESP_TAG + (batch_id % TAG_CYCLE) * TAG_STRIDE)

    @property
    def flags(self) -> int:
        return self.base + 8

    @property
    def tokens(self) -> int:
        return self.base + 9

    @property
    def handover(self) -> int:  # length; the payload under handover + 1
        return self.base + 10

    def query(self, layer: int) -> int:
        assert 0 <= layer < (TAG_STRIDE - 16) // 2, f"layer {layer} has no tag"
        return self.base + 16 + 2 * layer

    def result(self, layer: int) -> int:
        return self.query(layer) + 1


class Waiter:
    """Waits for ops, each batch of them for at most `timeout_s` and until `cancel` is set; then ESPError (the ops
    stay posted)."""

    def __init__(self, timeout_s: float, cancel: threading.Event | None = None) -> None:
        self.timeout_s = timeout_s
        self.cancel = cancel or threading.Event()

    def wait(self, work: dist.Work, what: str = "a group message") -> None:
        self.wait_all([work], what)

    def wait_all(self, works: list[dist.Work], what: str) -> None:
        if not works:
            return
        done = threading.Event()
        error: list[BaseException] = []

        def block() -> None:
            try:
                for w in works:
                    w.wait(_FOREVER)
            except BaseException as e:  # the peer died
                error.append(e)
            done.set()

        threading.Thread(target=block, name="spindle-esp-wait", daemon=True).start()
        deadline = time.monotonic() + self.timeout_s
        while not done.wait(_POLL_S):
            if self.cancel.is_set():
                raise ESPError(f"{what}: the iteration was given up")
            if time.monotonic() > deadline:
                raise ESPError(f"{what}: timed out")
        if error:
            raise ESPError(f"{what} failed: {error[0]}") from error[0]


def all_gather(mine: Tensor, me: int, ranks: list[int], tag: int, waiter: Waiter, what: str) -> Tensor:
    """Every member's `mine` (the same shape everywhere): `[members, *mine.shape]`, row m from member m."""
    out = mine.new_empty((len(ranks), *mine.shape))
    out[me] = mine
    if mine.numel() == 0 or len(ranks) == 1:
        return out
    works = [p2p.irecv(out[m], ranks[m], tag=tag) for m in range(len(ranks)) if m != me]
    works += [p2p.isend(mine.contiguous(), ranks[m], tag=tag) for m in range(len(ranks)) if m != me]
    waiter.wait_all(works, what)
    return out


class Handover(msgspec.Struct, frozen=True):
    """A request that changes master: what the new one needs to compute and sample it (the caller's encoded spec)."""

    token_ids: list[int]
    num_prompt_tokens: int
    num_computed: int  # tokens whose KV exists (on other members)
    spec: bytes


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Handover)


def send_handover(h: Handover, dst: int, tags: Tags, waiter: Waiter) -> None:
    payload = torch.frombuffer(bytearray(_encoder.encode(h)), dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    works = [p2p.isend(length, dst, tag=tags.handover), p2p.isend(payload, dst, tag=tags.handover + 1)]
    waiter.wait_all(works, f"hand-over to rank {dst}")


def recv_handover(src: int, max_tokens: int, tags: Tags, waiter: Waiter) -> Handover:
    """The next hand-over from `src`; ESPError for a malformed or oversized one (never executed: msgspec)."""
    length = torch.empty(1, dtype=torch.int64)
    waiter.wait(p2p.irecv(length, src, tag=tags.handover), f"hand-over length from rank {src}")
    n = int(length.item())
    limit = MAX_HANDOVER_BYTES + 9 * (max_tokens + 8)
    if not 0 < n <= limit:
        raise ESPError(f"a hand-over of {n} bytes from rank {src} (at most {limit})")
    payload = torch.empty(n, dtype=torch.uint8)
    waiter.wait(p2p.irecv(payload, src, tag=tags.handover + 1), f"hand-over from rank {src}")
    try:
        h = _decoder.decode(payload.numpy().tobytes())
    except msgspec.DecodeError as e:
        raise ESPError(f"a malformed hand-over from rank {src}: {e}") from e
    n = len(h.token_ids)
    if not (0 < h.num_prompt_tokens <= n <= max_tokens and 0 < h.num_computed < n) or len(h.spec) > MAX_HANDOVER_BYTES:
        raise ESPError(f"a hand-over of {n} tokens ({h.num_prompt_tokens} prompt, {h.num_computed} computed) "
                       f"from rank {src}")  # fmt: skip
    return h
