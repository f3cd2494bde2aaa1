"""`spindle verify --reshard PPa[xTPb]:TPc`: a prompt prefilled as a pipeline (of tensor-parallel stages) and
decoded tensor-parallel on the same processes, the KV through the shared host tier, compared with one engine.

The driver publishes the model's weights once into shared host memory and creates the host KV tier, then starts
the ranks (`reshard.verify_worker`). Each round re-shards prefill -> decode and, from the second round on, back:
the tokens and logits of every round must equal the single engine's (last prompt token, every decode step). Also
reported: each switch's seconds and weight bytes (rebuilt from host memory, not the checkpoint), the KV bytes
pushed and pulled against the theory (the whole KV once per side), and how much of the swap-out / swap-in the
computation hid."""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from spindle_model import load_state_dict, resolve_model

from ..config import DTYPES
from ..sp.verify import TOLERANCE, reference, reference_decode_logits, run_ranks
from ..sp.verify_worker import VerifySpec
from .config import ReshardPlan
from .host_kv import HostKV
from .host_weights import HostWeights
from .verify_worker import ReshardSpec


@dataclass
class ReshardResult:
    plan: str
    match: bool
    logit_max_abs_diff: float  # over rounds: the last prompt token's and every decode step's
    logit_scale: float
    tokens: list[list[int]]  # per round
    reference_tokens: list[int]
    kv_bytes_theory: int  # the whole prompt KV: what each side should move over the group, per round
    kv_pushed: int  # over ranks and rounds
    kv_pulled: int
    weight_bytes_host: int  # the one shared copy
    switch_to_decode_s: list[float]  # per round, the slowest rank's rebuild
    switch_to_decode_bytes: list[int]  # per round, over ranks
    switch_to_prefill_s: list[float]  # rounds after the first: back to the prefill configuration
    switch_to_prefill_bytes: list[int]
    swap_out_hidden: float  # share of the push time the prefill's compute hid (1 = all)
    swap_in_hidden: float
    seconds: float
    ranks: list[dict] = field(default_factory=list)

    def summary(self) -> str:
        mib = 1 << 20
        out_back = (f"back {', '.join(f'{s:.3f}' for s in self.switch_to_prefill_s)} s "
                    f"({', '.join(f'{b / mib:.1f}' for b in self.switch_to_prefill_bytes)} MiB)"
                    if self.switch_to_prefill_s else "")  # fmt: skip
        rounds = len(self.tokens)
        return "\n".join([
            f"re-sharding {self.plan}, {rounds} round(s)",
            f"max |logit diff| {self.logit_max_abs_diff:.3e} (largest |logit| {self.logit_scale:.1f})",
            *[f"greedy tokens  {t}" for t in self.tokens],
            f"single engine  {self.reference_tokens}",
            f"KV through the host tier: pushed {self.kv_pushed / mib:.2f} MiB, pulled {self.kv_pulled / mib:.2f} MiB; "
            f"theory {rounds} x {self.kv_bytes_theory / mib:.2f} MiB each way",
            f"weights: one host copy of {self.weight_bytes_host / mib:.1f} MiB; to decode "
            f"{', '.join(f'{s:.3f}' for s in self.switch_to_decode_s)} s "
            f"({', '.join(f'{b / mib:.1f}' for b in self.switch_to_decode_bytes)} MiB over ranks) {out_back}",
            f"swap-out hidden behind prefill {self.swap_out_hidden:.0%}, "
            f"swap-in behind decode {self.swap_in_hidden:.0%}",
            "MATCH" if self.match else "MISMATCH",
        ])  # fmt: skip


def shared_dir() -> Path:
    """RAM-backed where there is one (Linux /dev/shm), else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def verify_reshard(
    plan: ReshardPlan,
    token_ids: list[int],
    *,
    model: str = "smollm2",
    dtype: str = "float32",
    max_new_tokens: int = 8,
    rounds: int = 2,
    threads: int = 1,
    timeout_s: float = 600.0,
) -> ReshardResult:
    source = resolve_model(model)
    mc = source.config
    plan.check(mc.num_layers, mc.num_kv_heads)
    if max_new_tokens < 1 or rounds < 1 or not token_ids:
        raise ValueError("a prompt, max_new_tokens >= 1 and rounds >= 1 are needed")
    t0 = time.perf_counter()
    base = shared_dir() / f"spindle-reshard-{uuid.uuid4().hex}"
    weights_path, kv_path = Path(f"{base}.weights"), Path(f"{base}.kv")
    torch_dtype = DTYPES[dtype]
    try:
        host = HostWeights.publish(load_state_dict(source.path, dtype=torch_dtype), weights_path)
        n = len(token_ids)
        HostKV(kv_path, mc.num_layers, mc.num_kv_heads, n, mc.head_dim, torch_dtype, create=True)
        spec = ReshardSpec(model, dtype, token_ids, plan.label(), str(weights_path), str(kv_path), max_new_tokens,
                           rounds, threads)  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="spindle-verify-reshard-") as tmp:
            out = Path(tmp)
            run_ranks(asdict(spec), plan.world, out, timeout_s, worker="spindle_engine.reshard.verify_worker")
            tensors = load_file(str(out / "rank0.safetensors"))
            reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(plan.world)]
    finally:
        HostWeights.remove(weights_path)
        kv_path.unlink(missing_ok=True)
    seconds = time.perf_counter() - t0

    ref_spec = VerifySpec(model, dtype, "0:@0", "zigzag", token_ids, max_new_tokens=max_new_tokens)
    ref_logits, ref_tokens, _ = reference(ref_spec)
    want = torch.cat([ref_logits[None], reference_decode_logits(ref_spec, ref_tokens)])  # [max_new_tokens, vocab]
    scale = ref_logits.abs().max().item()
    diff, tokens, ok = 0.0, [], True
    for r in range(rounds):
        got = tensors[f"logits{r}"]
        diff = max(diff, (got - want).abs().max().item() if got.shape == want.shape else float("inf"))
        tokens.append(tensors[f"tokens{r}"].tolist())
        ok = ok and tokens[-1] == ref_tokens
    ok = ok and diff <= TOLERANCE[dtype] * max(scale, 1.0)
    theory = HostKV.nbytes(mc.num_layers, mc.num_kv_heads, len(token_ids), mc.head_dim, torch_dtype)
    pushed = sum(r["kv_pushed"] for r in reports)
    pulled = sum(r["kv_pulled"] for r in reports)
    ok = ok and pushed == pulled == rounds * theory
    rows = [[r["rounds"][i] for r in reports] for i in range(rounds)]
    out_busy = sum(x["swap_out_s"] for rr in rows for x in rr)
    out_exposed = sum(x["swap_out_exposed_s"] for rr in rows for x in rr)
    in_busy = sum(x["swap_in_s"] for rr in rows for x in rr)
    in_exposed = sum(x["swap_in_exposed_s"] for rr in rows for x in rr)
    return ReshardResult(
        plan.label(), ok, diff, scale, tokens, ref_tokens, theory, pushed, pulled, host.nbytes,
        [max(x["decode_load_s"] for x in rr) for rr in rows],
        [sum(x["decode_weight_bytes"] for x in rr) for rr in rows],
        [max(x["prefill_load_s"] for x in rr) for rr in rows[1:]],
        [sum(x["prefill_weight_bytes"] for x in rr) for rr in rows[1:]],
        1 - out_exposed / out_busy if out_busy else 1.0, 1 - in_exposed / in_busy if in_busy else 1.0,
        seconds, reports,
    )  # fmt: skip
