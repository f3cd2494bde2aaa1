"""`spindle cost`: the cost model's breakdown of one operation, as a table or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .breakdown import Breakdown
from .costs import Chunk, CostModel
from .hardware import hardware_names
from .memory import MemoryPlan, OutOfMemory
from .model import DTYPE_BYTES, MODELS, get_model
from .parallel import SP_KINDS, Parallelism

EXAMPLES = """examples:
  spindle cost prefill --model llama3-8b --hardware a100-80g --tokens 100000 --sp 8
  spindle cost decode --model llama3-70b --hardware h100-sxm --batch 32 --context 1000000 --tp 8 --kvp 2
  spindle cost mixed --model llama3-8b --hardware h100-sxm --tokens 512 --history 200000 --batch 64 --context 8000
  spindle cost prefill --model llama3-8b --hardware h100-sxm --tokens 1000000 --tp 8 --pp 4 --chunk 4096 --json

Each op is max(compute, memory) at the device's fitted efficiencies plus a fixed cost per kernel, summed over
the layers; communication (TP all-reduce, SP ring or all-to-all, KVP exchange, PP sends) is what the overlap
leaves exposed. Memory is per GPU: weight shard, KV of the request(s), activations; a plan that does not fit
is still costed, then exits with status 3 (bad arguments: 2).
--json prints {"total_s", "ops": [{"name", "compute_s", "memory_s", "comm_s", "s"}], "memory_bytes": {...}}."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spindle cost",
        description="Predict the seconds and memory of one prefill, decode step or mixed batch for a Llama-family "
        "model on a GPU cluster under TP / PP / SP / KVP / chunking (the cost model the simulator uses).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("op", choices=("prefill", "decode", "mixed"), help="what to cost")
    p.add_argument("--model", default="llama3-8b", help=f"preset ({', '.join(MODELS)}) or a config.json path")
    p.add_argument(
        "--hardware",
        default="a100-80g",
        help=f"device preset ({', '.join(hardware_names())}) or a `spindle profile` JSON (its fitted device)",
    )
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), help="override the model's dtype (bf16 by default)")
    p.add_argument("--tokens", type=int, default=0, help="prefill: prompt tokens (mixed: the chunk's)")
    p.add_argument("--history", type=int, default=0, help="prefill: tokens already cached before them")
    p.add_argument("--chunk", type=int, help="prefill: chunk size (chunked prefill; pipelined over PP stages)")
    p.add_argument("--batch", type=int, default=0, help="decode: requests in the batch")
    p.add_argument("--context", type=int, default=0, help="decode: KV tokens per request")
    p.add_argument("--keep", type=float, default=1.0, help="fraction of attention pairs kept (CSA sparsity)")
    g = p.add_argument_group("parallelism (one instance)")
    g.add_argument("--tp", type=int, default=1, help="tensor parallel degree")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages")
    g.add_argument("--sp", type=int, default=1, help="sequence parallel degree of the prefill")
    g.add_argument("--sp-kind", choices=SP_KINDS, default="ring", help="ring (pass KV) or ulysses (all-to-all)")
    g.add_argument("--kvp", type=int, default=1, help="KV-cache parallel degree of decode")
    g.add_argument("--gpus-per-node", type=int, help="override the hardware's node size (which link a group spans)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def run(args: argparse.Namespace) -> tuple[Breakdown, MemoryPlan]:
    from dataclasses import replace

    from .hardware import get_hardware

    model = get_model(args.model)
    if args.dtype:
        model = model.with_dtype(args.dtype)
    hw = get_hardware(args.hardware)
    if args.gpus_per_node:
        hw = replace(hw, gpus_per_node=args.gpus_per_node)
    par = Parallelism(tp=args.tp, pp=args.pp, sp=args.sp, kvp=args.kvp, sp_kind=args.sp_kind)
    cm = CostModel(model, hw)
    if args.op == "prefill":
        if args.tokens < 1:
            raise ValueError("prefill needs --tokens >= 1")
        out = cm.prefill(args.tokens, args.history, par, args.chunk, args.keep)
        kv, batch = args.history + args.tokens, args.chunk or args.tokens
    elif args.op == "decode":
        if args.batch < 1:
            raise ValueError("decode needs --batch >= 1")
        out = cm.decode(args.batch, args.context, par)
        kv, batch = args.batch * args.context, args.batch
    else:
        if args.tokens < 1 and args.batch < 1:
            raise ValueError("mixed needs a chunk (--tokens) and/or decodes (--batch, --context)")
        chunks = [Chunk(args.tokens, args.history)] if args.tokens else []
        out = cm.step(chunks, [args.context] * args.batch, par, args.keep)
        kv, batch = args.history + args.tokens + args.batch * args.context, args.tokens + args.batch
    mem = cm.memory(par, kv, batch)
    return replace(out, memory_bytes=mem.as_dict()), mem


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out, mem = run(args)
    except ValueError as e:
        print(f"spindle cost: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out.to_dict(), indent=1) if args.json else out.format_table())
    try:
        mem.check(f"{args.op} on {args.hardware}")
    except OutOfMemory as e:
        print(f"spindle cost: does not fit: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
