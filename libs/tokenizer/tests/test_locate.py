"""Model location without conversion: known names, GGUF files, HF directories, errors; and no torch anywhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from spindle_tokenizer import known_model_gguf, known_model_names, locate_model


def test_known_name_before_and_after_conversion(tmp_path: Path, smollm2_cache: Path, smollm2_dir: Path) -> None:
    empty = locate_model("smollm2", cache_dir=tmp_path)
    assert empty.gguf == known_model_gguf("smollm2") and empty.name == "smollm2"
    assert empty.path.parent == tmp_path / "models" and not empty.ready
    with pytest.raises(ValueError, match="has not been converted"):
        empty.config()
    assert not (tmp_path / "models").exists()  # locating writes nothing

    done = locate_model("HuggingFaceTB/SmolLM2-135M-Instruct", cache_dir=smollm2_cache)
    assert done.ready and done.path == smollm2_dir and done.name == "smollm2"
    assert done.config()["vocab_size"] == 49152
    by_path = locate_model(str(known_model_gguf("smollm2")), cache_dir=smollm2_cache)
    assert (by_path.name, by_path.path, by_path.ready) == ("SmolLM2-135M-Instruct.Q4_1", smollm2_dir, True)
    assert "smollm2" in known_model_names()


def test_cache_dir_from_environment(smollm2_cache: Path, smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(smollm2_cache))
    assert locate_model("smollm2").path == smollm2_dir


def test_directory(smollm2_dir: Path) -> None:
    loc = locate_model(str(smollm2_dir))
    assert (loc.path, loc.gguf, loc.ready, loc.name) == (smollm2_dir, None, True, smollm2_dir.name)
    assert loc.config()["max_position_embeddings"] == 8192


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown model 'no-such-model'.*smollm2"):
        locate_model("no-such-model", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="non-empty"):
        locate_model(" ")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"no config.json; it holds GGUF files \(m.gguf\)"):
        locate_model(str(tmp_path / "d"))
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="unsupported model file"):
        locate_model(str(tmp_path / "model.bin"))


def test_no_torch_no_transformers(smollm2_cache: Path) -> None:
    """Everything the gateway needs (locate, load, encode, chat, stream decode) imports neither."""
    code = f"""
import sys
from spindle_tokenizer import IncrementalDetokenizer, Tokenizer, locate_model
loc = locate_model("smollm2", cache_dir={str(smollm2_cache)!r})
assert loc.ready
tok = Tokenizer(loc.path)
ids = tok.apply_chat_template([{{"role": "user", "content": "hi"}}])
detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
assert detok.extend(ids) + detok.flush() == tok.render_chat([{{"role": "user", "content": "hi"}}])
heavy = sorted(m for m in ("torch", "transformers", "numpy", "spindle_model") if m in sys.modules)
assert not heavy, heavy
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
