"""The serving overhead: what the stack adds on top of the engine's own work, for one request at a time.

- TTFT overhead = median TTFT of a short prompt through the stack (sequential requests) minus the median
  time of the in-process `Engine.step()` that prefills the same prompt and samples its first token.
- ITL overhead = median ITL of a single stream through the stack minus the median in-process decode step
  at batch 1 over the same prompt and output length.

Both sides run the same model in the same dtype with the same torch thread count, greedy, EOS ignored. The
engine and stack measurements alternate (engine, stack, engine, stack, ...), so that both sides see the same
background load; `paired_overhead_ms` is the median over those pairs of (stack - engine).
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

from serve_stats import RequestResult, percentile_key

from spindle_engine import Engine, EngineConfig, SamplingParams, StepOutput

TARGETS_MS = {"ttft_overhead_ms": 20.0, "itl_overhead_p50_ms": 2.0}


class EngineProbe:
    """An in-process engine that times one prefill step, or every decode step of one batch-1 stream."""

    def __init__(self, model: str, dtype: str, max_len: int) -> None:
        block = EngineConfig().block_size
        config = EngineConfig(model=model, dtype=dtype, kv_cache_tokens=max_len + 2 * block, max_model_len=max_len)
        self.engine = Engine(config)
        self._ids = itertools.count()

    def _add(self, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(f"bench-{next(self._ids)}", prompt, params)

    def _step(self) -> tuple[float, list[StepOutput]]:
        t0 = time.perf_counter()
        outs = self.engine.step()
        return time.perf_counter() - t0, outs

    def prefill(self, prompt: list[int]) -> float:
        """Seconds of the step that prefills `prompt` and samples its first token."""
        self._add(prompt, 1)
        elapsed, outs = self._step()
        if len(outs) != 1 or not outs[0].finished:
            raise RuntimeError(f"the {len(prompt)}-token prefill did not finish in one step: {outs}")
        return elapsed

    def stream(self, prompt: list[int], output_len: int) -> list[float]:
        """Seconds of each decode step (tokens 2..output_len) of one request alone in the engine."""
        self._add(prompt, output_len)
        _, outs = self._step()  # prefill + first token
        if len(outs) != 1:
            raise RuntimeError(f"the {len(prompt)}-token prefill did not finish in one step: {outs}")
        steps = []
        while self.engine.has_unfinished():
            elapsed, outs = self._step()
            if len(outs) != 1 or len(outs[0].new_token_ids) != 1:
                raise RuntimeError(f"a batch-1 decode step made {outs} instead of one token")
            steps.append(elapsed)
        if len(steps) != output_len - 1:
            raise RuntimeError(f"{len(steps)} decode steps for {output_len} tokens")
        return steps


def ms_stats(values_s: list[float], percentiles: tuple[float, ...] = (90.0, 99.0)) -> dict[str, float]:
    """median, mean, min, nearest-rank percentiles (these are small samples) in ms, and n."""
    values = sorted(v * 1e3 for v in values_s)
    out = {"median": statistics.median(values), "mean": statistics.fmean(values), "min": values[0]}
    for p in percentiles:
        out[percentile_key(p)] = values[min(len(values) - 1, max(0, round(p / 100 * len(values)) - 1))]
    out["n"] = len(values)
    return out


def _check(results: list[RequestResult]) -> None:
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} overhead request(s) failed, e.g. {failed[0]}")


def _verdict(overhead_ms: float, target_ms: float) -> dict[str, Any]:
    return {"target_ms": target_ms, "pass": overhead_ms <= target_ms}


def ttft_report(engine_s: list[float], results: list[RequestResult], settings: dict[str, Any]) -> dict[str, Any]:
    """engine_s[i] and results[i] were measured one right after the other."""
    _check(results)
    stack, engine = ms_stats([r.ttft for r in results]), ms_stats(engine_s)
    overhead = stack["median"] - engine["median"]
    return {
        "what": "median TTFT through the stack minus the engine's own prefill step, same prompt length",
        "prompt_len": settings["ttft_prompt_len"],
        "max_tokens": settings["ttft_max_tokens"],
        "stack_ttft_ms": stack,
        "engine_prefill_ms": engine,
        "stack_usage_median": usage_medians(results),
        "overhead_ms": overhead,
        "paired_overhead_ms": statistics.median((r.ttft - e) * 1e3 for r, e in zip(results, engine_s, strict=True)),
        "overhead_of_minimums_ms": stack["min"] - engine["min"],
        **_verdict(overhead, TARGETS_MS["ttft_overhead_ms"]),
    }


def itl_report(engine_s: list[list[float]], results: list[RequestResult], settings: dict[str, Any]) -> dict[str, Any]:
    """engine_s[i] (decode steps of one in-process stream) and results[i] were measured one after the other."""
    _check(results)
    stack = ms_stats([x for r in results for x in r.itl])
    engine = ms_stats([x for steps in engine_s for x in steps])
    overhead = stack["median"] - engine["median"]
    pairs = [(statistics.median(r.itl) - statistics.median(e)) * 1e3 for r, e in zip(results, engine_s, strict=True)]
    return {
        "what": "median ITL of one stream through the stack minus the engine's own batch-1 decode step",
        "prompt_len": settings["itl_prompt_len"],
        "output_len": settings["itl_output_len"],
        "streams": len(results),
        "stack_itl_ms": stack,
        "engine_decode_step_ms": engine,
        "stack_usage_median": usage_medians(results),
        "overhead_p50_ms": overhead,
        "paired_overhead_ms": statistics.median(pairs),
        "overhead_of_minimums_ms": stack["min"] - engine["min"],
        **_verdict(overhead, TARGETS_MS["itl_overhead_p50_ms"]),
    }


def usage_medians(results: list[RequestResult]) -> dict[str, float]:
    """Median of each numeric `usage.spindle` field the stack reports (transfer/decode ms, KV bytes, ...)."""
    fields: dict[str, list[float]] = {}
    for r in results:
        spindle = (r.usage or {}).get("spindle") or {}
        for key, value in spindle.items():
            if isinstance(value, int | float):
                fields.setdefault(key, []).append(float(value))
    return {key: statistics.median(values) for key, values in sorted(fields.items())}
