"""`spindle verify --kvp-prefill N --chunk C`: Medha's KV parallelism across N processes, compared with one engine.

The prompt's chunks of C tokens (C need not divide it) are computed by the N members in turn, each a consecutive
share, every chunk attending the earlier chunks' KV where it stays (its queries sent to the members holding it, the
partial outputs merged by their softmax denominators); then the last member masters the greedy decode steps while
every member attends its queries over its share. Compares the first token's logits, every decode step's logits and
the greedy tokens with the single engine here, and checks that every member gave back every block.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..sp.verify import TOLERANCE, Reference, reference, reference_decode_logits, run_ranks
from ..sp.verify_worker import VerifySpec
from .verify_worker import KVPVerifySpec


@dataclass
class KVPVerifyResult:
    match: bool
    logit_max_abs_diff: float  # the last prompt token's
    decode_logit_max_abs_diff: float  # every decode step's
    logit_scale: float
    tokens: list[int]
    reference_tokens: list[int]
    chunks_per_member: list[int]
    blocks_leaked: list[int]
    seconds: float
    ranks: list[dict] = field(default_factory=list)

    def summary(self) -> str:
        return "\n".join([
            f"chunks computed per member {self.chunks_per_member}; blocks left per member {self.blocks_leaked}",
            f"max |logit diff| {self.logit_max_abs_diff:.3e} last prompt token, {self.decode_logit_max_abs_diff:.3e} "
            f"decode steps (largest |logit| {self.logit_scale:.1f})",
            f"greedy tokens  {self.tokens}",
            f"single engine  {self.reference_tokens}",
            "MATCH" if self.match else "MISMATCH",
        ])  # fmt: skip


def check(spec: KVPVerifySpec) -> None:
    """ValueError for a spec that cannot run."""
    if spec.members < 2:
        raise ValueError(f"--kvp-prefill must be >= 2, got {spec.members}")
    if spec.spp < 1:
        raise ValueError(f"--spp must be >= 1, got {spec.spp}")
    if spec.chunk < 1:
        raise ValueError(f"--chunk must be >= 1, got {spec.chunk}")
    if spec.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {spec.max_new_tokens}")
    masters = {m for _, _, m in spec.chunks()}
    if len(masters) < spec.members:
        raise ValueError(f"{len(spec.token_ids)} tokens in chunks of {spec.chunk} give {len(spec.chunks())} chunks: "
                         f"fewer than {spec.members} members (lower --chunk)")  # fmt: skip


def verify_kvp(spec: KVPVerifySpec, *, timeout_s: float = 600.0, ref: Reference | None = None) -> KVPVerifyResult:
    """Run `spec` and compare; `ref` (`sp.verify.reference` of the same prompt and tokens) may be passed to reuse."""
    check(spec)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="spindle-verify-kvp-") as tmp:
        out = Path(tmp)
        run_ranks(asdict(spec), spec.world, out, timeout_s, worker="spindle_engine.esp.verify_worker")
        tensors = [load_file(str(out / f"rank{r}.safetensors")) for r in spec.leaders()]
        reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(spec.world)]
    seconds = time.perf_counter() - t0
    rows: dict[int, tuple[torch.Tensor, int]] = {}
    for t in tensors:
        for i, index in enumerate(t["index"].tolist()):
            rows[index] = (t["logits"][i], int(t["tokens"][i]))
    n = spec.max_new_tokens
    tokens = [rows[i][1] for i in range(n) if i in rows]
    ref_spec = VerifySpec(spec.model, spec.dtype, "0:@0", "zigzag", spec.token_ids, max_new_tokens=n)
    ref_logits, ref_tokens, _ = ref if ref is not None else reference(ref_spec)
    scale = ref_logits.abs().max().item()
    tol = TOLERANCE[spec.dtype] * max(scale, 1.0)
    diff = (rows[0][0] - ref_logits).abs().max().item() if 0 in rows else float("inf")
    ref_decode = reference_decode_logits(ref_spec, tokens)
    decode = torch.stack([rows[i][0] for i in range(1, n) if i in rows]) if n > 1 and len(rows) > 1 else ref_decode
    decode_diff = (decode - ref_decode).abs().max().item() if decode.shape == ref_decode.shape else float("inf")
    per_member = [sum(1 for _, _, m in spec.chunks() if m == r) for r in range(spec.members)]
    leaked = [r["blocks_leaked"] for r in reports if r["stage"] == 0]
    ok = diff <= tol and decode_diff <= tol and tokens == ref_tokens and not any(leaked)
    return KVPVerifyResult(ok, diff, decode_diff, scale, tokens, ref_tokens, per_member, leaked, seconds, reports)
