"""The static-buffer decode path with the triton backend (TRITON_INTERPRET=1 on CPU) against eager triton.

What a captured graph launches: `paged_decode` with `max_seq_len` = max_model_len, a fixed num_splits (forced
to 3 here: a 40-token prompt spans two of them, shorter ones leave all but one empty), int32 block tables as wide as
max_model_len allows, padded rows on the scratch slot. Runs in a subprocess (this file as a script) because
the interpreter must be on before triton is imported.
"""

import json
import os
import subprocess
import sys

import pytest

MAX_LOGIT_DIFF = 1e-5


def _run(emulate: bool) -> tuple[dict[str, list[int]], list, dict]:
    import torch

    from spindle_engine import Engine, EngineConfig, SamplingParams
    from spindle_engine.cuda_graphs import EMULATE_ENV
    from spindle_engine.testing import record_logits
    from spindle_model.testing import tiny_llama

    _, model = tiny_llama(0, num_layers=2, vocab_size=101, max_positions=256)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    os.environ[EMULATE_ENV] = "1" if emulate else "0"
    config = EngineConfig(
        model="tiny", block_size=4, kv_cache_tokens=512, max_num_seqs=8, max_model_len=64, attention_backend="triton"
    )
    engine = Engine(config, model=model)
    assert (engine.runner.decode_graphs is not None) == emulate
    logits = record_logits(engine)
    g = torch.Generator().manual_seed(1)
    waves = [{"a": (9, 6), "b": (3, 5), "c": (40, 8)}, {"d": (5, 4), "e": (2, 3)}]  # id: (prompt, max_tokens)
    tokens: dict[str, list[int]] = {}
    step = 0
    while waves or engine.has_unfinished():
        if waves and step % 3 == 0:
            for rid, (n, max_tokens) in waves.pop(0).items():
                prompt = torch.randint(3, 101, (n,), generator=g).tolist()
                engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
                tokens[rid] = []
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
        step += 1
    graphs = engine.runner.decode_graphs
    return tokens, logits, (graphs.bucket_steps if graphs is not None else {})


def _compare() -> dict:
    import importlib

    module = importlib.import_module("spindle_attention.triton.paged_decode")  # the package exports the function
    # the graph runner asks for max_model_len's split count (64 here), eager steps for their longest sequence's
    module.default_num_splits = lambda batch, hkv, max_len, device: 3 if max_len == 64 else 1
    ref_tokens, ref_logits, _ = _run(emulate=False)
    tokens, logits, buckets = _run(emulate=True)
    assert len(ref_logits) == len(logits)
    assert all(a.shape == b.shape for a, b in zip(ref_logits, logits, strict=True))
    diff = max(float((a - b).abs().max()) for a, b in zip(ref_logits, logits, strict=True) if a.numel())
    return {"eager": ref_tokens, "graphs": tokens, "max_logit_diff": diff, "bucket_steps": buckets}


def test_triton_static_buffers_match_eager():
    pytest.importorskip("triton", reason="triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["graphs"] == result["eager"]
    assert len({tuple(t) for t in result["eager"].values()}) > 1
    assert result["max_logit_diff"] <= MAX_LOGIT_DIFF, result
    assert {"4", "8"} <= set(result["bucket_steps"]), result  # 3 and 5 rows, padded


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps(_compare()))
