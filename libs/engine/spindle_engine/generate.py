"""Generate text from the command line: `python -m spindle_engine.generate --prompt "Hello" --chat`."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from .config import ATTENTION_BACKENDS, DTYPES
from .llm import LLM
from .sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m spindle_engine.generate",
        description="Generate a continuation of one prompt with Spindle's single-instance engine.",
    )
    ap.add_argument("--model", default="smollm2", help="model name (smollm2), HF Llama directory or .gguf file")
    ap.add_argument("--prompt", required=True, help="prompt text (a user message with --chat)")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    ap.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="auto (default): on CUDA flash-attn (float16/bfloat16, block size a multiple of 256), else triton; on "
        "CPU torch (Spindle's native kernels where built, else the reference). reference/cpu/triton/flash-attn: "
        "that backend of spindle_attention.backends, or an error saying why it cannot run here",
    )
    ap.add_argument(
        "--block-size", type=int, default=16, help="KV cache tokens per block (flash-attn: a multiple of 256)"
    )
    ap.add_argument(
        "--no-fused-cpu-decode",
        action="store_true",
        help="CPU float32: run decode steps through the torch layer loop instead of one native call per step",
    )
    ap.add_argument(
        "--no-gguf-blocks",
        action="store_true",
        help="GGUF models in float32: decode matmuls read the dequantized float32 weights, not the file's blocks",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="log engine progress to stderr")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
        llm = LLM(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            attention_backend=args.attention_backend,
            block_size=args.block_size,
            fused_cpu_decode=not args.no_fused_cpu_decode,
            gguf_blocks=not args.no_gguf_blocks,
        )
        prompt = llm.chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        t0 = time.perf_counter()
        out = llm.generate([prompt], params)[0]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    print(out.text)
    print(
        f"[{len(out.prompt_token_ids)} prompt + {len(out.token_ids)} generated tokens in {dt:.2f}s, "
        f"finish_reason={out.finish_reason}]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
