"""The user-facing API (`LLM`, the generate CLI) on the real default model."""

import subprocess
import sys

import pytest
import torch

from spindle_engine import LLM, SamplingParams
from spindle_engine.generate import main as generate_main


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="smollm2", kv_cache_tokens=16384)


def test_text_and_token_prompts(llm):
    ids = llm.tokenizer.encode("The capital of France is")
    outs = llm.generate(["The capital of France is", ids], SamplingParams(max_tokens=8, temperature=0.0))
    assert len(outs) == 2
    assert outs[0].token_ids == outs[1].token_ids and outs[0].prompt_token_ids == ids
    assert "Paris" in outs[0].text
    assert outs[0].finish_reason in ("stop", "length")


def test_chat_prompt_stops_at_end_of_turn(llm):
    out = llm.generate(
        [llm.chat([{"role": "user", "content": "Say hello."}])], SamplingParams(max_tokens=64, temperature=0.0)
    )[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids
    assert out.text.strip()


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, seed=5, ignore_eos=True)
    a = llm.generate(["Once upon a time"], p)[0].token_ids
    b = llm.generate(["Once upon a time", "Another prompt in the batch"], [p, SamplingParams(max_tokens=3)])[0]
    assert a == b.token_ids and len(a) == 10


@pytest.mark.parametrize(
    "prompt,match",
    [
        ("", "empty"),
        ([], "empty"),
        ([1] * 8193, "8193 tokens.*8192"),
        ([1, 10**6], "token ids"),
        (3.5, "string or a list"),
    ],
)
def test_bad_prompts_raise_value_error_and_leave_engine_untouched(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt, "fine"], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished() and llm.engine.allocator.num_used == 0


@pytest.mark.parametrize("model,match", [("no-such-model", "smollm2"), ("/nonexistent/dir", "nonexistent")])
def test_unknown_model_raises_value_error(model, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=model)


def test_cli_generates(capsys):
    assert generate_main(["--prompt", "What is 2+2?", "--chat", "--max-tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "generated tokens" in captured.err


def test_cli_reports_bad_input_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "spindle_engine.generate", "--prompt", "x", "--max-tokens", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "max_tokens" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "spindle_engine.generate", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "--chat" in proc.stdout


def test_bfloat16_engine_generates():
    llm = LLM(model="smollm2", dtype="bfloat16", kv_cache_tokens=8192)
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert "Paris" in out.text
    assert llm.engine.model.layers[0].qkv_proj._packed is not None or not torch.backends.mkldnn.is_available()
