"""GGUF -> Hugging Face conversion: Q/K un-permutation, weights, config and output files."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGUFReader
from safetensors import safe_open

from spindle_model.gguf_convert import convert_gguf, hf_tensor_name, unpermute_qk_rows
from spindle_model.sources import ModelSource
from spindle_model.weights import load_state_dict


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does, spelled out row by row: HF row s*half+j of a head goes to row 2*j+s."""
    head_dim = w.shape[0] // n_heads
    half = head_dim // 2
    out = np.empty_like(w)
    for h in range(n_heads):
        for s in range(2):
            for j in range(half):
                out[h * head_dim + 2 * j + s] = w[h * head_dim + s * half + j]
    return out


def _rope_rotate_half(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """HF convention on [n_heads, head_dim]: rotate element j with element j + head_dim/2."""
    half = x.shape[-1] // 2
    ang = pos * theta ** (-np.arange(half) / half)
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _rope_interleaved(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """llama.cpp's normal mode (GPT-J style): rotate adjacent pairs (2j, 2j+1)."""
    half = x.shape[-1] // 2
    ang = pos * theta ** (-np.arange(half) / half)
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x2 * cos + x1 * sin
    return out


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    rng = np.random.default_rng(0)
    for n_heads, head_dim in [(1, 2), (3, 8), (4, 64)]:
        w = rng.standard_normal((n_heads * head_dim, 5)).astype(np.float32)
        permuted = _llama_cpp_permute(w, n_heads)
        assert not np.array_equal(permuted, w) or head_dim == 2
        np.testing.assert_array_equal(unpermute_qk_rows(permuted, n_heads), w)


def test_unpermuted_weights_give_the_same_attention_scores_under_hf_rope() -> None:
    # Why the permutation exists: interleaved RoPE on GGUF rows == rotate_half RoPE on HF rows, up to row order.
    rng = np.random.default_rng(1)
    n_heads, n_kv, head_dim, hidden, theta = 4, 2, 16, 24, 10000.0
    wq_gguf = rng.standard_normal((n_heads * head_dim, hidden))
    wk_gguf = rng.standard_normal((n_kv * head_dim, hidden))
    wq_hf, wk_hf = unpermute_qk_rows(wq_gguf, n_heads), unpermute_qk_rows(wk_gguf, n_kv)
    xq, xk = rng.standard_normal(hidden), rng.standard_normal(hidden)
    pq, pk = 7, 3
    q_g = _rope_interleaved((wq_gguf @ xq).reshape(n_heads, head_dim), pq, theta)
    k_g = _rope_interleaved((wk_gguf @ xk).reshape(n_kv, head_dim), pk, theta)
    q_h = _rope_rotate_half((wq_hf @ xq).reshape(n_heads, head_dim), pq, theta)
    k_h = _rope_rotate_half((wk_hf @ xk).reshape(n_kv, head_dim), pk, theta)
    group = n_heads // n_kv
    scores_g = np.einsum("hd,hd->h", q_g, np.repeat(k_g, group, axis=0))
    scores_h = np.einsum("hd,hd->h", q_h, np.repeat(k_h, group, axis=0))
    np.testing.assert_allclose(scores_h, scores_g, rtol=1e-10, atol=1e-10)


def test_tensor_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    for bad in ("blk.0.attn_q.bias", "rope_freqs.weight", "blk.x.attn_q.weight", "something.weight"):
        with pytest.raises(ValueError):
            hf_tensor_name(bad)


def test_weights_match_transformers_gguf_loader(
    smollm2_source: ModelSource, smollm2_gguf: Path, gguf_reader: GGUFReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    # transformers' own GGUF reading (the function `from_pretrained(gguf_file=...)` uses; calling it directly
    # avoids from_pretrained's hard requirement on `accelerate`), mapped onto a meta-device LlamaForCausalLM.
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # Speed only (the loader imports both names from gguf at call time): reuse the session's parsed reader, and
    # build gguf's tensor-name map once instead of once per submodule (~400 times, several seconds).
    monkeypatch.setattr(gguf, "GGUFReader", lambda path: gguf_reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(smollm2_source.path))
    theirs = load_gguf_checkpoint(str(smollm2_gguf), return_tensors=True, model_to_load=model)["tensors"]
    ours = load_state_dict(smollm2_source.path)
    expected_names = {n for n in model.state_dict() if n != "lm_head.weight"}  # tied: lm_head is embed_tokens
    assert set(ours) == expected_names
    assert set(theirs) == expected_names
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert tensor.shape == theirs[name].shape, name
        assert torch.equal(tensor, theirs[name].float()), name


def test_transformers_runs_the_converted_model(smollm2_source: ModelSource) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(smollm2_source.path, dtype=torch.float32, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(smollm2_source.path, local_files_only=True)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id)
    text = tok.decode(out[0, ids.shape[1] :])
    assert "Paris" in text, text


def test_config_matches_metadata(smollm2_source: ModelSource, gguf_reader: GGUFReader) -> None:
    def meta(key: str) -> object:
        return gguf_reader.get_field(key).contents()

    cfg = json.loads((smollm2_source.path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == meta("llama.block_count") == 30
    assert cfg["hidden_size"] == meta("llama.embedding_length") == 576
    assert cfg["intermediate_size"] == meta("llama.feed_forward_length")
    assert cfg["num_attention_heads"] == meta("llama.attention.head_count") == 9
    assert cfg["num_key_value_heads"] == meta("llama.attention.head_count_kv") == 3
    assert cfg["head_dim"] == meta("llama.rope.dimension_count") == 64
    assert cfg["vocab_size"] == meta("llama.vocab_size") == 49152
    assert cfg["max_position_embeddings"] == meta("llama.context_length")
    assert cfg["rope_theta"] == 100000.0
    assert cfg["rms_norm_eps"] == 1e-5
    assert cfg["tie_word_embeddings"] is True
    assert cfg["torch_dtype"] == "float32"
    assert cfg["bos_token_id"] == meta("tokenizer.ggml.bos_token_id") == 1
    assert cfg["eos_token_id"] == meta("tokenizer.ggml.eos_token_id") == 2
    assert cfg["pad_token_id"] == meta("tokenizer.ggml.padding_token_id") == 2

    c = smollm2_source.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.vocab_size, c.rope_theta, c.rms_norm_eps, c.rope_scaling) == (49152, 100000.0, 1e-5, None)
    assert c.tie_word_embeddings and c.bos_token_id == 1 and c.eos_token_ids == (2,)

    gen = json.loads((smollm2_source.path / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == 2


def test_output_files(smollm2_source: ModelSource, gguf_reader: GGUFReader) -> None:
    d = smollm2_source.path
    for name in (
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (d / name).is_file(), name
    with safe_open(d / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    assert "lm_head.weight" not in names and len(names) == 2 + 9 * 30
    template = gguf_reader.get_field("tokenizer.chat_template").contents()
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    saved = tok_cfg.get("chat_template") or (d / "chat_template.jinja").read_text()
    assert saved == template
    assert "local_files_only" not in tok_cfg
    leftovers = [p.name for p in d.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_failed_conversion_leaves_nothing(
    tmp_path: Path, smollm2_gguf: Path, gguf_reader: GGUFReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0
    real_dequantize = gguf.quants.dequantize

    def failing_dequantize(data: np.ndarray, qtype: object) -> np.ndarray:
        nonlocal calls
        calls += 1
        if calls > 5:
            raise RuntimeError("simulated crash")
        return real_dequantize(data, qtype)

    # Reuse the session's parsed reader: parsing the metadata again costs seconds.
    monkeypatch.setattr(gguf, "GGUFReader", lambda path: gguf_reader)  # the converter imports gguf on use
    monkeypatch.setattr(gguf.quants, "dequantize", failing_dequantize)
    out = tmp_path / "out" / "model"
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_gguf(smollm2_gguf, out, progress=False)
    assert list((tmp_path / "out").iterdir()) == []


def test_convert_refuses_existing_output_and_bad_input(tmp_path: Path, smollm2_gguf: Path) -> None:
    (tmp_path / "exists").mkdir()
    with pytest.raises(ValueError, match="already exists"):
        convert_gguf(smollm2_gguf, tmp_path / "exists", progress=False)
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file" * 100)
    with pytest.raises(ValueError, match="cannot read GGUF"):
        convert_gguf(bogus, tmp_path / "bogus", progress=False)
    assert not (tmp_path / "bogus").exists()
