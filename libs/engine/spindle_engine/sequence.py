"""A request inside the engine: its tokens, progress and KV blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams

CHOICE_SEP = "#"  # choice i > 0 of request r is the sequence "r#i" (request ids never contain it)


def choice_id(request_id: str, choice: int) -> str:
    return request_id if choice == 0 else f"{request_id}{CHOICE_SEP}{choice}"


def split_choice(sequence_id: str) -> tuple[str, int]:
    """A sequence id -> (request id, choice index)."""
    request_id, sep, choice = sequence_id.rpartition(CHOICE_SEP)
    return (request_id, int(choice)) if sep and choice.isdigit() else (sequence_id, 0)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    arrival: int = 0  # admission order, for FCFS after preemption

    prefill_only: bool = False  # stop after the first token and keep the KV for a hand-off
    penalty_state: object | None = None  # the sampler's token counts (sampler.PenaltyState), built on first use
    grammar_state: object | None = None  # the grammar's matcher (grammar.GrammarState), built on first use
    prompt_logprobs: list = field(default_factory=list)  # params.prompt_logprobs: positions 1.. of the prompt
    # A directed request whose KV an elastic group holds in parts (spindle_engine.esp): the absolute positions of
    # the entries in `block_table` order, on this member. None: positions 0..num_computed_tokens-1, all here.
    kv_positions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator()

    def step_generator(self) -> torch.Generator | None:
        """The generator for the next output token, seeded by (seed, output index).

        Seeding per position makes a seeded request's tokens independent of where they are sampled, so a
        prefill instance can sample the first token and a decode instance the rest with the same result.
        """
        if self.generator is None:
            return None
        assert self.params.seed is not None
        n = self.num_tokens - self.num_prompt_tokens
        return self.generator.manual_seed((self.params.seed * 1_000_003 + n) % (2**63 - 1))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


def stop_reason(seq: Sequence, token: int, eos_token_ids: set[int], max_model_len: int) -> str | None:
    """Why `seq` ends after sampling `token` ("stop" or "length"), or None when it goes on."""
    p = seq.params
    # with a grammar, EOS is where the grammar ends: it always stops
    if token in p.stop_token_ids or ((not p.ignore_eos or p.grammar) and token in eos_token_ids):
        return "stop"
    if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None
