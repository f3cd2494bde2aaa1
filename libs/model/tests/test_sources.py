"""Model resolution: known names, GGUF files (cached conversion), HF directories, errors; safetensors loading."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from spindle_model import sources
from spindle_model.sources import gguf_cache_key, known_model_names, resolve_model
from spindle_model.weights import load_state_dict
from spindle_tokenizer import locate


def _no_conversion(*args: object, **kwargs: object) -> None:
    raise AssertionError("resolve_model reconverted a cached model")


def test_second_resolve_uses_cache(smollm2_converted: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    first = smollm2_converted
    monkeypatch.setattr(sources, "convert_gguf", _no_conversion)
    start = time.perf_counter()
    again = resolve_model("smollm2", cache_dir=first.cache_dir, progress=False)
    cached = time.perf_counter() - start
    print(f"\n[spindle_model] smollm2 resolve: first (conversion) {first.seconds:.2f} s, cached {cached * 1e3:.1f} ms")
    assert again == first.source
    assert cached < 1.0
    assert again.path.parent == first.cache_dir / "models"
    assert again.path.name.startswith("SmolLM2-135M-Instruct.Q4_1-")


def test_aliases_gguf_path_and_env_cache_dir(smollm2_converted: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "convert_gguf", _no_conversion)
    cache, expected = smollm2_converted.cache_dir, smollm2_converted.source.path
    for alias in ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", " SMOLLM2 "):
        src = resolve_model(alias, cache_dir=cache, progress=False)
        assert (src.name, src.path) == ("smollm2", expected)
    by_path = resolve_model(str(smollm2_converted.gguf_path), cache_dir=cache, progress=False)
    assert (by_path.name, by_path.path) == ("SmolLM2-135M-Instruct.Q4_1", expected)
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(cache))
    assert resolve_model("smollm2", progress=False).path == expected
    assert "smollm2" in known_model_names()


def test_cache_key_tracks_file_and_converter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(os.urandom(3 << 20))
    key = gguf_cache_key(f)
    assert gguf_cache_key(f) == key
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    key_touched = gguf_cache_key(f)
    assert key_touched != key
    monkeypatch.setattr(locate, "CONVERTER_VERSION", locate.CONVERTER_VERSION + 1)
    assert gguf_cache_key(f) != key_touched


def test_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown model 'no-such-model'.*smollm2"):
        resolve_model("no-such-model", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="non-empty"):
        resolve_model("  ", cache_dir=tmp_path)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file or directory"):
        resolve_model(str(tmp_path / "missing" / "model.gguf"), cache_dir=tmp_path)


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no config\.json"):
        resolve_model(str(tmp_path / "empty"), cache_dir=tmp_path)
    (tmp_path / "empty" / "x.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"has no config.json; it holds GGUF files \(x.gguf\)"):
        resolve_model(str(tmp_path / "empty"), cache_dir=tmp_path)


def test_non_llama_config_and_missing_weights(tmp_path: Path) -> None:
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="not a Llama-family model"):
        resolve_model(str(d), cache_dir=tmp_path)
    d = tmp_path / "noweights"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            }
        )
    )
    with pytest.raises(ValueError, match="no safetensors weights"):
        resolve_model(str(d), cache_dir=tmp_path)


def test_unsupported_or_corrupt_file(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match=r"expected a \.gguf file"):
        resolve_model(str(tmp_path / "model.bin"), cache_dir=tmp_path)
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        resolve_model(str(tmp_path / "broken.gguf"), cache_dir=cache)
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())


@pytest.fixture(scope="module")
def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=5e5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=[2, 3],
    )
    return LlamaForCausalLM(config).eval()


def test_hf_directory_source(tmp_path: Path, tiny_llama: LlamaForCausalLM) -> None:
    d = tmp_path / "tiny-llama"
    tiny_llama.save_pretrained(d)
    src = resolve_model(str(d), cache_dir=tmp_path / "cache")
    assert (src.name, src.path) == ("tiny-llama", d.resolve())
    assert not (tmp_path / "cache").exists()  # nothing converted
    c = src.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (256, 64, 128, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rope_theta) == (4, 2, 16, 5e5)
    assert not c.tie_word_embeddings and c.eos_token_ids == (2, 3)
    expected = tiny_llama.state_dict()
    loaded = load_state_dict(src.path)
    assert set(loaded) == set(expected)
    for name, tensor in loaded.items():
        assert torch.equal(tensor, expected[name]), name


def test_load_state_dict_layouts(tmp_path: Path, tiny_llama: LlamaForCausalLM) -> None:
    expected = tiny_llama.state_dict()
    sharded = tmp_path / "sharded"
    tiny_llama.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    loose = tmp_path / "loose"
    loose.mkdir()
    names = sorted(expected)
    save_file({n: expected[n].contiguous() for n in names[:5]}, str(loose / "part-a.safetensors"))
    save_file({n: expected[n].contiguous() for n in names[5:]}, str(loose / "part-b.safetensors"))
    for path in (sharded, loose):
        loaded = load_state_dict(path)
        assert set(loaded) == set(expected)
        assert all(torch.equal(loaded[n], expected[n]) for n in expected)
    single = load_state_dict(loose / "part-a.safetensors", dtype=torch.bfloat16)
    assert set(single) == set(names[:5]) and all(t.dtype == torch.bfloat16 for t in single.values())
    save_file({names[0]: expected[names[0]].contiguous()}, str(loose / "dup.safetensors"))
    with pytest.raises(ValueError, match="more than one file"):
        load_state_dict(loose)
    (tmp_path / "nothing-here").mkdir()
    with pytest.raises(ValueError, match="no safetensors weights"):
        load_state_dict(tmp_path / "nothing-here")
    with pytest.raises(ValueError, match="not found"):
        load_state_dict(tmp_path / "missing")


def test_stale_temporary_directories_are_removed(tmp_path: Path) -> None:
    dest = tmp_path / "models" / "m-123"
    old, fresh = dest.parent / ".m-123.tmp-old", dest.parent / ".m-123.tmp-new"
    old.mkdir(parents=True)
    fresh.mkdir()
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    sources._remove_stale_temporaries(dest)
    assert not old.exists() and fresh.exists()
