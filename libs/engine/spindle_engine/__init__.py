"""Spindle's single-instance engine: paged KV cache, continuous batching with chunked prefill, sampling.

from spindle_engine import LLM, SamplingParams
llm = LLM(model="smollm2")
print(llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0.0))[0].text)
"""

from .config import EngineConfig
from .engine import Engine, PreemptedSequence, StepOutput
from .llm import LLM, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "PreemptedSequence", "RequestOutput", "SamplingParams", "StepOutput"]
