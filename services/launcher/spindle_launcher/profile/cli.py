"""`spindle profile` / `python -m spindle_launcher.profile.cli`: measure this machine, write a profile JSON."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, replace

from spindle_costmodel.device_fit import format_validation
from spindle_policy.profile_data import write_profile

from .config import QUICK, ProfileConfig
from .runner import run_profile


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def add_profile_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = ProfileConfig()
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--model", default=d.model, help="known model name, HF Llama directory or .gguf (%(default)s)")
    p.add_argument("--dtype", default=d.dtype, choices=("float32", "bfloat16", "float16"))
    p.add_argument("--quick", action="store_true", help="a tiny grid, for smoke tests (seconds, not minutes)")
    g = p.add_argument_group("grid (comma-separated; defaults finish in a few minutes on 2 cores)")
    g.add_argument("--histories", type=_ints, default=None, help=f"prefill history C values {d.histories}")
    g.add_argument("--chunks", type=_ints, default=None, help=f"prefill chunk L values {d.chunks}")
    g.add_argument("--decode-batches", type=_ints, default=None, help=f"decode batch sizes {d.decode_batches}")
    g.add_argument("--decode-kv-tokens", type=_ints, default=None, help=f"KV tokens per request {d.decode_kv_tokens}")
    g.add_argument("--transfer-bytes", type=_ints, default=None, help=f"transfer sizes {d.transfer_bytes}")
    g.add_argument("--repeats", type=int, default=None, help=f"prefill repeats, median kept ({d.repeats})")
    g.add_argument("--warmup", type=int, default=None, help=f"untimed warm-up rounds ({d.warmup})")
    g.add_argument("--no-transfer", action="store_true", help="skip the 2-rank gloo transfer benchmark")
    g.add_argument(
        "--sp-sizes",
        type=_ints,
        default=None,
        help=f"prefill SP sizes, 1 included; each size > 1 spawns that many local processes {d.sp_sizes}",
    )
    g.add_argument("--seed", type=int, default=None, help=f"token and KV seed ({d.seed})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def config_from_args(args: argparse.Namespace) -> ProfileConfig:
    base = QUICK if args.quick else ProfileConfig()
    given = {f.name: getattr(args, f.name, None) for f in fields(ProfileConfig)}
    overrides = {k: v for k, v in given.items() if v is not None}
    if args.no_transfer:
        overrides["transfer"] = False
    return replace(base, **overrides)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spindle profile",
        description="Measure the real engine on this machine (prefill chunks over a (history C, chunk L) grid, "
        "decode steps over (batch, KV tokens), KV transfers between 2 gloo ranks) and its matmul and copy peaks, "
        "fit the scheduler's LatencyModel and the cost model's device (efficiencies fitted on half the samples, "
        "validated on the other half, then refitted on all) and write {machine, samples, model, fit_error, "
        "device} as JSON. With --sp-sizes 1,2,4 the prefill grid also runs on local sequence-parallel groups "
        "(what fixed-sp and request-sp need).",
    )
    return add_profile_args(p)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    doc = run_profile(cfg, progress=not args.no_progress)
    write_profile(doc, args.out)
    err = doc["fit_error"]
    print(f"wrote {args.out} in {doc['wall_s']:.1f} s; fit error (mean relative): {err}", flush=True)
    device = doc["device"]
    measured, eff = device["measured"], device["hardware"]["eff"]
    fitted = ", ".join(f"{k} {v:.3g}" for k, v in eff.items() if k in device["params"])
    print(
        f"\ncost-model device: {measured['matmul_flops'] / 1e9:.1f} GFLOP/s matmul, "
        f"{measured['copy_bandwidth'] / 1e9:.1f} GB/s copy; fitted efficiencies: {fitted}\n"
        "validation (each sample predicted by the fit to the train half):",
        flush=True,
    )
    print(format_validation(device["validation"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
