"""Spindle's engine vs transformers on a GPU, on the same random weights (no download, no tokenizer needed).

    PYTHONPATH=libs/attention:libs/model:libs/engine python3 bench/bench_engine_gpu.py [--shape llama-1b]
    .venv/bin/python bench/bench_engine_gpu.py --smoke      # the same logic on CPU, tiny model, torch backend

A random-weight Llama of the chosen shape (default SmolLM2-135M's) is saved with transformers'
`save_pretrained` (safetensors, bf16 values) into a temp dir; Spindle's `Engine` and `LlamaForCausalLM` load that
same directory. Prompts are token ids. Measured:
- exactness (fp32): last-token logits of a ~300-token prompt (max abs diff), 16 greedy tokens (identical?) and
  the logits of every decode step (max abs diff vs transformers' generate logits), decode steps replaying
  CUDA graphs unless --no-cuda-graphs;
- prefill tok/s (bf16): one engine step over the whole prompt vs one transformers forward (logits_to_keep=1);
- decode tok/s (bf16): B requests, ~512-token prompts, fixed output length (ignore_eos), the decode steps after
  every first token vs transformers `generate` (dynamic cache, greedy): t(generate N) - t(generate 1); with
  CUDA graphs on, Spindle's eager decode (graphs off) too, unless --no-eager-decode, and the capture times.
Writes bench/results/engine_gpu.json (rows shaped like engine.json's, ratio = spindle / transformers).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from spindle_engine import Engine, EngineConfig, SamplingParams
from spindle_engine.cuda_graphs import EMULATE_ENV

RESULTS = Path(__file__).resolve().parent / "results" / "engine_gpu.json"

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "tiny": dict(  # --smoke
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=[s for s in SHAPES if s != "tiny"], default="smollm2-135m")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, torch backend, small sizes")
    ap.add_argument("--device", default=None, help="default cuda (cpu with --smoke)")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode steps replay CUDA graphs (triton backend; with --smoke: the static-buffer path, emulated)",
    )
    ap.add_argument(
        "--eager-decode",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with CUDA graphs on, also time Spindle's decode with them off",
    )
    ap.add_argument("--prefill-tokens", default="2048,8192")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=512, help="decode prompt length")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--exact-prompt", type=int, default=300)
    ap.add_argument("--exact-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-transformers", action="store_true", help="Spindle only")
    ap.add_argument("--out", type=Path, default=None, help=f"results JSON (default {RESULTS}; none with --smoke)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape = "tiny"
        args.device = args.device or "cpu"
        args.attention_backend = "torch" if args.attention_backend == "auto" else args.attention_backend
        smoke = dict(prefill_tokens="64,256", batches="1,4", context=32, new_tokens=8, exact_prompt=40, repeats=2)
        smoke["exact_tokens"] = 8
        for name, value in smoke.items():  # smaller defaults; what the command line sets stays
            if getattr(args, name) == ap.get_default(name):
                setattr(args, name, value)
    args.device = args.device or "cuda"
    if not args.smoke and not args.device.startswith("cuda"):
        ap.error("the GPU benchmark runs on CUDA; use --smoke for the CPU check")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: CUDA is not available (use --smoke to run the benchmark logic on CPU)", file=sys.stderr)
        raise SystemExit(2)
    args.prefill_tokens = [int(x) for x in args.prefill_tokens.split(",") if x]
    args.batches = [int(x) for x in args.batches.split(",") if x]
    return args


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], float], repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up: triton compiles, caches and allocators settle
    runs = [fn() for _ in range(repeats)]
    return statistics.median(runs), runs


def save_random_model(shape: str, path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2)
    # bf16 values: both loaders read exactly the same numbers, in fp32 for the exactness check
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def load_hf(path: Path, dtype: torch.dtype, device: str):  # -> LlamaForCausalLM
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()


def prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=g).tolist()


class Spindle:
    """An engine plus the step loops the benchmark times."""

    def __init__(
        self,
        args: argparse.Namespace,
        path: Path,
        dtype: str,
        kv_tokens: int,
        budget: int,
        cuda_graphs: bool | None = None,
    ) -> None:
        self.device = args.device
        kv_tokens = -(-kv_tokens // 16) * 16  # whole blocks, so max_model_len below fits the cache
        self.engine = Engine(
            EngineConfig(
                model=str(path),
                dtype=dtype,
                device=args.device,
                attention_backend=args.attention_backend,
                kv_cache_tokens=kv_tokens,
                max_model_len=min(kv_tokens, SHAPES[args.shape]["max_position_embeddings"]),
                max_num_batched_tokens=budget,
                max_num_seqs=max(256, max(args.batches)),
                cuda_graphs=args.cuda_graphs if cuda_graphs is None else cuda_graphs,
            )
        )
        self._ids = 0

    def add(self, batch: list[list[int]], max_tokens: int) -> list[str]:
        rids = []
        for ids in batch:
            rid = f"r{self._ids}"
            self._ids += 1
            self.engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            rids.append(rid)
        return rids

    def generate(self, batch: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
        out = {rid: [] for rid in self.add(batch, max_tokens)}
        while self.engine.has_unfinished():
            for o in self.engine.step():
                out[o.request_id] += o.new_token_ids
        return out

    def recorded_generate(self, ids: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy tokens of one request and the fp32 logits `[vocab]` each of its steps sampled from."""
        captured: list[torch.Tensor] = []
        run = self.engine.runner.run

        def recording(chunks: Any) -> Any:
            logits, rows = run(chunks)
            captured.append(logits.to("cpu", torch.float32, copy=True))  # graph steps return a static buffer
            return logits, rows

        self.engine.runner.run = recording
        try:
            tokens = next(iter(self.generate([ids], max_tokens).values()))
        finally:
            self.engine.runner.run = run
        return tokens, [c[0] for c in captured if c.shape[0]]

    def graph_stats(self) -> dict[str, Any]:
        graphs = self.engine.runner.decode_graphs
        if graphs is None:
            return {"cuda_graphs": None}
        return {
            "cuda_graphs": graphs.mode,
            "graph_steps_per_bucket": dict(sorted(graphs.bucket_steps.items())),
            "graph_capture_s": dict(sorted(graphs.capture_s.items())),
        }

    def prefill_s(self, ids: list[int]) -> float:
        self.add([ids], 1)
        sync(self.device)
        t0 = time.perf_counter()
        while self.engine.has_unfinished():
            self.engine.step()
        sync(self.device)
        return time.perf_counter() - t0

    def decode_s(self, batch: list[list[int]], new_tokens: int) -> float:
        """Seconds for the steps after every request has its first token (new_tokens - 1 tokens each)."""
        pending = set(self.add(batch, new_tokens))
        while pending:  # prefill steps (and their first tokens) are not timed
            for o in self.engine.step():
                pending.discard(o.request_id)
        sync(self.device)
        t0 = time.perf_counter()
        while self.engine.has_unfinished():
            self.engine.step()
        sync(self.device)
        return time.perf_counter() - t0

    def close(self) -> None:
        del self.engine
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


def hf_prefill_s(hf: Any, ids: torch.Tensor, device: str) -> float:
    with torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        hf(input_ids=ids, logits_to_keep=1)
        sync(device)
        return time.perf_counter() - t0


def hf_generate(hf: Any, ids: torch.Tensor, new_tokens: int, *, logits: bool = False) -> Any:
    """New tokens `[B, new_tokens]`; with `logits`, also each step's raw logits `[B, vocab]`."""
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            output_logits=logits,
            return_dict_in_generate=logits,
        )
    seqs = out.sequences if logits else out
    if seqs.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"generate made {seqs.shape[1] - ids.shape[1]} tokens, expected {new_tokens}")
    if logits:
        return seqs[:, ids.shape[1] :], [x.float().cpu() for x in out.logits]
    return seqs[:, ids.shape[1] :]


def hf_generate_s(hf: Any, ids: torch.Tensor, new_tokens: int, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    hf_generate(hf, ids, new_tokens)
    sync(device)
    return time.perf_counter() - t0


def bench_exactness(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    vocab = SHAPES[args.shape]["vocab_size"]
    ids = prompts(vocab, 1, args.exact_prompt, seed=1)[0]
    kv = args.exact_prompt + args.exact_tokens + 64
    spindle = Spindle(args, path, "float32", kv, budget=kv)
    our_tokens, our_logits = spindle.recorded_generate(ids, args.exact_tokens)  # step 0 prefills, then decodes
    row: dict[str, Any] = {"prompt_tokens": len(ids), "greedy_tokens": args.exact_tokens, "dtype": "float32"}
    row.update(spindle_greedy=our_tokens, **spindle.graph_stats())
    spindle.close()
    if args.no_transformers:
        return row
    hf = load_hf(path, torch.float32, args.device)
    x = torch.tensor([ids], device=args.device)
    ref_tokens, ref_logits = hf_generate(hf, x, args.exact_tokens, logits=True)
    ref_tokens = ref_tokens[0].tolist()
    del hf
    ours, ref = our_logits[0], ref_logits[0][0]
    diff = float((ours - ref).abs().max())
    # decode steps up to the first differing token (after it, the two continue different texts)
    same = next((i for i, (a, b) in enumerate(zip(our_tokens, ref_tokens, strict=True)) if a != b), len(ref_tokens))
    steps = range(1, min(same + 1, len(our_logits), len(ref_logits)))
    decode_diff = max((float((our_logits[i] - ref_logits[i][0]).abs().max()) for i in steps), default=None)
    row.update(
        max_abs_logit_diff=diff,
        max_abs_logit=float(ref.abs().max()),
        relative_to_logit_scale=diff / max(float(ref.abs().max()), 1e-12),
        decode_steps_compared=len(steps),
        max_abs_decode_logit_diff=decode_diff,
        transformers_greedy=ref_tokens,
        greedy_identical=our_tokens == ref_tokens,
    )
    return row


def _row(key: str, value: int, ours: float, theirs: float | None, details: dict[str, Any]) -> dict[str, Any]:
    return {
        key: value,
        "spindle_tok_s": ours,
        "spindle_dtype": details["dtype"],
        "transformers_tok_s": theirs,
        "ratio": ours / theirs if theirs else None,
        "details": details,
    }


def bench_prefill(args: argparse.Namespace, path: Path, dtype: str, hf: Any) -> list[dict[str, Any]]:
    vocab, rows = SHAPES[args.shape]["vocab_size"], []
    for n in args.prefill_tokens:
        ids = prompts(vocab, 1, n, seed=2)[0]
        spindle = Spindle(args, path, dtype, n + 64, budget=n)
        med, runs = median_time(lambda s=spindle, i=ids: s.prefill_s(i), args.repeats)
        spindle.close()
        details: dict[str, Any] = {"dtype": dtype, "spindle_median_s": med, "spindle_runs_s": runs}
        theirs = None
        if hf is not None:
            x = torch.tensor([ids], device=args.device)
            hmed, hruns = median_time(lambda x=x: hf_prefill_s(hf, x, args.device), args.repeats)
            details.update(transformers_median_s=hmed, transformers_runs_s=hruns)
            theirs = n / hmed
        rows.append(_row("tokens", n, n / med, theirs, details))
        log_row("prefill", rows[-1])
    return rows


def bench_decode(args: argparse.Namespace, path: Path, dtype: str, hf: Any) -> list[dict[str, Any]]:
    vocab, rows, n = SHAPES[args.shape]["vocab_size"], [], args.new_tokens
    for b in args.batches:
        batch = prompts(vocab, b, args.context, seed=3 + b)
        kv = b * (args.context + n + 16) + 64
        spindle = Spindle(args, path, dtype, kv, budget=max(2048, args.context))
        med, runs = median_time(lambda s=spindle, p=batch: s.decode_s(p, n), args.repeats)
        details: dict[str, Any] = {"dtype": dtype, "spindle_median_s": med, "spindle_runs_s": runs}
        details.update(spindle.graph_stats())
        spindle.close()
        if details["cuda_graphs"] and args.eager_decode:
            eager = Spindle(args, path, dtype, kv, budget=max(2048, args.context), cuda_graphs=False)
            emed, eruns = median_time(lambda s=eager, p=batch: s.decode_s(p, n), args.repeats)
            eager.close()
            details.update(spindle_eager_median_s=emed, spindle_eager_runs_s=eruns)
            details["spindle_eager_tok_s"] = b * (n - 1) / emed
        theirs = None
        if hf is not None:
            x = torch.tensor(batch, device=args.device)
            full, full_runs = median_time(lambda x=x: hf_generate_s(hf, x, n, args.device), args.repeats)
            one, one_runs = median_time(lambda x=x: hf_generate_s(hf, x, 1, args.device), args.repeats)
            details.update(
                transformers_generate_n_median_s=full,
                transformers_generate_1_median_s=one,
                transformers_generate_n_runs_s=full_runs,
                transformers_generate_1_runs_s=one_runs,
            )
            theirs = b * (n - 1) / (full - one) if full > one else None
        rows.append(_row("batch", b, b * (n - 1) / med, theirs, details))
        log_row("decode", rows[-1])
    return rows


def log_row(kind: str, row: dict[str, Any]) -> None:
    key = "tokens" if "tokens" in row else "batch"
    theirs = row["transformers_tok_s"]
    ratio = f"{row['ratio']:.2f}x" if row["ratio"] else "-"
    eager = row["details"].get("spindle_eager_tok_s")
    print(
        f"{kind:8s} {key}={row[key]:<6d} spindle {row['spindle_tok_s']:>11.1f} tok/s   "
        f"transformers {theirs if theirs is None else f'{theirs:>11.1f}'} tok/s   ratio {ratio}"
        + (f"   (spindle without graphs {eager:.1f} tok/s)" if eager else ""),
        flush=True,
    )


def machine(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "device": args.device,
        "device_name": (
            torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else platform.processor()
        ),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.smoke and args.cuda_graphs and not args.device.startswith("cuda"):
        os.environ[EMULATE_ENV] = "1"  # no graphs on CPU: the static-buffer path with the forward run eagerly
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 exactness on both sides
    torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory(prefix="spindle-bench-gpu-") as tmp:
        path = Path(tmp) / args.shape
        save_random_model(args.shape, path)
        print(f"random {args.shape} saved in {time.perf_counter() - t_start:.1f}s; device {args.device}", flush=True)
        exact = bench_exactness(args, path)
        if "max_abs_logit_diff" in exact:
            decode_diff = exact["max_abs_decode_logit_diff"]
            print(
                f"exactness fp32: max |logit diff| {exact['max_abs_logit_diff']:.3g} "
                f"(max |logit| {exact['max_abs_logit']:.3g}); decode steps {exact['decode_steps_compared']} "
                f"max |logit diff| {'-' if decode_diff is None else f'{decode_diff:.3g}'} (graphs: "
                f"{exact['cuda_graphs'] or 'off'}, steps per bucket {exact.get('graph_steps_per_bucket', {})}); "
                f"greedy {args.exact_tokens} tokens identical: {'yes' if exact['greedy_identical'] else 'no'}",
                flush=True,
            )
        dtype = "float32" if args.smoke else "bfloat16"
        hf = None if args.no_transformers else load_hf(path, getattr(torch, dtype), args.device)
        prefill = bench_prefill(args, path, dtype, hf)
        decode = bench_decode(args, path, dtype, hf)
        del hf
    engine_backend = EngineConfig(device=args.device, attention_backend=args.attention_backend)
    result = {
        "machine": machine(args),
        "model": {"shape": args.shape, "random_weights": True, **SHAPES[args.shape]},
        "settings": {
            "dtype": dtype,
            "attention_backend": engine_backend.resolved_attention_backend,
            "cuda_graphs": args.cuda_graphs,
            "prefill_tokens": args.prefill_tokens,
            "decode_batches": args.batches,
            "decode_context": args.context,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "transformers_attn_implementation": "sdpa",
            "transformers_cache": "dynamic (generate default)",
            "transformers_prefill_logits": "logits_to_keep=1",
            "tf32": False,
        },
        "exactness": exact,
        "prefill": prefill,
        "decode": decode,
        "wall_s": time.perf_counter() - t_start,
    }
    out = args.out if args.out is not None else (None if args.smoke else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    print(f"done in {result['wall_s']:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
