"""`spindle profile`: measure the real engine on this machine and fit a `LatencyModel` to it.

Three measurements, each repeated with the median kept:
- prefill chunks (SP size 1): per history C, one prefill-only request whose steps compute C tokens, then
  each chunk L of the grid in turn; every step is one sample (history before it, tokens it computed), so
  the history prefill is itself a C = 0 sample and no compute is wasted. SP sizes > 1 (`sp_sizes`) run the
  same grid on spawned SP groups (`profile_sp.py`).
- decode steps over (batch size, KV tokens per request): requests enter with random KV through the
  decode-side hand-off API (`reserve` + `add_prefilled`), so no prefill is needed to set them up.
- KV transfers between two spawned ranks of a real gloo group through `spindle_transfer.DataPlane`.
"""

from __future__ import annotations

import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .latency import DecodeStepModel, LatencyModel, PrefillLatencyModel, TransferModel
from .profile_sp import measure_sp_prefill, run_ranks

SP_NOT_MEASURED = "prefill for SP > 1 not measured (pass sp_sizes / --sp-sizes, e.g. 1,2,4)"


@dataclass(frozen=True)
class ProfileConfig:
    model: str = "smollm2"
    dtype: str = "float32"
    histories: tuple[int, ...] = (0, 512, 1024)  # C: tokens prefilled before the timed chunks
    chunks: tuple[int, ...] = (64, 256, 512)  # L: chunk lengths, timed one after another
    decode_batches: tuple[int, ...] = (1, 4, 8)
    decode_kv_tokens: tuple[int, ...] = (256, 1024, 2048)  # KV tokens per request
    transfer_bytes: tuple[int, ...] = (2**16, 2**20, 2**22, 2**24, 2**26)
    repeats: int = 3  # prefill repeats; decode steps and transfers take 4*repeats+1 (they are cheap)
    warmup: int = 1
    transfer: bool = True
    seed: int = 0
    sp_sizes: tuple[int, ...] = (1,)  # prefill SP sizes; > 1 runs on spawned local SP groups

    def __post_init__(self) -> None:
        if not self.chunks or min(self.chunks) < 1:
            raise ValueError(f"chunks must be non-empty lengths >= 1, got {self.chunks}")
        if not self.histories or min(self.histories) < 0:
            raise ValueError(f"histories must be non-empty and >= 0, got {self.histories}")
        if not self.decode_batches or min(self.decode_batches) < 1:
            raise ValueError(f"decode batch sizes must be >= 1, got {self.decode_batches}")
        if not self.decode_kv_tokens or min(self.decode_kv_tokens) < 1:
            raise ValueError(f"decode KV tokens must be >= 1, got {self.decode_kv_tokens}")
        if self.transfer and (not self.transfer_bytes or min(self.transfer_bytes) < 1):
            raise ValueError(f"transfer sizes must be >= 1 byte, got {self.transfer_bytes}")
        if 1 not in self.sp_sizes or min(self.sp_sizes) < 1 or len(set(self.sp_sizes)) != len(self.sp_sizes):
            raise ValueError(f"sp_sizes must be distinct sizes >= 1 including 1, got {self.sp_sizes}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {self.repeats}, {self.warmup}")

    @property
    def decode_steps(self) -> int:
        return 4 * self.repeats + 1

    @property
    def prefill_len(self) -> int:
        return max(self.histories) + sum(self.chunks) + 2  # +2: the sampled token must not end it by length

    @property
    def decode_len(self) -> int:
        return max(self.decode_kv_tokens) + self.warmup + self.decode_steps + 2


QUICK = ProfileConfig(
    histories=(0, 32),
    chunks=(8, 16),
    decode_batches=(1, 2),
    decode_kv_tokens=(16, 64),
    transfer_bytes=(2**12, 2**22, 2**24),
    repeats=1,
    warmup=1,
)


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


def _transfer_rank(rank: int, world: int, port: int, out_dir: str, sizes: list[int], steps: int, warmup: int) -> None:
    """One rank of the transfer benchmark (module level so spawned processes can import it)."""
    import torch
    import torch.distributed as dist

    from spindle_protocol import header_for
    from spindle_transfer import DataPlane

    torch.set_num_threads(1)
    plane = DataPlane.init(rank, world, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=60)
    rows = []
    try:
        tag = 0
        for size in sizes:
            header = header_for("uint8", [size])
            payload = torch.randint(0, 255, (size,), dtype=torch.uint8) if rank == 0 else None
            times = []
            for i in range(warmup + steps):
                tag += 1
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    plane.send(payload, 1, tag, header)
                else:
                    plane.recv(header, 0, tag)
                    if i >= warmup:
                        times.append(time.perf_counter() - t0)
            if rank == 1:
                rows.append([size, statistics.median(times)])
        if rank == 1:
            (Path(out_dir) / "transfer.json").write_text(json.dumps(rows))
    finally:
        plane.close()


def measure_transfer(cfg: ProfileConfig, timeout_s: float = 300.0) -> list[list[float]]:
    """[[bytes, median seconds], ...] from rank 0 to rank 1 of a spawned 2-rank gloo group (receiver's clock)."""
    from spindle_transfer.testing import free_port

    with tempfile.TemporaryDirectory() as d:
        args = (2, free_port(), d, list(cfg.transfer_bytes), cfg.decode_steps, cfg.warmup)
        run_ranks(_transfer_rank, 2, args, timeout_s, "the transfer benchmark")
        return json.loads((Path(d) / "transfer.json").read_text())


def _transfer_error(model: TransferModel, rows: list[list[float]]) -> float:
    return float(np.mean([abs(model.predict(b) - s) / s for b, s in rows]))


def load_model(cfg: ProfileConfig) -> Any:
    from spindle_engine.config import DTYPES
    from spindle_model import LlamaModel, load_state_dict, resolve_model

    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    source = resolve_model(cfg.model)
    model = LlamaModel(source.config, dtype=DTYPES[cfg.dtype])
    model.load_weights(load_state_dict(source.path, dtype=DTYPES[cfg.dtype]))
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
    """Measure, fit, and return the profile document (see `write_profile`)."""
    from tqdm import tqdm

    t_start = time.perf_counter()
    model = model if model is not None else load_model(cfg)
    engine = make_engine(cfg, model)
    plan_steps = len(cfg.histories) * len(cfg.chunks) + sum(1 for h in cfg.histories if h)
    total = cfg.warmup + cfg.repeats * plan_steps
    total += len(cfg.decode_batches) * len(cfg.decode_kv_tokens) * (cfg.warmup + cfg.decode_steps)
    sp_sizes = [s for s in cfg.sp_sizes if s > 1]
    total += len(sp_sizes) + (len(cfg.transfer_bytes) if cfg.transfer else 0)
    bar = tqdm(total=total, disable=not progress, unit="step")
    try:
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
    finally:
        bar.close()
    prefill = PrefillLatencyModel.fit([tuple(r) for r in prefill_rows])
    decode = DecodeStepModel.fit([tuple(r) for r in decode_rows])
    not_measured = {} if sp_sizes else {"prefill_sp_gt_1": SP_NOT_MEASURED}
    transfer = None
    if not cfg.transfer:
        not_measured["transfer"] = "disabled"
    else:
        try:
            transfer = TransferModel.fit([tuple(r) for r in transfer_rows])
        except ValueError as e:  # e.g. sizes too small to rise above the noise
            not_measured["transfer"] = f"fit failed: {e}"
    latency = LatencyModel(prefill=prefill, decode=decode, transfer=transfer, source=f"spindle profile: {cfg.model}")
    fit_error: dict[str, Any] = {
        "prefill": {str(sp): e for sp, e in prefill.fit_error().items()},
        "decode": {f"tp{tp}_kvp{kvp}": e for (tp, kvp), e in decode.fit_error().items()},
        "transfer": _transfer_error(transfer, transfer_rows) if transfer else None,
    }
    return {
        "machine": machine_info(),
        "config": asdict(cfg),
        "samples": {
            "prefill": {"columns": ["sp", "history", "chunk", "seconds"], "rows": prefill_rows},
            "decode": {"columns": ["tp", "kvp", "batch", "kv_tokens", "seconds"], "rows": decode_rows},
            "transfer": {"columns": ["bytes", "seconds"], "rows": transfer_rows},
        },
        "not_measured": not_measured,
        "model": json.loads(latency.to_json()),
        "fit_error": fit_error,
        "wall_s": time.perf_counter() - t_start,
    }


def write_profile(doc: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(doc, indent=1))


def load_profile(path: str | Path) -> LatencyModel:
    """The `LatencyModel` of a profile JSON written by `spindle profile`."""
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or "model" not in doc:
        raise ValueError(f"{path} is not a spindle profile (no 'model' key)")
    model = doc["model"]
    return LatencyModel.from_json(model if isinstance(model, str) else json.dumps(model))
