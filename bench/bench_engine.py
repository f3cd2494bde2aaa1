"""CPU benchmark: Spindle's single-instance engine against Hugging Face transformers, same model, same run.

Prefill: one prompt of T random token ids. Spindle runs it as a single `Engine.step()` (a request with
max_tokens=1 and a token budget >= T), which includes the forward pass, the last token's logits and sampling;
transformers runs `model(input_ids, logits_to_keep=1)`. tokens/s = T / time.

Decode: B prompts of --prompt-len random tokens, --new-tokens greedy tokens each (ignore_eos). Spindle's
decode time is the time of the steps after every request has its first token (the prefill steps are excluded);
transformers' is t(generate N) - t(generate 1). tokens/s = B * (N - 1) / decode time.

Every measurement is warmed up once, then the median of --repeats runs is taken. Spindle runs in every dtype of
--dtypes and its fastest one is reported; transformers runs in float32. Absolute numbers depend on the machine
(and on what else runs on it): compare the ratios.

    python bench/bench_engine.py                                   # full run, writes bench/results/engine.json
    python bench/bench_engine.py --prefill-tokens 128 --decode-batches 1,2 --prompt-len 32 --new-tokens 8 \\
        --repeats 1 --out /tmp/bench_smoke.json                    # smoke test
    python bench/bench_engine.py --profile                         # also: where Spindle's time goes
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from engine_roofline import format_roofline, roofline
from torch import Tensor
from torch.profiler import ProfilerActivity, profile, record_function
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from spindle_engine import Engine, EngineConfig, SamplingParams
from spindle_model import LlamaModel, ModelConfig, attach_gguf_blocks, load_state_dict, resolve_model

log = logging.getLogger("bench.engine")

ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = ROOT / "results" / "engine.json"
PROFILE_OUT_NAME = "engine_profile.txt"
TARGETS = {"prefill_2048_ratio": 3, "decode_b1_ratio": 5, "decode_b8_ratio": 3}
# transformers fp32 figures quoted in the issue that set the targets (tokens/s, on its machine)
REFERENCE_TRANSFORMERS = {"prefill_2048_tok_s": 370, "decode_b1_tok_s": 11.5, "decode_b8_tok_s": 58}
NATIVE_GEMM_LABEL = "spindle::cpu_gemm"  # Spindle's small-batch GEMM kernel (spindle_attention.cpu), not an aten op
GEMM_OPS = frozenset(
    {"aten::linear", "aten::matmul", "aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"}
    | {NATIVE_GEMM_LABEL}
)
ATTENTION_LABEL = "spindle::attention"
# SmolLM2-135M's shape, for --random-weights
RANDOM_LLAMA = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=1e5,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)


# ----------------------------------------------------------------------------------------------- arguments


def _int_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _dtype_list(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in values if v not in ("float32", "bfloat16", "float16")]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"dtypes must be among float32,bfloat16,float16, got {text!r}")
    return values


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    description, _, examples = __doc__.partition("\n\n    python")
    p = argparse.ArgumentParser(
        description=description,
        epilog="examples:\n    python" + examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2", help="model name or path for resolve_model (default: smollm2)")
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="use a random-weight Llama of SmolLM2-135M's shape instead of loading the model",
    )
    p.add_argument(
        "--prefill-tokens",
        type=_int_list,
        default=[512, 2048, 8192],
        metavar="T,...",
        help="prompt lengths of the prefill benchmark (default: 512,2048,8192)",
    )
    p.add_argument(
        "--decode-batches",
        type=_int_list,
        default=[1, 8, 32],
        metavar="B,...",
        help="batch sizes of the decode benchmark (default: 1,8,32)",
    )
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per decode request (default: 256)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per decode request (default: 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement, median reported (default: 3)")
    p.add_argument(
        "--dtypes",
        type=_dtype_list,
        default=["float32", "bfloat16"],
        metavar="D,...",
        help="Spindle dtypes to run; the fastest is reported (default: float32,bfloat16)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=default_threads(),
        help="torch.set_num_threads (default: all usable cores, here %(default)s)",
    )
    p.add_argument("--skip-transformers", action="store_true", help="only run Spindle (no ratios)")
    p.add_argument(
        "--no-fused-decode",
        action="store_true",
        help="run Spindle's decode steps through the torch layer loop instead of the one-call CPU kernel (A/B)",
    )
    p.add_argument(
        "--no-gguf-blocks",
        action="store_true",
        help="float32 decode matmuls read the dequantized float32 weights instead of the GGUF file's blocks (A/B)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and weights (default: 0)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default: {DEFAULT_OUT})")
    p.add_argument(
        "--profile",
        action="store_true",
        help=f"also profile one Spindle decode step and one prefill step per dtype; writes "
        f"{PROFILE_OUT_NAME} next to --out",
    )
    p.add_argument(
        "--profile-batches",
        type=_int_list,
        default=[1, 8],
        metavar="B,...",
        help="decode batch sizes profiled by --profile (default: 1,8)",
    )
    p.add_argument(
        "--profile-prefill-tokens", type=int, default=2048, help="prompt length profiled by --profile (default: 2048)"
    )
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (decode throughput counts the tokens after the first)")
    if min(args.prompt_len, args.repeats, args.threads, args.profile_prefill_tokens) < 1:
        p.error("--prompt-len, --repeats, --threads and --profile-prefill-tokens must be >= 1")
    return args


# ----------------------------------------------------------------------------------------------- models


@dataclass
class Models:
    name: str
    path: str | None
    config: ModelConfig
    spindle: dict[str, LlamaModel]  # by dtype name
    hf: LlamaForCausalLM | None
    pad_token_id: int
    fused_cpu_decode: bool = True
    gguf_blocks: int = 0  # float32 weights served from the GGUF file's quantized blocks


def _spindle_model(config: ModelConfig, state: dict[str, torch.Tensor], dtype: str) -> LlamaModel:
    model = LlamaModel(config, dtype=getattr(torch, dtype))
    model.load_weights(state)
    return model.eval()


def gguf_decode_bytes(models: Models) -> int | None:
    """Weight bytes one float32 decode step reads when its matmuls take GGUF blocks (None if they do not)."""
    model = models.spindle.get("float32")
    if model is None or not models.gguf_blocks:
        return None
    smalls = [getattr(layer, n).small for layer in model.layers for n in ("qkv_proj", "o_proj", "gate_up_proj")]
    smalls += [layer.down_proj.small for layer in model.layers] + [model._lm_head_small]
    return sum(s._packed.data.numel() * s._packed.data.element_size() for s in smalls if s._packed is not None)


def _load_hf(path: str) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def load_real_models(args: argparse.Namespace) -> Models:
    src = resolve_model(args.model)
    log.info("model %s at %s", src.name, src.path)
    spindle = {
        d: _spindle_model(src.config, load_state_dict(src.path, dtype=getattr(torch, d)), d) for d in args.dtypes
    }
    blocks = 0
    if src.gguf is not None and "float32" in spindle and not args.no_gguf_blocks:
        blocks = attach_gguf_blocks(spindle["float32"], src.gguf)
    hf = None if args.skip_transformers else _load_hf(str(src.path))
    pad = src.config.eos_token_ids[0] if src.config.eos_token_ids else 0
    return Models(src.name, str(src.path), src.config, spindle, hf, pad, not args.no_fused_decode, blocks)


def build_random_models(args: argparse.Namespace) -> Models:
    torch.manual_seed(args.seed)
    hf_config = LlamaConfig(**RANDOM_LLAMA)
    hf = LlamaForCausalLM(hf_config).eval()
    config = ModelConfig.from_hf(hf_config.to_dict())
    state = hf.state_dict()
    spindle = {d: _spindle_model(config, state, d) for d in args.dtypes}
    hf = None if args.skip_transformers else hf
    return Models("random-llama-135m", None, config, spindle, hf, 0, not args.no_fused_decode)


def load_models(args: argparse.Namespace) -> Models:
    t0 = time.perf_counter()
    models = build_random_models(args) if args.random_weights else load_real_models(args)
    log.info(
        "models ready in %.1fs (spindle: %s; transformers: %s)",
        time.perf_counter() - t0,
        ",".join(models.spindle),
        "float32" if models.hf is not None else "skipped",
    )
    return models


# ----------------------------------------------------------------------------------------------- timing


@dataclass
class Timer:
    """Warm-up plus median of `repeats` runs, advancing a shared progress bar."""

    repeats: int
    bar: tqdm

    def median(self, label: str, run: Callable[[], float]) -> tuple[float, list[float]]:
        """`run` performs one measurement and returns its duration in seconds."""
        self.bar.set_postfix_str(label)
        run()
        self.bar.update(1)
        times = []
        for _ in range(self.repeats):
            times.append(run())
            self.bar.update(1)
        med = statistics.median(times)
        log.info("%s: median %.4fs of %s", label, med, ", ".join(f"{t:.4f}" for t in times))
        return med, times


def random_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=gen).tolist()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ----------------------------------------------------------------------------------------------- spindle


def spindle_engine(models: Models, dtype: str, *, batch: int, seq_len: int, budget: int) -> Engine:
    """A fresh engine over the in-memory model, sized for `batch` sequences of `seq_len` tokens in total."""
    block = EngineConfig().block_size
    config = EngineConfig(
        model=models.path or models.name,
        dtype=dtype,
        max_num_batched_tokens=budget,
        max_num_seqs=max(batch, 1),
        kv_cache_tokens=batch * _round_up(seq_len, block) + block,
        max_model_len=seq_len,  # the model's context can exceed the KV cache we allocate
        fused_cpu_decode=models.fused_cpu_decode,
    )
    return Engine(config, model=models.spindle[dtype])


def _check_drained(eng: Engine) -> None:
    if eng.has_unfinished() or eng.allocator.num_used:
        raise RuntimeError(f"engine not drained: {eng.allocator.num_used} KV blocks still in use")


class SpindleRuns:
    """One engine per benchmark point, reused (and checked drained) across its warm-up and repeats."""

    def __init__(self, eng: Engine, tag: str) -> None:
        self.eng = eng
        self.tag = tag
        self.count = 0
        self.steps_left = 0  # every step that schedules work computes >= 1 token, so this bounds a hang

    def add(self, prompts: list[list[int]], max_tokens: int) -> list[str]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        rids = []
        for prompt in prompts:
            rid = f"{self.tag}-{self.count}"
            self.count += 1
            self.eng.add_request(rid, prompt, params)
            rids.append(rid)
            self.steps_left += len(prompt) + max_tokens
        return rids

    def _step(self) -> tuple[float, list[Any]]:
        t0 = time.perf_counter()
        outs = self.eng.step()
        elapsed = time.perf_counter() - t0
        self.steps_left -= 1
        if self.steps_left < 0:  # an empty output alone is no proof: a partial prefill chunk samples nothing
            raise RuntimeError("the engine stopped making progress")
        return elapsed, outs

    def prefill(self, prompt: list[int]) -> float:
        """Seconds of the one step that prefills `prompt` and samples its token."""
        self.add([prompt], max_tokens=1)
        elapsed, outs = self._step()
        if len(outs) != 1 or not outs[0].finished:
            raise RuntimeError(f"the prefill did not finish in one step ({outs}); is max_num_batched_tokens >= T?")
        _check_drained(self.eng)
        return elapsed

    def run_until_first_tokens(self, prompts: list[list[int]], max_tokens: int) -> list[str]:
        """Add the requests and step until every one has produced its first token."""
        rids = self.add(prompts, max_tokens)
        pending = set(rids)
        while pending:
            _, outs = self._step()
            pending -= {o.request_id for o in outs if o.new_token_ids}
        return rids

    def decode(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Seconds of the steps after every request's first token; checks they made B * (N - 1) tokens."""
        self.run_until_first_tokens(prompts, new_tokens)
        elapsed, produced = 0.0, 0
        while self.eng.has_unfinished():
            dt, outs = self._step()
            elapsed += dt
            produced += sum(len(o.new_token_ids) for o in outs)
        expected = len(prompts) * (new_tokens - 1)
        if produced != expected:
            raise RuntimeError(
                f"decode produced {produced} tokens, expected {expected}: was the prefill chunked "
                "(max_num_batched_tokens < batch * prompt length)?"
            )
        _check_drained(self.eng)
        return elapsed


# ----------------------------------------------------------------------------------------------- transformers


def hf_logits_kwarg(hf: LlamaForCausalLM) -> dict[str, int]:
    """The forward kwarg that limits logits to the last token, if this transformers has one."""
    params = inspect.signature(hf.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: 1}
    return {}


def hf_prefill(hf: LlamaForCausalLM, ids: torch.Tensor, kwargs: dict[str, int]) -> float:
    with torch.inference_mode():
        t0 = time.perf_counter()
        hf(input_ids=ids, **kwargs)
        return time.perf_counter() - t0


def hf_generate(hf: LlamaForCausalLM, ids: torch.Tensor, new_tokens: int, pad: int) -> float:
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
        elapsed = time.perf_counter() - t0
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"generate made {out.shape[1] - ids.shape[1]} tokens, expected {new_tokens}")
    return elapsed


# ----------------------------------------------------------------------------------------------- benchmarks


def _pick_fastest(by_dtype: dict[str, float]) -> tuple[str, float]:
    dtype = max(by_dtype, key=lambda d: by_dtype[d])
    return dtype, by_dtype[dtype]


def _row(key: str, value: int, by_dtype: dict[str, float], hf_tok_s: float | None, details: dict) -> dict[str, Any]:
    dtype, best = _pick_fastest(by_dtype)
    return {
        key: value,
        "spindle_tok_s": best,
        "spindle_dtype": dtype,
        "spindle_by_dtype": by_dtype,
        "transformers_tok_s": hf_tok_s,
        "ratio": best / hf_tok_s if hf_tok_s else None,
        "details": details,
    }


def bench_prefill_point(models: Models, tokens: int, timer: Timer, args: argparse.Namespace) -> dict[str, Any]:
    if tokens > models.config.max_position_embeddings:
        log.warning(
            "prefill of %d tokens exceeds the model's context (%d)", tokens, models.config.max_position_embeddings
        )
    prompt = random_prompts(models.config.vocab_size, 1, tokens, args.seed)[0]
    by_dtype: dict[str, float] = {}
    details: dict[str, Any] = {"spindle": {}}
    for dtype in args.dtypes:
        log.info("prefill T=%d: spindle %s", tokens, dtype)
        eng = spindle_engine(models, dtype, batch=1, seq_len=tokens, budget=tokens)
        runs = SpindleRuns(eng, f"prefill{tokens}")
        med, times = timer.median(f"prefill {tokens} spindle {dtype}", lambda r=runs: r.prefill(prompt))
        by_dtype[dtype] = tokens / med
        details["spindle"][dtype] = {"median_s": med, "runs_s": times}
        del eng, runs
    hf_tok_s = None
    if models.hf is not None:
        log.info("prefill T=%d: transformers float32", tokens)
        ids = torch.tensor([prompt])
        kwargs = hf_logits_kwarg(models.hf)
        med, times = timer.median(f"prefill {tokens} transformers", lambda: hf_prefill(models.hf, ids, kwargs))
        hf_tok_s = tokens / med
        details["transformers"] = {"median_s": med, "runs_s": times}
    return _row("tokens", tokens, by_dtype, hf_tok_s, details)


def _hf_decode(
    models: Models, prompts: list[list[int]], timer: Timer, args: argparse.Namespace
) -> tuple[float | None, dict[str, Any]]:
    ids = torch.tensor(prompts)
    hf, pad, n, b = models.hf, models.pad_token_id, args.new_tokens, len(prompts)
    full, full_runs = timer.median(f"decode b{b} transformers gen{n}", lambda: hf_generate(hf, ids, n, pad))
    one, one_runs = timer.median(f"decode b{b} transformers gen1", lambda: hf_generate(hf, ids, 1, pad))
    details = {
        "generate_n_median_s": full,
        "generate_1_median_s": one,
        "generate_n_runs_s": full_runs,
        "generate_1_runs_s": one_runs,
    }
    if full <= one:
        log.warning("decode b%d: t(generate %d) <= t(generate 1); transformers decode rate undefined", b, n)
        return None, details
    return b * (n - 1) / (full - one), details


def bench_decode_point(models: Models, batch: int, timer: Timer, args: argparse.Namespace) -> dict[str, Any]:
    prompts = random_prompts(models.config.vocab_size, batch, args.prompt_len, args.seed + batch)
    decoded = batch * (args.new_tokens - 1)
    by_dtype: dict[str, float] = {}
    details: dict[str, Any] = {"spindle": {}}
    for dtype in args.dtypes:
        log.info("decode B=%d: spindle %s", batch, dtype)
        seq_len = args.prompt_len + args.new_tokens
        eng = spindle_engine(models, dtype, batch=batch, seq_len=seq_len, budget=batch * args.prompt_len)
        runs = SpindleRuns(eng, f"decode{batch}")
        label = f"decode b{batch} spindle {dtype}"
        med, times = timer.median(label, lambda r=runs: r.decode(prompts, args.new_tokens))
        by_dtype[dtype] = decoded / med
        details["spindle"][dtype] = {"median_s": med, "runs_s": times}
        del eng, runs
    hf_tok_s = None
    if models.hf is not None:
        log.info("decode B=%d: transformers float32", batch)
        hf_tok_s, details["transformers"] = _hf_decode(models, prompts, timer, args)
    return _row("batch", batch, by_dtype, hf_tok_s, details)


def count_runs(args: argparse.Namespace, with_hf: bool) -> int:
    per = 1 + args.repeats
    prefill = len(args.prefill_tokens) * per * (len(args.dtypes) + (1 if with_hf else 0))
    decode = len(args.decode_batches) * per * (len(args.dtypes) + (2 if with_hf else 0))
    return prefill + decode


# ----------------------------------------------------------------------------------------------- profile


@contextlib.contextmanager
def labelled_attention() -> Iterator[None]:
    """Wrap the engine's attention and Spindle's native GEMMs (float32/bf16 and GGUF-block weights) in profiler
    ranges so their time (KV writes included) can be attributed: the native kernels are not aten ops the
    profiler would name."""
    from spindle_attention.cpu import GGUFPackedWeight, PackedWeight
    from spindle_engine.attention import PagedAttentionContext

    original = PagedAttentionContext.attention
    own = {cls: vars(cls).get("linear") for cls in (PackedWeight, GGUFPackedWeight)}  # None: inherited

    def attention(self: PagedAttentionContext, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with record_function(ATTENTION_LABEL):
            return original(self, layer, q, k, v)

    def labelled(linear: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def gemm(self: PackedWeight, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
            with record_function(NATIVE_GEMM_LABEL):
                return linear(self, x, out_dtype)

        return gemm

    PagedAttentionContext.attention = attention
    for cls in own:
        cls.linear = labelled(cls.linear)
    try:
        yield
    finally:
        PagedAttentionContext.attention = original
        for cls, fn in own.items():
            if fn is None:
                del cls.linear
            else:
                cls.linear = fn


def _has_ancestor(event: Any, names: frozenset[str]) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in names:
            return True
        parent = parent.cpu_parent
    return False


def time_breakdown(events: list[Any], wall_us: float, native: dict[str, float] | None = None) -> dict[str, float]:
    """Fractions of the step's wall time in GEMMs (outside attention), in attention, and elsewhere. `native`:
    seconds by phase inside the fused CPU decode call, which the profiler sees as one opaque op."""
    native = native or {}
    attention = sum(e.cpu_time_total for e in events if e.name == ATTENTION_LABEL) + 1e6 * native.get("attention", 0)
    gemm = sum(
        e.cpu_time_total for e in events if e.name in GEMM_OPS and not _has_ancestor(e, GEMM_OPS | {ATTENTION_LABEL})
    ) + 1e6 * native.get("gemm", 0)
    other = max(wall_us - attention - gemm, 0.0)
    return {
        "gemm": gemm / wall_us,
        "attention": attention / wall_us,
        "other": other / wall_us,
        "wall_ms": wall_us / 1e3,
    }


def profile_one_step(runs: SpindleRuns) -> tuple[str, dict[str, float]]:
    fused = runs.eng.runner.cpu_decode
    before = fused.phases() if fused is not None else {}
    with labelled_attention(), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        runs.eng.step()
        wall_us = (time.perf_counter() - t0) * 1e6
    native = {k: v - before[k] for k, v in fused.phases().items()} if fused is not None else {}
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    if any(native.values()):
        inside = ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in native.items())
        table = f"inside the fused CPU decode call: {inside}\n{table}"
    return table, time_breakdown(list(prof.events()), wall_us, native)


def profile_decode(models: Models, dtype: str, batch: int, args: argparse.Namespace) -> tuple[str, dict[str, float]]:
    prompts = random_prompts(models.config.vocab_size, batch, args.prompt_len, args.seed + batch)
    seq_len = args.prompt_len + 4
    runs = SpindleRuns(
        spindle_engine(models, dtype, batch=batch, seq_len=seq_len, budget=batch * args.prompt_len), "profile"
    )
    runs.run_until_first_tokens(prompts, max_tokens=4)
    runs.eng.step()  # one unprofiled decode step, then the profiled one
    return profile_one_step(runs)


def profile_prefill(models: Models, dtype: str, tokens: int, args: argparse.Namespace) -> tuple[str, dict[str, float]]:
    prompt = random_prompts(models.config.vocab_size, 1, tokens, args.seed)[0]
    runs = SpindleRuns(spindle_engine(models, dtype, batch=1, seq_len=tokens, budget=tokens), "profile")
    runs.prefill(prompt)  # warm-up
    runs.add([prompt], max_tokens=1)
    return profile_one_step(runs)


def run_profiles(models: Models, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    sections, summary = [], {}
    cases = [
        (f"decode step, batch {b}", lambda d, b=b: profile_decode(models, d, b, args)) for b in args.profile_batches
    ]
    t = args.profile_prefill_tokens
    cases.append((f"prefill step, {t} tokens", lambda d: profile_prefill(models, d, t, args)))
    for dtype in args.dtypes:
        for name, fn in cases:
            log.info("profiling %s, %s", name, dtype)
            table, split = fn(dtype)
            title = f"{name}, {dtype}"
            summary[title] = split
            sections.append(
                f"=== {title}: wall {split['wall_ms']:.1f} ms under the profiler; {format_split(split)} ===\n{table}"
            )
    return "\n\n".join(sections), summary


def format_split(split: dict[str, float]) -> str:
    return f"GEMM (mm/addmm/linear) {split['gemm']:.0%}, attention {split['attention']:.0%}, other {split['other']:.0%}"


# ----------------------------------------------------------------------------------------------- report


def machine_info() -> dict[str, Any]:
    cpu_model = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout.strip()
    return {
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "usable_cores": default_threads(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_commit": commit,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _target_for(kind: str, size: int) -> int | None:
    key = f"prefill_{size}_ratio" if kind == "prefill" else f"decode_b{size}_ratio"
    return TARGETS.get(key)


def format_table(result: dict[str, Any]) -> str:
    header = ("benchmark", "spindle tok/s (dtype)", "transformers tok/s", "ratio", "target")
    rows = [header]
    for kind, key, unit in (("prefill", "tokens", "tokens"), ("decode", "batch", "batch")):
        for r in result[kind]:
            target = _target_for(kind, r[key])
            met = "" if target is None or r["ratio"] is None else (" ok" if r["ratio"] >= target else " MISS")
            rows.append(
                (
                    f"{kind} {unit}={r[key]}",
                    f"{r['spindle_tok_s']:.1f} ({r['spindle_dtype']})",
                    _fmt(r["transformers_tok_s"]),
                    _fmt(r["ratio"], ".2f") + ("x" if r["ratio"] is not None else ""),
                    (f">= {target}x" if target is not None else "-") + met,
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_dtypes(result: dict[str, Any]) -> str:
    lines = []
    for kind, key in (("prefill", "tokens"), ("decode", "batch")):
        for r in result[kind]:
            per = ", ".join(f"{d} {v:.1f}" for d, v in r["spindle_by_dtype"].items())
            lines.append(f"  {kind} {key}={r[key]}: {per}")
    return "spindle tok/s by dtype:\n" + "\n".join(lines)


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    log.info("wrote %s", path)


# ----------------------------------------------------------------------------------------------- main


def run_benchmarks(models: Models, args: argparse.Namespace) -> dict[str, Any]:
    total = count_runs(args, models.hf is not None)
    with logging_redirect_tqdm(), tqdm(total=total, desc="bench", unit="run", file=sys.stderr) as bar:
        timer = Timer(args.repeats, bar)
        prefill = [bench_prefill_point(models, t, timer, args) for t in args.prefill_tokens]
        decode = [bench_decode_point(models, b, timer, args) for b in args.decode_batches]
    return {"prefill": prefill, "decode": decode}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    models = load_models(args)
    hf_logits = None
    if models.hf is not None:
        hf_logits = ", ".join(f"{k}={v}" for k, v in hf_logits_kwarg(models.hf).items()) or "full logits"
        log.info("transformers prefill computes %s", hf_logits)
    measured = run_benchmarks(models, args)
    result: dict[str, Any] = {
        "machine": machine_info(),
        "model": {"name": models.name, "path": models.path, "random_weights": args.random_weights},
        "settings": {
            "prefill_tokens": args.prefill_tokens,
            "decode_batches": args.decode_batches,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "spindle_dtypes": args.dtypes,
            "spindle_fused_cpu_decode": models.fused_cpu_decode,
            "spindle_float32_gguf_blocks": models.gguf_blocks,
            "transformers_dtype": None if models.hf is None else "float32",
            "transformers_prefill_logits": hf_logits,
            "transformers_attn_implementation": getattr(models.hf.config, "_attn_implementation", None)
            if models.hf is not None
            else None,
            "seed": args.seed,
        },
        **measured,
        "targets": TARGETS,
        "reference_transformers_fp32": REFERENCE_TRANSFORMERS,
        "roofline": roofline(models.config, args.dtypes, measured, gguf_decode_bytes(models)),
    }
    if args.profile:
        text, summary = run_profiles(models, args)
        result["profile"] = summary
        profile_path = args.out.parent / PROFILE_OUT_NAME
        profile_path.parent.mkdir(parents=True, exist_ok=True)
        profile_path.write_text(text + "\n")
        log.info("wrote %s", profile_path)
    write_json(args.out, result)
    print(
        f"\nSpindle vs transformers ({models.name}, {torch.get_num_threads()} threads; "
        f"transformers prefill: {hf_logits or 'skipped'})"
    )
    print(format_table(result))
    print(format_dtypes(result))
    print(format_roofline(result["roofline"]))
    if args.profile:
        print("\nwhere Spindle's time goes (fractions of one step's wall time under the profiler):")
        for title, split in result["profile"].items():
            print(f"  {title}: {format_split(split)} ({split['wall_ms']:.1f} ms)")
        print(f"\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
