"""The stack on one device: `spindle up` serves the `openai` client with the single engine's tokens, and then
carries a load (`bench_serve.py --url`).

    python bench/gpu_stack_check.py --device cuda --kit .gpu/model-kit --layouts pd,sp-tp,kvp --out $OUT/stack.json
    .venv/bin/python bench/gpu_stack_check.py --device cpu --kit .gpu/model-kit      # the same run on this CPU

Layouts (--layouts): `pd` 1 prefill + 1 decode instance (the KV hand-off; the load runs here), `sp-tp` 2 prefill
instances running every prompt as one SP 2 group (`fixed-sp:sp=2`: ring passes) and a TP 2 decode instance (the
hand-off split by heads, TP all-reduces), `kvp` a KV-parallel decode group of 2 (the longest prompt's KV split over
both: the q/out exchange). On one GPU every process shares it, so every pair is host-staged.

`--kit DIR`: a model directory without weights (config, tokenizer: `bench/gpu_kit.sh` makes one from the default
model); the script writes seeded random weights into a copy of it, as the GPU machine cannot receive the model's
538 MB. `--model` uses a model as it is instead. Steps:

1. the single engine (`LLM(..., device=D)`) generates --max-tokens greedy tokens for each prompt, one at a time;
2. per layout, `Stack(StackConfig(device=D, ...))` starts (nats-server, kvstore, scheduler, gateway, instances), and
   the `openai` client sends the same prompts, one at a time and then all at once; every completion must be the
   engine's text (float32 by default: the comparison is exact);
3. the instances' stats and the transport of each data-plane pair (from the logs) are recorded;
4. on `pd`, unless --no-load: `bench_serve.py --url` runs its load scenario (`vllm bench serve`'s fields).

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


def _layouts(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or not set(names) <= set(LAYOUTS):
        raise argparse.ArgumentTypeError(f"layouts must be among {', '.join(LAYOUTS)}, got {text!r}")
    return names


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
    p.add_argument("--layouts", type=_layouts, default=["pd"],
                   help=f"stack shapes to check, comma-separated, of: {', '.join(LAYOUTS)} (default: pd)")  # fmt: skip
    p.add_argument("--no-load", action="store_true", help="skip the bench_serve.py load (run on layout pd)")
    p.add_argument("--num-prompts", type=int, default=64, help="load: requests (default: 64)")
    p.add_argument("--input-len", type=int, default=1024, help="load: prompt tokens (default: 1024)")
    p.add_argument("--output-len", type=int, default=64, help="load: output tokens (default: 64)")
    p.add_argument("--load-runs", type=int, default=2,
                   help="load: times to run it on the same stack; runs after the first find the decode graphs\n"
                        "captured (default: 2)")  # fmt: skip
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
    if args.load_runs < 1:
        p.error("--load-runs must be >= 1")
    return args


def random_model(kit: Path, out_dir: Path, seed: int) -> Path:
    """A copy of `kit` with seeded random weights (normal, std 0.02; norms 1) in model.safetensors."""
    from safetensors.torch import save_file

    from spindle_model.gguf_convert import hf_weight_shapes

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in KIT_FILES:
        if (kit / name).is_file():
            shutil.copy(kit / name, out_dir / name)
    cfg = json.loads((kit / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in hf_weight_shapes(cfg).items():
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


def _log_lines(log_dir: Path, marks: tuple[str, ...], files: str = "*.log", width: int = 200) -> list[str]:
    """The services' log lines holding any of `marks`, each as "<service>: <its last `width` characters>"."""
    lines = []
    for f in sorted(log_dir.glob(files)):
        lines += [f"{f.stem}: {line.strip()[-width:]}" for line in f.read_text(errors="replace").splitlines()
                  if any(m in line for m in marks)]  # fmt: skip
    return lines


def transport_lines(log_dir: Path) -> list[str]:
    """The instances' log lines naming the transport of each data-plane pair (mesh.py logs one per group)."""
    return _log_lines(log_dir, ("gloo (", "host-staged (", "nccl (", "cuda-ipc ("))


def graph_captures(log_dir: Path) -> list[str]:
    """The decode instances' CUDA-graph capture lines (cuda_graphs.py: one per bucket captured on first use, one
    summary for those captured at start)."""
    return _log_lines(log_dir, ("decode graph for batch bucket", "decode graphs for"), "decode*.log", 160)


def what_ran(timeline: Any) -> dict[str, Any]:
    """From the gateway's live timeline: the scheduler's decisions, the largest SP group a prefill chunk ran on, and
    the most KV blocks each instance held (a KVP follower above 0: a request's KV was split onto it)."""
    if not isinstance(timeline, dict) or "spans" not in timeline:
        return {"error": f"no timeline: {str(timeline)[:200]}"}
    prefill = [sp for sp in timeline["spans"] if sp.get("kind") == "prefill"]
    peak: dict[str, int] = {}
    for instance, _, used, _ in timeline.get("kv", []):
        peak[instance] = max(peak.get(instance, 0), used)
    return {
        "decisions": sorted({d.get("text", "") for d in timeline.get("decisions", [])}),
        "max_prefill_sp": max((sp.get("sp", 1) for sp in prefill), default=0),
        "kv_blocks_peak": dict(sorted(peak.items())),
    }


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


# stack shapes: each runs the same prompts; "pd" also the load. The profile is an assumed one (SP 2 half of SP 1's
# time): fixed-sp only ranks groups by it.
LAYOUTS: dict[str, dict[str, Any]] = {
    "pd": dict(prefill=1, decode=1),  # the prefill -> decode hand-off
    "sp-tp": dict(prefill=2, decode=1, decode_tp=2, strategy="fixed-sp:sp=2"),  # ring passes, TP heads
    "kvp": dict(prefill=1, decode=1, decode_kvp=2, kvp_tokens=1024),  # KVP q/out exchange: the 1,500 one splits
}
ASSUMED_PROFILE = {
    "version": 1,
    "source": "gpu_stack_check: assumed",
    "prefill": {
        "1": {"coeffs": [0.08, 0.002, 9e-7, 1.2e-6], "fit_error": 0.0, "history_inferred": False},
        "2": {"coeffs": [0.04, 0.001, 4.5e-7, 6e-7], "fit_error": 0.0, "history_inferred": False},
    },
    "batch_prefill": None,
    "decode": [{"tp": 1, "kvp": 1, "coeffs": [0.04, 0.01, 1.6e-05], "fit_error": 0.0}],
    "transfer": {"latency_s": 0.001, "bandwidth_bytes_per_s": 1.5e9},
}


def check_layout(
    name: str, model: str, args: argparse.Namespace, batch: list[list[int]], expected: list[str], work: Path
) -> dict[str, Any]:
    """Start the stack of layout `name`, send the prompts with the `openai` client, compare, stop it."""
    from openai import OpenAI

    from spindle_launcher.stack import Stack, StackConfig

    log_dir = (args.log_dir or work / "logs") / name
    shape = dict(LAYOUTS[name])
    if str(shape.get("strategy", "")).startswith("fixed-sp"):
        profile = work / "profile.json"
        profile.write_text(json.dumps({"model": ASSUMED_PROFILE}))
        shape["profile"] = str(profile)
    config = StackConfig(model=model, dtype=args.dtype, device=args.device, port=0, ready_timeout=args.stack_timeout,
                         log_dir=str(log_dir), **shape)  # fmt: skip
    print(f"[{name}] starting the stack on {args.device}: {LAYOUTS[name]} (logs in {log_dir}) ...", flush=True)
    result: dict[str, Any] = {"stack": LAYOUTS[name]}
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
            print(f"[{name}] {mode}: {sum(same)}/{len(same)} completions equal the single engine's", flush=True)
        result["instances"] = _get_json(stack.url + "/v1/spindle/instances")
        result["what_ran"] = what_ran(_get_json(stack.url + "/v1/spindle/timeline?since=0"))
        result["transports"] = transport_lines(log_dir)
        if name == "pd" and not args.no_load:
            for run in range(args.load_runs):  # "load", then "load_2", ...: later runs find every graph captured
                key = "load" if run == 0 else f"load_{run + 1}"
                result[key] = run_load(stack.url, args, work / f"serve_{run + 1}.json")
                result[f"{key}_graph_captures"] = graph_captures(log_dir)
                ok &= "error" not in result[key]
    except Exception as e:
        ok = False
        result["error"] = repr(e)
        print(f"[{name}] FAILED: {e!r}; service logs in {log_dir}", file=sys.stderr, flush=True)
    finally:
        stack.stop()
        if not ok and log_dir.is_dir():
            result["log_tails"] = {f.name: f.read_text(errors="replace")[-3000:] for f in sorted(log_dir.glob("*.log"))}
    result["ok"] = ok
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.make_model is not None:
        print(f"wrote {random_model(args.kit, args.make_model, args.seed)}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="spindle-stack-check-"))
    model = str(random_model(args.kit, work / "model", args.seed)) if args.kit else args.model
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"] if args.kit else 40000
    batch = prompts(args.seed, vocab)
    result: dict[str, Any] = {"machine": machine(args.device), "model": "random weights" if args.kit else model}
    result |= {"dtype": args.dtype, "prompt_lengths": list(PROMPT_LENGTHS), "max_tokens": args.max_tokens}
    print(f"single engine on {args.device} ...", flush=True)
    expected, engine_s = engine_outputs(model, args, batch)
    result["engine_s"] = round(engine_s, 3)
    out = args.out or BENCH / "results" / f"stack_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result["layouts"], ok = {}, True
    for name in args.layouts:  # the summary is rewritten after each layout: a run cut short keeps what it did
        result["layouts"][name] = check_layout(name, model, args, batch, expected, work)
        result["ok"] = ok = all(r["ok"] for r in result["layouts"].values())
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'OK' if ok else 'MISMATCH or FAILURE'}; wrote {out}", flush=True)
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
