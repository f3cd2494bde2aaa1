"""CSA's quality cost, measured (CSPS §3.2.4): passkey retrieval on the embedded SmolLM2, CSA against dense.

    .venv/bin/python bench/quality_csa.py                 # bench/results/quality_csa.json (long: see --help)
    .venv/bin/python bench/quality_csa.py --quick         # 8 samples, 1,024 tokens, two drop ratios: a smoke run

Each sample is a passkey prompt (a 5-digit key stated once at a random depth in neutral filler text, then asked for
at the end) of a fixed token length. The prompt is prefilled once densely and once through CSA (`CSAPrompt`: the
SP members' segments in levels, the first and last layers dense, the others dropping by the previous layer's
received attention, `--importance`), at every (SP size, drop ratio) of the grid; the answer is then decoded
greedily (dense attention over the KV that prefill left, as CSPS decodes). Per grid point:

- passkey accuracy with a Wilson 95 % interval, and McNemar's exact test against dense on the same prompts (the
  samples dense answers right and CSA wrong, and the reverse);
- greedy-token agreement with dense over the answer's tokens;
- the mean KL divergence KL(dense || CSA) of the next-token distributions at the last prompt token;
- the share of query-key pairs CSA attended in the dropping layers.

The largest drop ratio with no measurable loss is the largest one whose accuracy is not significantly below dense
(McNemar p > 0.05) at every SP size. The harness is fixed before any run: the filler, the key format, the depth
distribution and the answer check are not tuned to the outcome.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from spindle_attention import attention_fwd
from spindle_attention.csa import IMPORTANCE, CSALevels, CSAPrompt
from spindle_model import LlamaModel, Tokenizer, load_state_dict, resolve_model
from spindle_model.llama import CausalAttention
from spindle_policy.strategies.csps.configure import SHIPPED

RESULTS = Path(__file__).parent / "results"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
ANSWER_TOKENS = 8


class Recording:
    """Wraps an attention context and keeps every layer's k, v `[T, Hkv, D]` for the decode after prefill."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.kv = inner, {}

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.kv[layer] = (k, v)
        return self.inner.attention(layer, q, k, v)


class CachedDense:
    """Dense decode over the KV a prefill left, one token at a time."""

    def __init__(self, kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv = dict(kv)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ks, vs = self.kv[layer]
        ks, vs = torch.cat([ks, k]), torch.cat([vs, v])
        self.kv[layer] = (ks, vs)
        out, _ = attention_fwd(q, ks, vs, q_offset=ks.shape[0] - q.shape[0], return_lse=False)
        return out


def passkey_prompt(tok: Tokenizer, length: int, rng: random.Random) -> tuple[list[int], str]:
    """A prompt of exactly `length` tokens with a 5-digit key at a depth uniform in [10 %, 90 %]."""
    key = str(rng.randrange(10_000, 100_000))
    head = tok.encode("There is a pass key hidden inside a lot of irrelevant text. Find it and remember it.\n", False)
    needle = tok.encode(f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n", False)
    tail = tok.encode("\nWhat is the pass key? The pass key is", False)
    unit = tok.encode(FILLER, False)
    room = length - len(head) - len(needle) - len(tail)
    if room < len(unit):
        raise ValueError(f"{length} tokens leave no room for filler")
    filler = (unit * (room // len(unit) + 1))[:room]
    depth = int(room * rng.uniform(0.1, 0.9))
    return head + filler[:depth] + needle + filler[depth:] + tail, key


@torch.inference_mode()
def answer(model: LlamaModel, ids: list[int], ctx: Any) -> tuple[list[int], torch.Tensor]:
    """Greedy answer tokens after prefilling `ids` through `ctx`, and the last prompt token's log-probabilities."""
    rec = Recording(ctx)
    hidden = model(torch.arange(len(ids)), rec, input_ids=torch.tensor(ids))
    logp = torch.log_softmax(model.compute_logits(hidden[-1:])[0].float(), dim=-1)
    out = [int(logp.argmax())]
    dec = CachedDense(rec.kv)
    for i in range(ANSWER_TOKENS - 1):
        h = model(torch.tensor([len(ids) + i]), dec, input_ids=torch.tensor([out[-1]]))
        out.append(int(model.compute_logits(h)[0].argmax()))
    return out, logp


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def mcnemar(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for b and c discordant pairs."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(0, min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def run(args: argparse.Namespace) -> dict[str, Any]:
    source = resolve_model("smollm2")
    tok = Tokenizer(source.path)
    model = LlamaModel(source.config, dtype=torch.float32)
    model.load_weights(load_state_dict(source.path, dtype=torch.float32))
    layers = (0, source.config.num_layers)
    rng = random.Random(args.seed)
    samples = [passkey_prompt(tok, args.length, rng) for _ in range(args.samples)]
    dense = []
    for ids, key in tqdm(samples, desc="dense"):
        out, logp = answer(model, ids, CausalAttention())
        dense.append((out, logp, key in tok.decode(out)))
    points = []
    grid = [(sp, p) for sp in args.sp_sizes for p in args.drops]
    for sp, p in tqdm(grid, desc="csa grid"):
        correct, agree, kl, pairs, b, c = 0, 0.0, 0.0, [], 0, 0
        t0 = time.perf_counter()
        for (ids, key), (d_out, d_logp, d_ok) in zip(samples, dense, strict=True):
            levels = CSALevels.even(len(ids), sp, args.levels, p)
            ctx = CSAPrompt(levels, layers, block=args.block, importance=args.importance)
            out, logp = answer(model, ids, ctx)
            ok = key in tok.decode(out)
            correct += ok
            b += d_ok and not ok
            c += ok and not d_ok
            agree += sum(x == y for x, y in zip(out, d_out, strict=True)) / len(out)
            kl += float((d_logp.exp() * (d_logp - logp)).sum())
            middle = [k for k in ctx.attended if k not in (layers[0], layers[1] - 1)]
            pairs.append(sum(ctx.attended[k] for k in middle) / max(1, sum(ctx.dense_pairs[k] for k in middle)))
        n = len(samples)
        points.append({
            "sp": sp, "drop": p, "samples": n, "accuracy": correct / n, "accuracy_ci95": wilson(correct, n),
            "dense_right_csa_wrong": b, "csa_right_dense_wrong": c, "mcnemar_p": mcnemar(b, c),
            "greedy_agreement": agree / n, "kl_mean": kl / n, "pairs_attended": sum(pairs) / n,
            "seconds": time.perf_counter() - t0,
        })  # fmt: skip
    dense_correct = sum(ok for _, _, ok in dense)
    safe = [p for p in args.drops if all(x["mcnemar_p"] > 0.05 for x in points if x["drop"] == p)]
    return {
        "model": "smollm2", "length": args.length, "samples": len(samples), "seed": args.seed, "levels": args.levels,
        "importance": args.importance, "level_rule": "drop ratio min(1, 2^n p) at level 2+n",
        "dense": {"accuracy": dense_correct / len(samples), "accuracy_ci95": wilson(dense_correct, len(samples))},
        "points": points, "largest_drop_without_measurable_loss": max(safe) if safe else None,
    }  # fmt: skip


def table(doc: dict[str, Any]) -> str:
    d = doc["dense"]
    lines = [f"passkey, SmolLM2, {doc['length']} tokens, {doc['samples']} samples, levels {doc['levels'] or 'all'}, "
             f"importance {doc['importance']}; "
             f"dense accuracy "
             f"{d['accuracy']:.2f} [{d['accuracy_ci95'][0]:.2f}, {d['accuracy_ci95'][1]:.2f}]",
             "| SP | drop p | accuracy [95 % CI] | McNemar p | greedy agreement | KL (nats) | pairs attended |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for x in doc["points"]:
        lo, hi = x["accuracy_ci95"]
        lines.append(f"| {x['sp']} | {x['drop']} | {x['accuracy']:.2f} [{lo:.2f}, {hi:.2f}] | {x['mcnemar_p']:.3f} | "
                     f"{x['greedy_agreement']:.3f} | {x['kl_mean']:.4f} | {x['pairs_attended']:.2f} |")  # fmt: skip
    lines.append(f"largest drop ratio without measurable loss: {doc['largest_drop_without_measurable_loss']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens (default 2048; SmolLM2 takes 8192)")
    parser.add_argument("--samples", type=int, default=60, help="passkey prompts (default 60)")
    parser.add_argument("--sp-sizes", type=int, nargs="+", default=[4, 8], help="SP members (default 4 8)")
    parser.add_argument("--drops", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.3, 0.5, 0.7],
                        help="drop ratios p at level 2")  # fmt: skip
    parser.add_argument(
        "--levels",
        type=int,
        default=None,
        help="CSA levels (default: all, 1 + log2(SP); 2: the own segment, then everything else at p)",
    )
    parser.add_argument("--importance", choices=IMPORTANCE, default="own",
                        help="which received attention ranks the tokens (spindle_attention.csa.CSAPrompt)")  # fmt: skip
    parser.add_argument("--block", type=int, default=256, help="query rows per attention block")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 samples of 1,024 tokens, SP 4, p 0 and 0.5")
    parser.add_argument("--out", type=Path, default=None, help="JSON (default bench/results/quality_csa.json)")
    parser.add_argument("--ship", action="store_true",
                        help="also put the points in the csps strategy's quality table (replacing a run of the same "
                        "model, length, levels and importance)")  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.length, args.samples, args.sp_sizes, args.drops = 1024, 8, [4], [0.0, 0.5]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    doc = run(args)
    print(table(doc))
    out = args.out or RESULTS / ("quality_csa_quick.json" if args.quick else "quality_csa.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    if args.ship:
        ship(doc, out)


def ship(doc: dict[str, Any], source: Path) -> None:
    """The run's points, compact, in the table `csps:accuracy_loss=...` configures from (`configure.QualityTable`)."""
    key = ("model", "length", "levels", "importance")
    entry = {k: doc[k] for k in (*key, "samples", "seed", "level_rule")}
    entry |= {"source": str(source.relative_to(Path(__file__).parent.parent)), "dense": doc["dense"]}
    entry["points"] = [{k: p[k] for k in ("sp", "drop", "accuracy", "accuracy_ci95", "mcnemar_p", "pairs_attended")}
                       for p in doc["points"]]  # fmt: skip
    table = json.loads(SHIPPED.read_text()) if SHIPPED.exists() else []
    table = [t for t in table if tuple(t[k] for k in key) != tuple(entry[k] for k in key)] + [entry]
    SHIPPED.parent.mkdir(parents=True, exist_ok=True)
    SHIPPED.write_text(json.dumps(table, indent=1) + "\n")
    print(f"shipped to {SHIPPED}")


if __name__ == "__main__":
    main()
