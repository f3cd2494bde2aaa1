"""The stage-to-stage channel of a sequence-pipeline-parallel (SPP) engine (point-to-point on the default group).

Each step the leader (stage 0) sends every member of stage 1 one `StageStep` (what the step computes: per chunk its
first position, its length and its block table, in the batch order of `model_runner.StepBatch`), then the stage's
output hidden states `[T, H]`; every middle stage's leader forwards the step and its own output to the next stage.
With tensor parallelism inside the stages, the leader first sends its own stage's TP followers the step with its
token ids (they embed them and run their heads of stage 0 beside the leader). The last stage sends
the leader the rows `return_rows` of its final-norm hidden states, only for steps that name any (the steps that
sample a token); the others are not answered, which is what lets the leader start the next chunk of a prompt
while the later stages still work on this one. `stop` ends every stage's loop; a step with no chunks keeps the
connections warm.

Tags: `RANK_GROUP_TAG + SPP_TAG + 0..3` (length, payload, hidden, return), above every other group's range.
"""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor

from spindle_attention.distributed import p2p
from spindle_attention.distributed.comm import RANK_GROUP_TAG

from ..control_frames import encode_frame, recv_frame, wait_all
from ..errors import EngineFatal
from ..esp.pipeline import KVPStep
from ..model_runner import StepBatch
from ..reshard.tier import TierPut

SPP_TAG = 24576
_LENGTH, _PAYLOAD, _HIDDEN, _RETURN = (RANK_GROUP_TAG + SPP_TAG + i for i in range(4))


class SPPError(EngineFatal):
    """A pipeline stage is gone, timed out or sent something malformed; the instance cannot go on."""


class StageStep(msgspec.Struct, frozen=True):
    seq: int
    starts: list[int]
    lengths: list[int]
    tables: list[list[int]]
    return_rows: list[int]
    stop: bool = False
    token_ids: list[int] = msgspec.field(default_factory=list)  # for stage 0's TP followers only
    kvp: KVPStep | None = None  # a multi-master step of a KV-parallel group (Medha's 3D): no batch, its own context
    # prompts this step completes whose KV every member writes to the host tier (Seesaw's swap-out), its layers x
    # its heads, before passing the step on
    offload: list[TierPut] = msgspec.field(default_factory=list)

    def with_tokens(self, token_ids: list[int]) -> StageStep:
        return msgspec.structs.replace(self, token_ids=token_ids)

    def without_tokens(self) -> StageStep:
        return msgspec.structs.replace(self, token_ids=[])

    @property
    def num_tokens(self) -> int:
        return self.kvp.num_tokens if self.kvp is not None else sum(self.lengths)

    def batch(self, block_size: int, num_blocks: int) -> StepBatch:
        """The step as a batch; ValueError for a malformed one (the stage rejects it before touching its cache)."""
        n = len(self.starts)
        if len(self.lengths) != n or len(self.tables) != n:
            raise ValueError(f"step {self.seq}: {n} starts, {len(self.lengths)} lengths, {len(self.tables)} tables")
        for s, length, table in zip(self.starts, self.lengths, self.tables, strict=True):
            if s < 0 or length < 1 or len(table) * block_size < s + length:
                raise ValueError(f"step {self.seq}: chunk [{s}, {s + length}) does not fit its {len(table)} blocks")
            if any(not 0 <= b < num_blocks for b in table):
                raise ValueError(f"step {self.seq}: a block id outside [0, {num_blocks})")
        if any(not 0 <= r < self.num_tokens for r in self.return_rows):
            raise ValueError(f"step {self.seq}: return rows outside [0, {self.num_tokens})")
        return StepBatch(list(self.starts), list(self.lengths), [list(t) for t in self.tables], block_size)

    @classmethod
    def of(cls, seq: int, batch: StepBatch, return_rows: list[int]) -> StageStep:
        return cls(seq, batch.starts, batch.lengths, batch.tables, return_rows)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StageStep)


def post_step(step: StageStep, hidden: Tensor | None, dst: int) -> list[tuple[dist.Work, Tensor]]:
    """Post `step` and its hidden states `[T, H]` to rank `dst`; the works and the tensors they must keep alive."""
    length, payload = encode_frame(_encoder, step)
    posted = [(p2p.isend(length, dst, tag=_LENGTH), length), (p2p.isend(payload, dst, tag=_PAYLOAD), payload)]
    if hidden is not None and step.num_tokens:
        hidden = hidden.contiguous()
        posted.append((p2p.isend(hidden, dst, tag=_HIDDEN), hidden))
    return posted


def recv_step(src: int, timeout_s: float) -> StageStep:
    return recv_frame(src, (_LENGTH, _PAYLOAD), _decoder, timeout_s, "pipeline step", SPPError)


def recv_hidden(src: int, num_tokens: int, hidden_size: int, dtype: torch.dtype, timeout_s: float) -> Tensor:
    hidden = torch.empty(num_tokens, hidden_size, dtype=dtype)  # [T, H]
    wait_all([p2p.irecv(hidden, src, tag=_HIDDEN)], timeout_s, f"hidden states from rank {src}", SPPError)
    return hidden


def post_return(rows: Tensor, leader: int) -> tuple[dist.Work, Tensor]:
    rows = rows.contiguous()
    return p2p.isend(rows, leader, tag=_RETURN), rows


def recv_return(src: int, num_rows: int, hidden_size: int, dtype: torch.dtype, timeout_s: float) -> Tensor:
    rows = torch.empty(num_rows, hidden_size, dtype=dtype)  # [rows, H]
    wait_all([p2p.irecv(rows, src, tag=_RETURN)], timeout_s, f"final hidden rows from rank {src}", SPPError)
    return rows


def wait_posted(posted: list[tuple[dist.Work, Tensor]], timeout_s: float, what: str) -> None:
    """Wait for posted sends, each once only (a second wait on a gloo send blocks until its timeout)."""
    wait_all([w for w, _ in posted], timeout_s, what, SPPError)
