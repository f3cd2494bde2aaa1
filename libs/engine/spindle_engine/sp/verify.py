"""`spindle verify`: run a prompt under an SP prefill plan on local processes and compare with one instance.

Starts one process per plan member plus the decode instance's TP ranks (gloo on loopback), runs the plan,
hands the KV to decode (or retains it in place), decodes greedily, then computes the same prompt on the
single-instance engine here and compares the last prompt token's logits, the greedy tokens and, with
`--dump-kv`, the whole prompt KV. Prints the differences and MATCH or MISMATCH; exits 1 on a mismatch.
With `--kvp K` the decode side is a KV-parallel group of K members instead (`verify_kvp`), optionally
with `--scale-up-at N` and/or `--scale-down-at N`; then the master's logits at every decode step are compared too.
`--layouts a,b` runs the plan once per layout on one set of processes (`verify_many`, `launch_many`).
`--csa-drop P` runs a one-chunk all-to-all plan with CSPS's sparse attention (CSA): at P = 0 it must MATCH; at
P > 0 it is an approximation, so it reports the greedy-token agreement and the logit error instead of failing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from spindle_attention.csa import CSA_RULES, max_levels
from spindle_model import CausalAttention, LlamaModel, load_state_dict, resolve_model

from ..config import DTYPES, EngineConfig, check_device
from ..engine import Engine
from ..kvp import parse_bounds
from ..sampling_params import SamplingParams
from .kv_parts import decode_heads
from .plan import SP_LAYOUTS
from .verify_kvp import check_scale_down, kvp_bounds, scale_down_member
from .verify_worker import BLOCK_SIZE, VerifySpec

FAILURE_GRACE_S = 15.0  # after one rank fails, how long the others get to fail on their own before being killed
TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}  # relative to the largest |logit|


@dataclass
class VerifyResult:
    match: bool
    logit_max_abs_diff: float
    logit_scale: float
    tokens: list[int]
    reference_tokens: list[int]
    kv_max_abs_diff: float | None
    seconds: float
    ranks: list[dict] = field(default_factory=list)
    decode_logit_max_abs_diff: float | None = None  # KVP: the master's logits at every decode step
    approximate: bool = False  # CSA with drops: compared, never failed on the numbers

    @property
    def greedy_agreement(self) -> float:
        same = sum(a == b for a, b in zip(self.tokens, self.reference_tokens, strict=False))
        return same / max(len(self.reference_tokens), 1)

    def summary(self) -> str:
        lines = [
            f"max |logit diff| {self.logit_max_abs_diff:.3e} (largest |logit| {self.logit_scale:.1f})",
            f"greedy tokens  {self.tokens}",
            f"single engine  {self.reference_tokens}",
        ]
        if self.kv_max_abs_diff is not None:
            lines.append(f"max |KV diff|  {self.kv_max_abs_diff:.3e}")
        if self.decode_logit_max_abs_diff is not None:
            lines.append(f"max |decode logit diff| {self.decode_logit_max_abs_diff:.3e} (KVP master, every step)")
        for r in self.ranks:
            if r.get("role") == "prefill":
                for c in r["chunks"]:
                    lines.append(
                        f"member {r['member']} chunk {c['index']}: {c['tokens']} tokens sp={c['sp']} {c['layout']} "
                        f"{c['seconds']:.2f}s ring {c['ring_bytes']} B rebalance {c['rebalance_bytes']} B"
                    )
                for c in r["chunks"]:
                    if c.get("bytes_by_phase"):
                        phases = ", ".join(f"{k} {b} B" for k, b in sorted(c["bytes_by_phase"].items()))
                        lines.append(f"member {r['member']} CSA: {phases}; dropped {c['csa_dropped_tokens']} tokens "
                                     f"at level 2 (per dropping layer and head)")  # fmt: skip
                lines.append(f"member {r['member']}: sent {r['transfer_bytes']} B of KV to decode")
            elif r.get("role") == "kvp":
                steps = max(r["steps"], 1)
                sent = (r["q_bytes"] + r["kv_bytes"] + r["result_bytes"] + r["control_bytes"]) / steps
                lines.append(
                    f"KVP member {r['member']} range {_span(r['range'])}: per step sent {sent:.0f} B "
                    f"(q {r['q_bytes'] / steps:.0f}, new k/v {r['kv_bytes'] / steps:.0f}, states "
                    f"{r['result_bytes'] / steps:.0f}); moving the remote KV instead "
                    f"{r['kv_move_bytes'] / steps:.0f} B"
                )
                if r.get("scale_down_tokens"):
                    lines.append(
                        f"KVP member {r['member']} left: moved {r['scale_down_bytes']} B of KV "
                        f"({r['scale_down_tokens']} tokens) once"
                    )
        if self.approximate:
            lines.append(f"APPROXIMATE (CSA drops tokens): greedy-token agreement {self.greedy_agreement:.2f}, "
                         f"max |logit diff| {self.logit_max_abs_diff:.3e}; blocks freed: {self.match}")  # fmt: skip
        else:
            lines.append("MATCH" if self.match else "MISMATCH")
        return "\n".join(lines)


class _Recording:
    """Causal attention that also keeps every layer's K/V (the single-instance reference)."""

    def __init__(self) -> None:
        self.kv: list[tuple[Tensor, Tensor]] = []

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.kv.append((k.clone(), v.clone()))
        return CausalAttention().attention(layer, q, k, v)


@torch.inference_mode()
def _span(bounds: list[int]) -> str:
    return f"[{bounds[0]}, {bounds[1]})" if bounds else "none (scale-up tail)"


def reference(spec: VerifySpec) -> tuple[Tensor, list[int], Tensor]:
    """Single instance: last-token logits `[vocab]`, greedy tokens, KV `[2, L, N, Hkv, D]`."""
    source = resolve_model(spec.model)
    dtype = DTYPES[spec.dtype]
    model = LlamaModel(source.config, dtype=dtype)
    model.load_weights(load_state_dict(source.path, dtype=dtype))
    ids = torch.tensor(spec.token_ids)
    rec = _Recording()
    hidden = model(torch.arange(len(ids)), rec, input_ids=ids)
    logits = model.compute_logits(hidden[-1:])[0]
    kv = torch.stack([torch.stack([k for k, _ in rec.kv]), torch.stack([v for _, v in rec.kv])])
    room = len(ids) + spec.max_new_tokens + BLOCK_SIZE
    engine = Engine(
        EngineConfig(dtype=spec.dtype, block_size=BLOCK_SIZE, kv_cache_tokens=room + BLOCK_SIZE, max_model_len=room),
        model=model,
    )
    engine.add_request(
        "ref", spec.token_ids, SamplingParams(max_tokens=spec.max_new_tokens, temperature=0.0, ignore_eos=True)
    )
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return logits, tokens, kv


@torch.inference_mode()
def reference_decode_logits(spec: VerifySpec, tokens: list[int]) -> Tensor:
    """Single instance, one causal pass over prompt + `tokens[:-1]`: the logits that chose `tokens[1:]`."""
    source = resolve_model(spec.model)
    dtype = DTYPES[spec.dtype]
    model = LlamaModel(source.config, dtype=dtype)
    model.load_weights(load_state_dict(source.path, dtype=dtype))
    ids = torch.tensor([*spec.token_ids, *tokens[:-1]])
    hidden = model(torch.arange(len(ids)), CausalAttention(), input_ids=ids)
    return model.compute_logits(hidden[len(spec.token_ids) :])


def launch(spec: VerifySpec, out_dir: Path, timeout_s: float = 600.0) -> list[tuple[dict[str, Tensor], dict]]:
    """Run every rank of `spec` as a subprocess; returns each rank's (tensors, report)."""
    run_ranks(asdict(spec), spec.world_size(), out_dir, timeout_s)
    return _read_results(out_dir, spec.world_size())


def launch_many(
    specs: list[VerifySpec], out_dir: Path, timeout_s: float = 600.0
) -> list[list[tuple[dict[str, Tensor], dict]]]:
    """Run `specs` one after the other on one set of processes (started, and the model loaded, once).

    The world is the largest spec's; returns, per spec, each of its ranks' (tensors, report).
    """
    check_shared(specs)
    world = max(s.world_size() for s in specs)
    run_ranks([asdict(s) for s in specs], world, out_dir, timeout_s)
    return [_read_results(out_dir / str(i), s.world_size()) for i, s in enumerate(specs)]


def check_shared(specs: list[VerifySpec]) -> None:
    """ValueError unless `specs` can share one launch: the same model, dtype and threads."""
    if not specs:
        raise ValueError("no specs to run")
    kinds = {(s.model, s.dtype, s.threads, s.device) for s in specs}
    if len(kinds) > 1:
        raise ValueError(f"specs of one launch need the same model, dtype, threads and device, got {sorted(kinds)}")


def run_ranks(
    spec_doc: dict | list, world: int, out_dir: Path, timeout_s: float, worker: str = "spindle_engine.sp.verify_worker"
) -> None:
    """Run `python -m worker` for every rank of a `world` on loopback with the spec at `out_dir/spec.json`; a
    failed rank (or the timeout) kills the rest and raises RuntimeError with that rank's log."""
    from spindle_model.testing import free_port

    spec_path = out_dir / "spec.json"
    spec_path.write_text(json.dumps(spec_doc))
    port = free_port()
    procs = []
    for r in range(world):
        cmd = [sys.executable, "-m", worker, "--rank", str(r), "--world-size", str(world)]
        cmd += ["--port", str(port), "--spec", str(spec_path), "--out", str(out_dir)]
        log = open(out_dir / f"rank{r}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout_s
    failed, bad = None, 0
    try:
        while any(p.poll() is None for p, _ in procs):
            if time.monotonic() > deadline:
                failed = failed or f"timed out after {timeout_s:.0f} s"
                break
            errors = [r for r, (p, _) in enumerate(procs) if p.returncode not in (None, 0)]
            if errors and failed is None:  # the first rank seen failing; the others fail on its closed connections
                failed, bad = f"rank {errors[0]} exited with an error", errors[0]
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)  # let them report, then kill
            time.sleep(0.05)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    errors = [r for r, (p, _) in enumerate(procs) if p.returncode != 0]
    if failed is None and errors:  # every rank exited between two polls
        failed, bad = f"rank {errors[0]} exited with an error", errors[0]
    if failed:
        tail = (out_dir / f"rank{bad}.log").read_text()[-3000:]
        raise RuntimeError(f"verify ranks failed ({failed}); rank {bad} log:\n{tail}")


def _read_results(out_dir: Path, world: int) -> list[tuple[dict[str, Tensor], dict]]:
    results = []
    for r in range(world):
        st = out_dir / f"rank{r}.safetensors"
        results.append((load_file(str(st)) if st.exists() else {}, json.loads((out_dir / f"rank{r}.json").read_text())))
    return results


Reference = tuple[Tensor, list[int], Tensor]


def verify(spec: VerifySpec, *, timeout_s: float = 600.0, ref: Reference | None = None) -> VerifyResult:
    """Run `spec` and compare; `ref` (from `reference(spec)`) may be passed to reuse it across plans."""
    spec.parsed_plan()  # a bad plan fails here, before any process starts
    check_kvp(spec)
    check_csa(spec)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="spindle-verify-") as tmp:
        results = launch(spec, Path(tmp), timeout_s)
    seconds = time.perf_counter() - t0
    return compare(spec, results, ref if ref is not None else reference(spec), seconds)


def verify_many(
    specs: list[VerifySpec], *, timeout_s: float = 600.0, refs: list[Reference | None] | None = None
) -> list[VerifyResult]:
    """`verify` for several specs on one launch (`launch_many`); a result per spec, each with the launch's seconds.

    `refs[i]` may give spec i's reference; the others are computed, once per distinct prompt.
    """
    check_shared(specs)
    for spec in specs:
        spec.parsed_plan()
        check_kvp(spec)
        check_csa(spec)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="spindle-verify-") as tmp:
        runs = launch_many(specs, Path(tmp), timeout_s)
    seconds = time.perf_counter() - t0
    computed: dict[tuple, Reference] = {}
    decode_refs: dict[tuple, Tensor] = {}
    out = []
    for i, (spec, results) in enumerate(zip(specs, runs, strict=True)):
        ref = refs[i] if refs is not None else None
        if ref is None:
            key = (tuple(spec.token_ids), spec.max_new_tokens)
            if key not in computed:
                computed[key] = reference(spec)
            ref = computed[key]
        out.append(compare(spec, results, ref, seconds, decode_refs))
    return out


def compare(
    spec: VerifySpec,
    results: list[tuple[dict[str, Tensor], dict]],
    ref: Reference,
    seconds: float = 0.0,
    decode_refs: dict[tuple, Tensor] | None = None,
) -> VerifyResult:
    """Compare one launch's rank results (`launch`) with the single-instance reference (`reference(spec)`).

    `decode_refs` caches the KVP decode-step references across calls (keyed by prompt and tokens).
    """
    ref_logits, ref_tokens, ref_kv = ref
    logits = next(t["logits"] for t, _ in results if "logits" in t)
    tokens = next(t["tokens"] for t, _ in results if "tokens" in t).tolist()
    diff = (logits - ref_logits).abs().max().item()
    scale = ref_logits.abs().max().item()
    tol = TOLERANCE[spec.dtype] * max(scale, 1.0)
    kv_diff = None
    decode_diff = None
    if spec.kvp:
        decode_logits = next(t["decode_logits"] for t, _ in results if "decode_logits" in t)
        key = (tuple(spec.token_ids), tuple(tokens))
        cache = decode_refs if decode_refs is not None else {}
        if key not in cache:
            cache[key] = reference_decode_logits(spec, tokens)
        ref_decode = cache[key]
        if decode_logits.shape == ref_decode.shape:
            decode_diff = (decode_logits - ref_decode).abs().max().item()
        else:
            decode_diff = float("inf")
    if spec.dump_kv and spec.kvp:
        parts = sorted(((r["member"], t["kv"]) for t, r in results if r.get("role") == "kvp" and "kv" in t))
        kv = torch.cat([p for _, p in parts], dim=2)
        kv_diff = (kv.float() - ref_kv.float()).abs().max().item()
    elif spec.dump_kv and not spec.decode_in_place:
        source = resolve_model(spec.model)
        heads = decode_heads(source.config, spec.decode_tp)
        parts = [t["kv"] for t, r in results if r.get("role") == "decode"]
        kv = torch.cat(parts, dim=3)
        assert len(parts) == len(heads)
        kv_diff = (kv.float() - ref_kv.float()).abs().max().item()
    leaked = sum(r.get("blocks_leaked", 0) for _, r in results)
    reports = [r for _, r in results]
    if spec.csa_drop:  # an approximation: only leaks fail it
        return VerifyResult(leaked == 0, diff, scale, tokens, ref_tokens, None, seconds, reports, approximate=True)
    ok = diff <= tol and tokens == ref_tokens and leaked == 0
    if kv_diff is not None:
        ok = ok and kv_diff <= tol
    if decode_diff is not None:
        ok = ok and decode_diff <= tol
    return VerifyResult(ok, diff, scale, tokens, ref_tokens, kv_diff, seconds, reports, decode_diff)


def check_verify_device(args: argparse.Namespace) -> str:
    """`--device` as the spec carries it ("cpu", "cuda" or "cuda:N"); ValueError for a bad one, for one this machine
    does not have, or with a mode that runs on the CPU only."""
    device = args.device.strip().lower()
    if device != "cpu":
        check_device(device)  # the spelling, CUDA here, the index in range
        if args.csa_drop is not None:
            raise ValueError(
                f"--device {device} runs SP plans with --decode-tp, --retain or --kvp; not with --csa-drop"
            )
    return device


def read_prompt(path: Path, model: str) -> list[int]:
    """A JSON list of token ids, or text to tokenize with the model's tokenizer."""
    text = path.read_text()
    stripped = text.strip()
    if stripped.startswith("["):
        ids = json.loads(stripped)
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"{path}: a JSON prompt must be a list of token ids")
        return ids
    from spindle_model import Tokenizer

    return Tokenizer(resolve_model(model).path).encode(text)


def check_csa(spec: VerifySpec) -> None:
    """ValueError for CSA options that cannot run."""
    if spec.csa_drop is not None:
        if not 0.0 <= spec.csa_drop < 1.0:
            raise ValueError(f"--csa-drop must be in [0, 1), got {spec.csa_drop}")
        chunks = spec.parsed_plan().chunks
        if len(chunks) != 1 or chunks[0].layout != "all-to-all" or chunks[0].sp < 2:
            raise ValueError("--csa-drop needs a one-chunk plan over 2 or more members with --layout all-to-all")
        if spec.retain is not None or spec.kvp:
            raise ValueError("--csa-drop takes no --retain or --kvp")
        most = max_levels(chunks[0].sp)
        if spec.csa_levels is not None and not 1 <= spec.csa_levels <= most:
            raise ValueError(f"--csa-levels must be in [1, {most}] over {chunks[0].sp} members, got {spec.csa_levels}")
    elif spec.csa_levels is not None or spec.csa_rule != "doubling":
        raise ValueError("--csa-levels and --csa-rule need --csa-drop")


def check_kvp(spec: VerifySpec) -> None:
    """ValueError for KVP options that cannot run."""
    if spec.kvp < 0:
        raise ValueError(f"--kvp must be >= 1, got {spec.kvp}")
    check_scale_down(spec)
    if not spec.kvp:
        if spec.kvp_split is not None or spec.scale_up_at is not None:
            raise ValueError("--kvp-split and --scale-up-at need --kvp")
        return
    if spec.decode_tp != 1:
        raise ValueError("--kvp with --decode-tp > 1 is not supported yet (KVP members run TP 1)")
    if spec.retain is not None:
        raise ValueError("--kvp with --retain is not supported (the KV is sent to the KVP members)")
    kvp_bounds(len(spec.token_ids), spec.kvp, spec.kvp_split)
    if spec.scale_up_at is not None and not 1 <= spec.scale_up_at < spec.max_new_tokens:
        limit = spec.max_new_tokens
        raise ValueError(f"--scale-up-at must be in [1, {limit}) (--max-new-tokens), got {spec.scale_up_at}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="spindle verify",
        description=(
            "Run a prompt under a sequence-parallel prefill plan on local processes (gloo) and check that the "
            "last prompt token's logits and a greedy continuation match the single-instance engine. Exits 1 "
            "on MISMATCH."
        ),
        epilog="examples:\n"
        "  spindle verify --prompt-file doc.txt --plan '0:300@0;300:900@0,1;900:@0,1,2,3' --decode-tp 2\n"
        "  spindle verify --prompt-file doc.txt --spp 2 --chunk 300\n"
        "  spindle verify --prompt-file doc.txt --reshard PP2:TP2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--prompt-file", type=Path, required=True, help="text, or a JSON list of token ids")
    ap.add_argument(
        "--plan",
        default=None,
        help="chunks START:END@MEMBERS[/LAYOUT] separated by ';' (END empty = prompt end), each group containing "
        "the previous one's, e.g. '0:300@0;300:900@0,1;900:@0,1,2,3' (required unless --spp)",
    )
    ap.add_argument(
        "--spp",
        type=int,
        default=0,
        help="instead of an SP plan: one instance as N sequence-pipeline stages (layer ranges, one process each), "
        "the prompt in chunks of --chunk tokens flowing through them back to back, then greedy decode",
    )
    ap.add_argument(
        "--kvp-prefill",
        type=int,
        default=0,
        help="instead of an SP plan: Medha's KV parallelism over N processes, the prompt's chunks of --chunk tokens "
        "computed by each in turn (a consecutive share each), attending the earlier chunks' KV where it stays, then "
        "greedy decode mastered by the last while every member attends its share; with --spp S each member is a "
        "pipeline of S stages (Medha's 3D, N x S processes)",
    )
    ap.add_argument(
        "--reshard",
        default=None,
        metavar="PPa[xTPb]:TPc",
        help="instead of an SP plan: Seesaw's re-sharding on a*b processes: the prompt prefilled as a pipeline of a "
        "stages (of b tensor-parallel ranks), its KV pushed to a shared host-memory tier, then the same processes "
        "re-shard to TP c (weights rebuilt from one shared host copy), pull their KV heads and decode; each round "
        "switches prefill -> decode and back",
    )
    ap.add_argument("--rounds", type=int, default=2, help="with --reshard: prefill/decode rounds (default 2)")
    ap.add_argument("--chunk", type=int, default=256, help="with --spp or --kvp-prefill: prefill chunk size in tokens")
    ap.add_argument(
        "--stage-tp", type=int, default=1, help="with --spp: tensor-parallel ranks inside each stage (Medha's 2D)"
    )
    ap.add_argument(
        "--no-pipelining",
        action="store_true",
        help="with --spp: wait for every chunk to leave the last stage before the next starts (for comparison)",
    )
    ap.add_argument("--layout", default="zigzag", choices=SP_LAYOUTS, help="layout of chunks that name none")
    ap.add_argument(
        "--layouts",
        default=None,
        help="instead of --layout: several, comma-separated (e.g. 'zigzag,stripe'); the plan runs once per layout "
        "on the same processes (started and the model loaded once) and each run is compared",
    )
    ap.add_argument(
        "--csa-drop",
        type=float,
        default=None,
        help="CSPS's sparse attention (CSA) over a one-chunk all-to-all plan with drop ratio P at level 2 (doubling "
        "per level): 0 must MATCH; P > 0 reports greedy agreement and the logit error instead of failing",
    )
    ap.add_argument("--csa-levels", type=int, default=None, help="with --csa-drop: CSA levels (default every level)")
    ap.add_argument("--csa-rule", choices=CSA_RULES, default="doubling",
                    help="with --csa-drop: the drop above level 2: doubling per level (default) or the paper's "
                         "formula as printed (farther levels keep more)")  # fmt: skip
    ap.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel size of the decode instance")
    ap.add_argument(
        "--kvp",
        type=int,
        default=0,
        help="decode on a KV-parallel group of K members (TP 1 each), the prompt KV split by token ranges",
    )
    ap.add_argument(
        "--kvp-split",
        default=None,
        help="the KVP members' range starts, e.g. '0,413' (default: proportional to 1..K, not block-aligned)",
    )
    ap.add_argument(
        "--scale-up-at",
        type=int,
        default=None,
        help="with --kvp: an extra idle member becomes the tail after N generated tokens (existing KV stays put)",
    )
    ap.add_argument(
        "--scale-down-at",
        type=int,
        default=None,
        help="with --kvp: a member leaves the KV holders after N generated tokens; its range's KV moves once to the "
        "adjacent holder",
    )
    ap.add_argument(
        "--scale-down-member",
        type=int,
        default=None,
        help="the member that leaves with --scale-down-at (default K-1, the last prompt holder; 0 merges into the "
        "front of member 1's range)",
    )
    ap.add_argument(
        "--retain",
        default=None,
        help="members that keep the KV after the last chunk (LoongServe scale-down), e.g. '0' to decode in place",
    )
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--model", default="smollm2", help="model name, HF Llama directory or .gguf file")
    ap.add_argument("--max-new-tokens", type=int, default=8, help="greedy tokens to compare")
    ap.add_argument("--dump-kv", action="store_true", help="also compare the whole prompt KV the decode side got")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument(
        "--device",
        default="cpu",
        help="where the ranks run: cpu, cuda (rank r on GPU r mod the GPUs torch sees; several ranks may share one) "
        "or cuda:N (every rank on GPU N); SP plans with --decode-tp, --retain or --kvp only. Tensors between ranks "
        "cross gloo through host memory; the single-instance reference runs on the CPU here (default: cpu)",
    )
    ap.add_argument("--json", type=Path, help="write the result (with per-chunk bytes and times) here")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are killed")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    other = next((flag for flag, on in (("--reshard", args.reshard), ("--kvp-prefill", args.kvp_prefill),
                                         ("--spp", args.spp)) if on), None)  # fmt: skip
    if other and args.device.strip().lower() != "cpu":
        print(f"spindle verify: error: --device {args.device} runs SP plans; {other} runs on the CPU only",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.reshard:
        return _main_reshard(args)
    if args.kvp_prefill:
        return _main_kvp_prefill(args)
    if args.spp:
        return _main_spp(args)
    try:
        if args.plan is None:
            raise ValueError("--plan is required (or --spp N for a sequence pipeline)")
        if args.stage_tp != 1:
            raise ValueError("--stage-tp applies to --spp")
        ids = read_prompt(args.prompt_file, args.model)
        if args.decode_tp < 1:
            raise ValueError(f"--decode-tp must be >= 1, got {args.decode_tp}")
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        retain = [int(m) for m in args.retain.split(",")] if args.retain else None
        split = parse_bounds(args.kvp_split, len(ids))[:-1] if args.kvp_split else None
        spec = VerifySpec(
            args.model, args.dtype, args.plan, args.layout, ids, args.decode_tp, retain, args.max_new_tokens,
            args.dump_kv, args.threads, args.kvp, split, args.scale_up_at, args.scale_down_at, args.scale_down_member,
            args.csa_drop, args.csa_levels, args.csa_rule, device=check_verify_device(args),
        )  # fmt: skip
        check_kvp(spec)
        check_csa(spec)
        plan = spec.parsed_plan()
        if retain is not None and not set(retain) <= set(plan.members):
            raise ValueError(f"--retain members {retain} are not all in the plan {plan.members}")
        layouts = args.layouts.split(",") if args.layouts is not None else None
        if layouts is not None and not (layouts and set(layouts) <= set(SP_LAYOUTS)):
            raise ValueError(f"--layouts must name layouts among {', '.join(SP_LAYOUTS)}, got {args.layouts!r}")
    except (ValueError, OSError) as e:
        print(f"spindle verify: error: {e}", file=sys.stderr)
        return 2
    decode = f"decode KVP {spec.kvp}" if spec.kvp else f"decode TP {spec.decode_tp}"
    if spec.scale_up_at is not None:
        decode += f" + scale-up after {spec.scale_up_at} tokens"
    if spec.scale_down_at is not None:
        decode += f" + member {scale_down_member(spec)} leaves after {spec.scale_down_at} tokens"
    print(f"plan {plan.format()} ({len(ids)} tokens), {decode}, {spec.world_size()} processes")
    if layouts is None:
        result = verify(spec, timeout_s=args.timeout)
        print(result.summary())
        if args.json:
            args.json.write_text(json.dumps(asdict(result), indent=1))
        return 0 if result.match else 1
    results = verify_many([replace(spec, layout=lay) for lay in layouts], timeout_s=args.timeout)
    for lay, result in zip(layouts, results, strict=True):
        print(f"--- layout {lay}\n{result.summary()}")
    if args.json:
        docs = [asdict(r) | {"layout": lay} for lay, r in zip(layouts, results, strict=True)]
        args.json.write_text(json.dumps(docs, indent=1))
    return 0 if all(r.match for r in results) else 1


def _main_reshard(args: argparse.Namespace) -> int:
    from ..reshard import ReshardPlan
    from ..reshard.verify import verify_reshard

    try:
        if args.plan is not None or args.spp or args.kvp or args.decode_tp != 1 or args.csa_drop is not None:
            raise ValueError("--reshard takes no SP plan, --spp, --kvp, --decode-tp or --csa-drop")
        plan = ReshardPlan.parse(args.reshard)
        mc = resolve_model(args.model).config
        plan.check(mc.num_layers, mc.num_kv_heads)
        if args.rounds < 1 or args.max_new_tokens < 1:
            raise ValueError("--rounds and --max-new-tokens must be >= 1")
        ids = read_prompt(args.prompt_file, args.model)
    except (ValueError, OSError) as e:
        print(f"spindle verify: error: {e}", file=sys.stderr)
        return 2
    print(f"{len(ids)} tokens: prefill {plan.prefill.label()}, decode {plan.decode.label()}, {plan.world} processes")
    result = verify_reshard(plan, ids, model=args.model, dtype=args.dtype, max_new_tokens=args.max_new_tokens,
                            rounds=args.rounds, threads=args.threads, timeout_s=args.timeout)  # fmt: skip
    print(result.summary())
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=1))
    return 0 if result.match else 1


def _main_spp(args: argparse.Namespace) -> int:
    from ..spp.verify import SPPVerifySpec, check, verify_spp

    try:
        if (
            args.plan is not None
            or args.kvp
            or args.decode_tp != 1
            or args.retain
            or args.layouts
            or args.csa_drop is not None
        ):
            raise ValueError("--spp takes no SP plan, --kvp, --decode-tp, --retain, --layouts or --csa-drop")
        ids = read_prompt(args.prompt_file, args.model)
        spec = SPPVerifySpec(args.model, args.dtype, ids, args.spp, args.chunk, args.max_new_tokens, args.threads,
                             pipelined=not args.no_pipelining, tp=args.stage_tp)  # fmt: skip
        mc = resolve_model(spec.model).config
        check(spec, mc.num_layers, mc.num_kv_heads)
    except (ValueError, OSError) as e:
        print(f"spindle verify: error: {e}", file=sys.stderr)
        return 2
    mode = "sequence pipelining" if spec.pipelined else "no pipelining"
    procs = f"{spec.tp} processes (TP) each" if spec.tp > 1 else "one process each"
    print(f"{len(ids)} tokens in chunks of {spec.chunk} through {spec.spp} pipeline stages ({mode}), {procs}")
    result = verify_spp(spec, timeout_s=args.timeout)
    print(result.summary())
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=1))
    return 0 if result.match else 1


def _main_kvp_prefill(args: argparse.Namespace) -> int:
    from ..esp.verify import KVPVerifySpec, check, verify_kvp

    try:
        if (args.plan is not None or args.kvp or args.decode_tp != 1 or args.retain or args.layouts
                or args.stage_tp > 1 or args.csa_drop is not None):  # fmt: skip
            raise ValueError(
                "--kvp-prefill takes no SP plan, --kvp, --decode-tp, --retain, --layouts, --stage-tp or --csa-drop"
            )
        ids = read_prompt(args.prompt_file, args.model)
        spec = KVPVerifySpec(args.model, args.dtype, ids, args.kvp_prefill, args.chunk, args.max_new_tokens,
                             args.threads, spp=args.spp or 1)  # fmt: skip
        check(spec)
        layers = resolve_model(spec.model).config.num_layers
        if spec.spp > layers:
            raise ValueError(f"--spp must be in [1, {layers}] (the model's layers), got {spec.spp}")
    except (ValueError, OSError) as e:
        print(f"spindle verify: error: {e}", file=sys.stderr)
        return 2
    each = f"pipelines of {spec.spp} stages (Medha's 3D)" if spec.spp > 1 else "processes (Medha's KVP)"
    print(f"{len(ids)} tokens in chunks of {spec.chunk} over {spec.members} KV-parallel {each}")
    result = verify_kvp(spec, timeout_s=args.timeout)
    print(result.summary())
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=1))
    return 0 if result.match else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
