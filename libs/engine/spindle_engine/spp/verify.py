"""`spindle verify --spp N --chunk C`: a prompt through an N-stage sequence pipeline, compared with one engine.

Starts N local processes on a gloo group, one pipeline stage each (rank 0 leads), runs the prompt in chunks of C
tokens (C need not divide it) and decodes greedily; then compares, with the single engine here, the last prompt
token's logits, every decode step's logits and the greedy tokens. Also reports how much the stages overlapped
during the prefill: with sequence pipelining stage 0 computes chunk i+1 while stage 1 computes chunk i, so the
prefill takes less than the sum of the stages' compute; `--no-pipelining` waits for every chunk, for comparison.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from safetensors.torch import load_file

from ..sp.verify import TOLERANCE, Reference, reference, reference_decode_logits, run_ranks
from ..sp.verify_worker import VerifySpec
from .verify_worker import SPPVerifySpec


@dataclass
class SPPVerifyResult:
    match: bool
    logit_max_abs_diff: float  # the last prompt token's
    decode_logit_max_abs_diff: float  # every decode step's
    logit_scale: float
    tokens: list[int]
    reference_tokens: list[int]
    ttft_s: float  # the leader's, from add_request to the first token
    prefill_busy_s: list[float]  # per stage: compute spent on the prompt's chunks
    prefill_overlap: float  # sum of the stages' prefill compute / the prefill's span (1 = none, N = perfect)
    steps_not_waited: int
    seconds: float
    ranks: list[dict] = field(default_factory=list)

    def summary(self) -> str:
        busy = ", ".join(f"{b:.2f}" for b in self.prefill_busy_s)
        return "\n".join([
            f"max |logit diff| {self.logit_max_abs_diff:.3e} last prompt token, {self.decode_logit_max_abs_diff:.3e} "
            f"decode steps (largest |logit| {self.logit_scale:.1f})",
            f"greedy tokens  {self.tokens}",
            f"single engine  {self.reference_tokens}",
            f"prefill: TTFT {self.ttft_s:.2f}s, stage compute [{busy}] s, overlap {self.prefill_overlap:.2f}x, "
            f"{self.steps_not_waited} chunks not waited for",
            "MATCH" if self.match else "MISMATCH",
        ])  # fmt: skip


def check(spec: SPPVerifySpec, num_layers: int, num_kv_heads: int) -> None:
    """ValueError for a spec that cannot run."""
    if not 2 <= spec.spp <= num_layers:
        raise ValueError(f"--spp must be in [2, {num_layers}] (the model's layers), got {spec.spp}")
    if not 1 <= spec.tp <= num_kv_heads:
        raise ValueError(f"--stage-tp must be in [1, {num_kv_heads}] (the model's KV heads), got {spec.tp}")
    if spec.chunk < 1:
        raise ValueError(f"--chunk must be >= 1, got {spec.chunk}")
    if spec.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {spec.max_new_tokens}")


def _prefill_span(reports: list[dict], num_chunks: int, tp: int) -> tuple[list[float], float]:
    """Per stage (its first TP rank), the compute of the prompt's chunks (its first `num_chunks` steps), and their
    overlap."""
    busy, lo, hi = [], float("inf"), 0.0
    for r in sorted((r for r in reports if r["rank"] % tp == 0), key=lambda r: r["stage"]):
        spans = r["spans"][:num_chunks]
        busy.append(sum(b - a for a, b in spans))
        if spans:
            lo, hi = min(lo, spans[0][0]), max(hi, spans[-1][1])
    return busy, sum(busy) / max(hi - lo, 1e-9)


def verify_spp(spec: SPPVerifySpec, *, timeout_s: float = 600.0, ref: Reference | None = None) -> SPPVerifyResult:
    """Run `spec` and compare; `ref` (`sp.verify.reference` of the same prompt and tokens) may be passed to reuse."""
    from spindle_model import resolve_model

    mc = resolve_model(spec.model).config
    check(spec, mc.num_layers, mc.num_kv_heads)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="spindle-verify-spp-") as tmp:
        out = Path(tmp)
        world = spec.spp * spec.tp
        run_ranks(asdict(spec), world, out, timeout_s, worker="spindle_engine.spp.verify_worker")
        tensors = load_file(str(out / "rank0.safetensors"))
        reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    seconds = time.perf_counter() - t0
    ref_spec = VerifySpec(spec.model, spec.dtype, "0:@0", "zigzag", spec.token_ids, max_new_tokens=spec.max_new_tokens)
    ref_logits, ref_tokens, _ = ref if ref is not None else reference(ref_spec)
    tokens = tensors["tokens"].tolist()
    logits = tensors["logits"]  # [1 + decode steps, vocab]
    scale = ref_logits.abs().max().item()
    tol = TOLERANCE[spec.dtype] * max(scale, 1.0)
    diff = (logits[0] - ref_logits).abs().max().item()
    ref_decode = reference_decode_logits(ref_spec, tokens)
    decode = logits[1:]
    decode_diff = (decode - ref_decode).abs().max().item() if decode.shape == ref_decode.shape else float("inf")
    num_chunks = -(-len(spec.token_ids) // spec.chunk)
    busy, overlap = _prefill_span(reports, num_chunks, spec.tp)
    leader = reports[0]
    leaked = leader["blocks_leaked"]
    ok = diff <= tol and decode_diff <= tol and tokens == ref_tokens and leaked == 0
    return SPPVerifyResult(
        ok, diff, decode_diff, scale, tokens, ref_tokens, leader["ttft_s"], busy, overlap, leader["steps_not_waited"],
        seconds, reports,
    )  # fmt: skip
