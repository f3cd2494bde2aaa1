"""Load the model, build an engine sized for the grid, run every measurement and fit the profile."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from spindle_policy.profile_data import fit_profile, profile_document

from .config import ProfileConfig
from .device import best_peaks, device_section, measure_peaks, model_shape
from .sp import measure_sp_prefill
from .transfer import measure_transfer


def machine_info() -> dict[str, Any]:
    import os

    import torch

    return {
        "node": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _median_samples(raw: dict[tuple, list[float]]) -> list[list[float]]:
    return [[*key, statistics.median(times)] for key, times in sorted(raw.items())]


def _set_budget(engine: Any, tokens: int) -> None:
    # The engine fixes its token budget at construction; one request at a time, the budget is the chunk.
    engine.scheduler.config = replace(engine.scheduler.config, max_num_batched_tokens=tokens)


def measure_prefill(engine: Any, cfg: ProfileConfig, tick: Callable[[], None]) -> list[list[float]]:
    """[[sp, C, L, median seconds], ...] for SP size 1."""
    from spindle_engine import SamplingParams

    rng = np.random.default_rng(cfg.seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # 1 would finish it, not hold it
    raw: dict[tuple, list[float]] = {}
    for i in range(cfg.warmup):  # untimed: first-call allocations, thread pools
        rid = f"profile-prefill-warmup-{i}"
        engine.add_request(rid, rng.integers(3, vocab, max(cfg.chunks)).tolist(), params, prefill_only=True)
        _set_budget(engine, max(cfg.chunks))
        engine.step()
        engine.release(rid)
        tick()
    for rep in range(cfg.repeats):
        for hist in cfg.histories:
            plan = ([hist] if hist else []) + list(cfg.chunks)
            rid = f"profile-prefill-{rep}-{hist}"
            engine.add_request(rid, rng.integers(3, vocab, sum(plan)).tolist(), params, prefill_only=True)
            done = 0
            for n in plan:
                _set_budget(engine, n)
                t0 = time.perf_counter()
                out = engine.step()
                seconds = time.perf_counter() - t0
                raw.setdefault((1, done, n), []).append(seconds)
                done += n
                tick()
            assert out and out[0].kv_ready, "the prefill plan should end with the prompt computed"
            engine.release(rid)
    return _median_samples(raw)


def measure_decode(engine: Any, cfg: ProfileConfig, tick: Callable[[], None]) -> list[list[float]]:
    """[[tp, kvp, batch, total KV tokens, median seconds], ...]; KV tokens counted as the step sees them."""
    import torch

    from spindle_engine import SamplingParams

    gen = torch.Generator().manual_seed(cfg.seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=cfg.warmup + cfg.decode_steps + 2, temperature=0.0, ignore_eos=True)
    _set_budget(engine, max(cfg.decode_batches))
    out = []
    for batch in cfg.decode_batches:
        for kv in cfg.decode_kv_tokens:
            rids = [f"profile-decode-{batch}-{kv}-{i}" for i in range(batch)]
            for rid in rids:
                if not engine.reserve(rid, kv):
                    raise ValueError(f"KV cache too small for decode batch {batch} x {kv} tokens")
                prompt = torch.randint(3, vocab, (kv,), generator=gen).tolist()
                cache = torch.randn(engine.kv_shape(kv), generator=gen).to(engine.config.torch_dtype)
                engine.add_prefilled(rid, prompt, 3, cache, params)
            times, kv_seen = [], []
            for step in range(cfg.warmup + cfg.decode_steps):
                t0 = time.perf_counter()
                got = engine.step()
                seconds = time.perf_counter() - t0
                assert len(got) == batch, f"decode step gave {len(got)} tokens for a batch of {batch}"
                if step >= cfg.warmup:
                    times.append(seconds)
                    kv_seen.append(batch * (kv + 1 + step))
                tick()
            for rid in rids:
                engine.abort(rid)
            out.append([1, 1, batch, float(np.mean(kv_seen)), statistics.median(times)])
    return out


def load_model(cfg: ProfileConfig) -> Any:
    from spindle_engine.config import DTYPES, EngineConfig
    from spindle_model import LlamaModel, attach_gguf_blocks, load_state_dict, resolve_model

    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    source = resolve_model(cfg.model)
    model = LlamaModel(source.config, dtype=DTYPES[cfg.dtype])
    model.load_weights(load_state_dict(source.path, dtype=DTYPES[cfg.dtype]))
    if EngineConfig().gguf_blocks and source.gguf is not None:  # as the engine loads it: decode reads the GGUF blocks
        attach_gguf_blocks(model, source.gguf)
    return model


def make_engine(cfg: ProfileConfig, model: Any) -> Any:
    from spindle_engine import Engine, EngineConfig

    context = model.config.max_position_embeddings
    max_len = max(cfg.prefill_len, cfg.decode_len)
    if max_len > context:
        raise ValueError(f"the grid needs {max_len}-token sequences but the model's context is {context}")
    kv_tokens = max(max_len, max(cfg.decode_batches) * (cfg.decode_len + 16)) + 64
    engine_cfg = EngineConfig(
        model=cfg.model,
        dtype=cfg.dtype,
        kv_cache_tokens=kv_tokens,
        max_model_len=max_len,
        max_num_batched_tokens=max(max(cfg.chunks), max(cfg.histories), max(cfg.decode_batches)),
        max_num_seqs=max(cfg.decode_batches),
        seed=cfg.seed,
    )
    return Engine(engine_cfg, model=model)


def run_profile(cfg: ProfileConfig, *, model: Any = None, progress: bool = True) -> dict[str, Any]:
    """Measure, fit, and return the profile document (see `spindle_policy.profile_data.write_profile`), its
    `device` section the cost model's device fitted to the same samples (`device.py`)."""
    from tqdm import tqdm

    t_start = time.perf_counter()
    model = model if model is not None else load_model(cfg)
    engine = make_engine(cfg, model)
    plan_steps = len(cfg.histories) * len(cfg.chunks) + sum(1 for h in cfg.histories if h)
    total = cfg.warmup + cfg.repeats * plan_steps
    total += len(cfg.decode_batches) * len(cfg.decode_kv_tokens) * (cfg.warmup + cfg.decode_steps)
    sp_sizes = [s for s in cfg.sp_sizes if s > 1]
    total += len(sp_sizes) + (len(cfg.transfer_bytes) if cfg.transfer else 0) + 2
    bar = tqdm(total=total, disable=not progress, unit="step")
    try:
        bar.set_description("device peaks")
        peaks = measure_peaks(cfg.dtype)
        bar.update(1)
        bar.set_description("prefill")
        prefill_rows = measure_prefill(engine, cfg, bar.update)
        grid = {k: getattr(cfg, k) for k in ("model", "dtype", "histories", "chunks", "repeats", "warmup", "seed")}
        for sp in sp_sizes:
            bar.set_description(f"prefill SP={sp}")
            prefill_rows += measure_sp_prefill(grid, sp)
            bar.update(1)
        bar.set_description("decode")
        decode_rows = measure_decode(engine, cfg, bar.update)
        transfer_rows: list[list[float]] = []
        if cfg.transfer:
            bar.set_description("transfer")
            transfer_rows = measure_transfer(cfg)
            bar.update(len(cfg.transfer_bytes))
        bar.set_description("device peaks")
        peaks = best_peaks(peaks, measure_peaks(cfg.dtype))  # other work only lowers a peak: the higher
        bar.update(1)
    finally:
        bar.close()
    fit = fit_profile(
        prefill_rows, decode_rows, transfer_rows, source=f"spindle profile: {cfg.model}", transfer_measured=cfg.transfer
    )
    shape = model_shape(cfg.model, model.config, cfg.dtype)
    device = device_section(peaks, shape, prefill_rows, decode_rows, fit.latency.transfer, cfg.dtype)
    return profile_document(
        machine=machine_info(),
        config=asdict(cfg),
        prefill_rows=prefill_rows,
        decode_rows=decode_rows,
        transfer_rows=transfer_rows,
        fit=fit,
        wall_s=time.perf_counter() - t_start,
        device=device,
    )
