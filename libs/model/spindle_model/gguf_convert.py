"""Convert a llama-architecture GGUF file into a Hugging Face style model directory.

The output holds fp32 `model.safetensors` under Hugging Face tensor names (with the Q/K rows put back in HF's
rotate_half RoPE layout), `config.json`, `generation_config.json` and the tokenizer files written by transformers'
own GGUF tokenizer conversion. The directory appears atomically: it is built in a temporary sibling and renamed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from spindle_tokenizer.locate import CONVERTER_VERSION as CONVERTER_VERSION

if TYPE_CHECKING:  # gguf is imported where a conversion runs: loading HF directories never needs it
    from gguf import GGUFReader

logger = logging.getLogger("spindle.model")

# CONVERTER_VERSION (imported above: it is part of the cache path): bump it whenever this converter's output
# changes, so that cached conversions are redone.

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def hf_tensor_name(gguf_name: str) -> str:
    """Map a llama GGUF tensor name (`blk.3.attn_q.weight`) to its Hugging Face name; ValueError if unknown."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[1].isdigit()
        and parts[3] == "weight"
        and parts[2] in _BLOCK_TENSORS
    ):
        return f"model.layers.{int(parts[1])}.{_BLOCK_TENSORS[parts[2]]}.weight"
    if gguf_name == "rope_freqs.weight":
        raise ValueError("GGUF files with a rope_freqs tensor (Llama 3.1-style RoPE scaling) are not supported")
    raise ValueError(f"unsupported tensor {gguf_name!r} in a llama GGUF file")


def unpermute_qk_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    Hugging Face Llama rotates the two halves of each head (rotate_half): row `s * head_dim/2 + j` of a head holds
    half `s` of rotary pair `j`. llama.cpp's converter interleaves the pairs instead, moving that row to `2 * j + s`.
    Viewing GGUF rows as [n_heads, head_dim/2, 2, ...] and swapping the middle axes restores [n_heads, 2, head_dim/2].
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot split {rows} rows into {n_heads} heads of rotary pairs")
    w = weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(weight.shape))


class _Metadata:
    def __init__(self, reader: GGUFReader) -> None:
        self._reader = reader
        self.arch = self.get("general.architecture")
        if self.arch is None:
            raise ValueError("GGUF file has no general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        """A scalar or string metadata value (decoded here rather than with ReaderField.contents(), which older
        gguf releases lack)."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        if len(field.types) != 1:
            raise ValueError(f"GGUF metadata {key} is an array; expected a single value")
        value = field.parts[field.data[0]]
        from gguf import GGUFValueType

        if field.types[0] == GGUFValueType.STRING:
            return bytes(value).decode("utf-8")
        return value[0].item()

    def get_arch(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.get_arch(key)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {self.arch}.{key}")
        return value


def _f32(value: float) -> float:
    # GGUF stores these as float32: print the shortest decimal that round-trips (1e-05, not 9.999999747378752e-06).
    return float(str(np.float32(value)))


def _hf_config(meta: _Metadata, tensor_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    hidden = int(meta.require("embedding_length"))
    n_heads = int(meta.require("attention.head_count"))
    n_kv_heads = int(meta.get_arch("attention.head_count_kv", n_heads))
    head_dim = int(meta.get_arch("attention.key_length", hidden // n_heads))
    rope_dim = int(meta.get_arch("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embeddings are not supported (rope dim {rope_dim}, head dim {head_dim})")
    vocab = tensor_shapes["model.embed_tokens.weight"][0]
    meta_vocab = meta.get_arch("vocab_size")
    if meta_vocab is not None and int(meta_vocab) != vocab:
        raise ValueError(f"{meta.arch}.vocab_size={meta_vocab} but token_embd has {vocab} rows")
    rope_theta = _f32(meta.get_arch("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require("feed_forward_length")),
        "num_hidden_layers": int(meta.require("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(meta.get_arch("context_length", 2048)),
        "rms_norm_eps": _f32(meta.get_arch("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "tie_word_embeddings": "lm_head.weight" not in tensor_shapes,
        "torch_dtype": "float32",
    }
    scaling_type = meta.get_arch("rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ValueError(f"unsupported GGUF rope scaling type {scaling_type!r} (supported: linear)")
        config["rope_scaling"] = {"rope_type": "linear", "factor": _f32(meta.require("rope.scaling.factor"))}
    for hf_key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        token_id = meta.get(f"tokenizer.ggml.{gguf_key}")
        if token_id is not None:
            config[hf_key] = int(token_id)
    return config


def _generation_config(meta: _Metadata, config: dict[str, Any]) -> dict[str, Any]:
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    # Chat models (Llama 3) end turns with an end-of-turn token that differs from EOS: stop on both.
    stops = [config.get("eos_token_id")] + [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    stops = list(dict.fromkeys(int(t) for t in stops if t is not None))
    if len(stops) > 1:
        gen["eos_token_id"] = stops
    return gen


def hf_weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The HF Llama tensors of a `config.json` (with `head_dim`), by name: what a converted directory holds."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
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


def _convert_tensors(reader: GGUFReader, config: dict[str, Any], progress: bool) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    tensors: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc="Dequantizing GGUF", unit="tensor", disable=not progress):
        name = hf_tensor_name(t.name)
        weights = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        # GGUF lists dims innermost first; dequantize already returns the numpy (row-major) order, [out, in].
        assert weights.shape == tuple(int(d) for d in reversed(t.shape)), (t.name, weights.shape, t.shape)
        if name.endswith("q_proj.weight"):
            weights = unpermute_qk_rows(weights, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weights = unpermute_qk_rows(weights, config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(weights)
    return tensors


def _check_tensors(tensors: dict[str, np.ndarray], config: dict[str, Any]) -> None:
    expected = hf_weight_shapes(config)
    missing = sorted(expected.keys() - tensors.keys())
    extra = sorted(tensors.keys() - expected.keys())
    if missing or extra:
        raise ValueError(f"GGUF tensors do not match the config: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise ValueError(f"tensor {name} has shape {tensors[name].shape}, expected {shape} from the metadata")


def _save_tokenizer(gguf_path: Path, out_dir: Path, chat_template: str | None) -> None:
    # The generic fast tokenizer runs the same GGUF conversion as AutoTokenizer (which picks this very class for
    # gpt2-BPE GGUFs) without AutoTokenizer's extra full parse of the file just to choose a class: ~3 s saved.
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    if chat_template and not tok.chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(str(out_dir))
    # transformers records how this instance was loaded; that says nothing about the tokenizer itself.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Convert `gguf_path` (llama architecture) into the Hugging Face model directory `out_dir`, which must not exist.

    If another process finishes the same `out_dir` first, its result is kept and returned.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ValueError(f"GGUF file not found: {gguf_path}")
    if out_dir.exists():
        raise ValueError(f"output directory already exists: {out_dir}")
    from gguf import GGUFReader

    start = time.perf_counter()
    try:
        reader = GGUFReader(gguf_path)
        meta = _Metadata(reader)
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"cannot read GGUF file {gguf_path}: {e}") from e
    if meta.arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {meta.arch!r} in {gguf_path} (supported: llama)")
    shapes = {hf_tensor_name(t.name): tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    config = _hf_config(meta, shapes)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tensors = _convert_tensors(reader, config, progress)
        _check_tensors(tensors, config)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", _generation_config(meta, config))
        _save_tokenizer(gguf_path, tmp, meta.get("tokenizer.chat_template"))
        # mkdtemp makes the directory private; the result is a shared, read-mostly cache entry.
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():
                raise
            logger.info("another process converted %s into %s first; keeping its copy", gguf_path, out_dir)
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s -> %s in %.1f s", gguf_path, out_dir, time.perf_counter() - start)
    return out_dir
