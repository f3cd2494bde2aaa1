"""Offline batch generation, shaped like vLLM's `LLM`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from spindle_model import Tokenizer

from .config import EngineConfig
from .engine import Engine
from .sampling_params import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None


class LLM:
    """`LLM(model="smollm2", dtype="float32", device="cpu", **engine_options)`; see `EngineConfig` for the options."""

    def __init__(self, model: str = "smollm2", dtype: str = "float32", device: str = "cpu", **options: object) -> None:
        self.engine = Engine(EngineConfig(model=model, dtype=dtype, device=device, **options))  # type: ignore[arg-type]
        assert self.engine.source is not None
        self.tokenizer = Tokenizer(self.engine.source.path)
        self.engine.eos_token_ids |= set(self.tokenizer.eos_token_ids)
        self._ids = itertools.count()

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list):
            raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        return prompt

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat conversation with the model's template and the assistant prompt."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); returns one output per prompt, in order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        param_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(f"{len(param_list)} sampling params for {len(prompts)} prompts")
        encoded = [self.encode(p) for p in prompts]
        for ids in encoded:  # validate everything before the engine sees anything
            self.engine.validate_prompt(ids)
        rids = [f"gen-{next(self._ids)}" for _ in encoded]
        for rid, ids, p in zip(rids, encoded, param_list, strict=True):
            self.engine.add_request(rid, ids, p)
        tokens: dict[str, list[int]] = {rid: [] for rid in rids}
        reasons: dict[str, str | None] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        return [
            RequestOutput(rid, ids, tokens[rid], self.tokenizer.decode(tokens[rid]), reasons.get(rid))
            for rid, ids in zip(rids, encoded, strict=True)
        ]
