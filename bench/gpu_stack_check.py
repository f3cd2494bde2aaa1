"""The stack on one device: `spindle up` with 1 prefill + 1 decode instance serves the `openai` client with the
single engine's tokens, and then carries a load (`bench_serve.py --url`).

    python bench/gpu_stack_check.py --device cuda --kit .gpu/model-kit --out $OUT/stack_cuda.json
    .venv/bin/python bench/gpu_stack_check.py --device cpu --kit .gpu/model-kit      # the same run on this CPU

`--kit DIR`: a model directory without weights (config, tokenizer: `bench/gpu_kit.sh` makes one from the default
model); the script writes seeded random weights into a copy of it, as the GPU machine cannot receive the model's
538 MB. `--model` uses a model as it is instead. Steps:

1. the single engine (`LLM(..., device=D)`) generates --max-tokens greedy tokens for each prompt, one at a time;
2. `Stack(StackConfig(device=D, prefill=1, decode=1))` starts (nats-server, kvstore, scheduler, gateway, the two
   instances), and the `openai` client sends the same prompts, one at a time and then all at once; every
   completion must be the engine's text (float32 by default: the comparison is exact);
3. the cluster status and each instance's stats (device, data-plane transports) are recorded;
4. unless --no-load: `bench_serve.py --url` runs its load scenario against the stack (`vllm bench serve`'s fields).

Writes a JSON summary; exit status 1 when a completion differs or a step fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
KIT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# prompts of several lengths (token ids drawn from ordinary tokens): short ones, one over a KV block, one long
PROMPT_LENGTHS = (5, 37, 300, 1500)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="where every engine runs: cpu or cuda (default: cuda)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--kit", type=Path, help="model directory without weights: random weights are written")
    src.add_argument("--model", help="a model as it is (name, HF directory or .gguf)")
    p.add_argument(
        "--make-model", type=Path, metavar="DIR", help="only write --kit's random-weight model to DIR, and exit"
    )
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (default: 0)")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt (default: 16)")
    p.add_argument("--no-load", action="store_true", help="skip the bench_serve.py load")
    p.add_argument("--num-prompts", type=int, default=64, help="load: requests (default: 64)")
    p.add_argument("--input-len", type=int, default=1024, help="load: prompt tokens (default: 1024)")
    p.add_argument("--output-len", type=int, default=64, help="load: output tokens (default: 64)")
    p.add_argument("--stack-timeout", type=float, default=240.0, help="seconds to wait for the stack (default: 240)")
    p.add_argument("--log-dir", type=Path, help="service logs (default: a temp dir, printed)")
    p.add_argument("--out", type=Path, help="JSON summary (default: bench/results/stack_<device>.json)")
    args = p.parse_args(argv)
    if args.device not in ("cpu", "cuda"):
        p.error(f"--device must be cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and args.make_model is None and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    if args.kit is not None and not (args.kit / "config.json").is_file():
        p.error(f"--kit {args.kit}: no config.json there (make one with bench/gpu_kit.sh)")
    if args.make_model is not None and args.kit is None:
        p.error("--make-model needs --kit")
    if args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    return args


def _weight_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The HF Llama tensors of a config, as spindle_model loads them."""
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q_rows, kv_rows = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], hidden)}
    shapes["model.norm.weight"] = (hidden,)
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (cfg["vocab_size"], hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_rows, hidden),
            p + "self_attn.k_proj.weight": (kv_rows, hidden),
            p + "self_attn.v_proj.weight": (kv_rows, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_rows),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def random_model(kit: Path, out_dir: Path, seed: int) -> Path:
    """A copy of `kit` with seeded random weights (normal, std 0.02; norms 1) in model.safetensors."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in KIT_FILES:
        if (kit / name).is_file():
            shutil.copy(kit / name, out_dir / name)
    cfg = json.loads((kit / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in _weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=gen) * 0.02
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir


def prompts(seed: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed + 1)
    high = min(vocab, 40000)
    return [torch.randint(1000, high, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def engine_outputs(model: str, args: argparse.Namespace, batch: list[list[int]]) -> tuple[list[str], float]:
    """The single engine's text for each prompt, generated one at a time; and the seconds it took."""
    from spindle_engine import LLM, SamplingParams

    llm = LLM(model=model, dtype=args.dtype, device=args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    texts = [llm.generate(ids, params)[0].text for ids in batch]
    elapsed = time.perf_counter() - t0
    del llm
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the stack's instances size their KV pools from free memory
    return texts, elapsed


def stack_outputs(client: Any, model: str, batch: list[list[int]], max_tokens: int, concurrent: bool) -> list[str]:
    def one(ids: list[int]) -> str:
        out = client.completions.create(
            model=model, prompt=ids, max_tokens=max_tokens, temperature=0.0, extra_body={"ignore_eos": True}
        )
        return out.choices[0].text

    if not concurrent:
        return [one(ids) for ids in batch]
    with ThreadPoolExecutor(len(batch)) as pool:
        return list(pool.map(one, batch))


def _get_json(url: str) -> Any:
    import httpx

    try:
        r = httpx.get(url, timeout=10, trust_env=False)
        return r.json() if r.status_code == 200 else {"status": r.status_code, "body": r.text[:500]}
    except Exception as e:  # recorded, not fatal: the check is the completions
        return {"error": repr(e)}


def transport_lines(log_dir: Path) -> list[str]:
    """The instances' log lines naming the transport of each data-plane pair (mesh.py logs one per group)."""
    marks = ("gloo (", "host-staged (", "nccl (", "cuda-ipc (")
    lines = []
    for f in sorted(log_dir.glob("*.log")):
        lines += [f"{f.stem}: {line.strip()[-200:]}" for line in f.read_text(errors="replace").splitlines()
                  if any(m in line for m in marks)]  # fmt: skip
    return lines


def run_load(url: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, str(BENCH / "bench_serve.py"), "--url", url, "--scenarios", "load",
        "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--request-rate", "inf", "--out", str(out),
    ]  # fmt: skip
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, timeout=600, check=False)
    if done.returncode != 0 or not out.is_file():
        return {"error": f"bench_serve.py exited {done.returncode}"}
    return json.loads(out.read_text())


def machine(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "torch": torch.__version__, "device": device}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.make_model is not None:
        print(f"wrote {random_model(args.kit, args.make_model, args.seed)}")
        return 0
    from openai import OpenAI

    from spindle_launcher.stack import Stack, StackConfig

    work = Path(tempfile.mkdtemp(prefix="spindle-stack-check-"))
    log_dir = args.log_dir or work / "logs"
    model = str(random_model(args.kit, work / "model", args.seed)) if args.kit else args.model
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"] if args.kit else 40000
    batch = prompts(args.seed, vocab)
    result: dict[str, Any] = {"machine": machine(args.device), "model": "random weights" if args.kit else model}
    result |= {"dtype": args.dtype, "prompt_lengths": list(PROMPT_LENGTHS), "max_tokens": args.max_tokens}
    print(f"single engine on {args.device} ...", flush=True)
    expected, engine_s = engine_outputs(model, args, batch)
    result["engine_s"] = round(engine_s, 3)
    config = StackConfig(model=model, dtype=args.dtype, device=args.device, prefill=1, decode=1, port=0,
                         ready_timeout=args.stack_timeout, log_dir=str(log_dir))  # fmt: skip
    print(f"starting the stack on {args.device} (logs in {log_dir}) ...", flush=True)
    ok = True
    stack = Stack(config)
    try:
        t0 = time.perf_counter()
        stack.start()
        result["stack_start_s"] = round(time.perf_counter() - t0, 1)
        client = OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=300)
        served = client.models.list().data[0].id
        for mode, concurrent in (("one_at_a_time", False), ("all_at_once", True)):
            t0 = time.perf_counter()
            got = stack_outputs(client, served, batch, args.max_tokens, concurrent)
            same = [g == e for g, e in zip(got, expected, strict=True)]
            ok &= all(same)
            result[mode] = {"same_as_engine": same, "seconds": round(time.perf_counter() - t0, 3)}
            print(f"{mode}: {sum(same)}/{len(same)} completions equal the single engine's", flush=True)
        result["instances"] = _get_json(stack.url + "/v1/spindle/instances")
        result["transports"] = transport_lines(log_dir)
        if not args.no_load:
            result["load"] = run_load(stack.url, args, work / "serve.json")
            ok &= "error" not in result["load"]
    except Exception as e:
        ok = False
        result["error"] = repr(e)
        print(f"FAILED: {e!r}; service logs in {log_dir}", file=sys.stderr, flush=True)
    finally:
        stack.stop()
        if not ok and log_dir.is_dir():
            result["log_tails"] = {f.name: f.read_text(errors="replace")[-3000:] for f in sorted(log_dir.glob("*.log"))}
    result["ok"] = ok
    out = args.out or BENCH / "results" / f"stack_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'OK' if ok else 'MISMATCH or FAILURE'}; wrote {out}", flush=True)
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
