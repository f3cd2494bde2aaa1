"""The engine's triton attention backend against the torch backend, under TRITON_INTERPRET=1 on CPU.

The interpreter must be switched on before triton is imported, so the comparison runs in a subprocess (this
file run as a script): a tiny random Llama in fp32, prompts prefilled in chunks (so later chunks attend over
cached history) while other requests decode in the same steps. Greedy tokens must be identical and every
step's logits close.
"""

import json
import os
import subprocess
import sys

import pytest

MAX_LOGIT_DIFF = 1e-4


def _run_backend(backend: str) -> tuple[dict[str, list[int]], list]:
    import torch

    from spindle_engine import Engine, EngineConfig, SamplingParams
    from spindle_engine.testing import record_logits
    from spindle_model import LlamaModel
    from spindle_model.testing import tiny_llama

    hf, tiny = tiny_llama(0, num_layers=2, vocab_size=101, max_positions=256)
    with torch.no_grad():  # sharper weights than the default init, so greedy picks are not all trivial
        for p in hf.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    model = LlamaModel(tiny.config)
    model.load_weights(hf.state_dict())
    config = EngineConfig(
        model="tiny", block_size=4, kv_cache_tokens=512, max_num_batched_tokens=24, attention_backend=backend
    )
    engine = Engine(config, model=model)
    logits = record_logits(engine)
    g = torch.Generator().manual_seed(1)
    prompts = {"a": 37, "b": 13, "c": 3, "d": 21}
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for rid, n in prompts.items():
        engine.add_request(rid, torch.randint(3, 101, (n,), generator=g).tolist(), params)
        tokens[rid] = []
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
    return tokens, logits


def _compare() -> dict:
    ref_tokens, ref_logits = _run_backend("torch")
    tri_tokens, tri_logits = _run_backend("triton")
    assert len(ref_logits) == len(tri_logits)
    diff = max(float((a - b).abs().max()) for a, b in zip(ref_logits, tri_logits, strict=True) if a.numel())
    return {"torch": ref_tokens, "triton": tri_tokens, "max_logit_diff": diff, "steps": len(ref_logits)}


def test_triton_backend_matches_torch_backend():
    pytest.importorskip("triton", reason="triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["triton"] == result["torch"]
    assert all(len(t) == 5 for t in result["torch"].values())
    assert len({tuple(t) for t in result["torch"].values()}) > 1
    assert result["max_logit_diff"] <= MAX_LOGIT_DIFF, result


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps(_compare()))
