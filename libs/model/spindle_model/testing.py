"""Helpers for tests and self-checks that run real multi-process torch.distributed groups (gloo on CPU).

Workers are module-level functions here (not in test files) so spawned processes can import them.
Results come back as safetensors files, never pickles.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, fn: Callable[..., dict[str, torch.Tensor]], world: int, port: int, out_dir: str, args: tuple
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        if result:
            save_file({k: v.contiguous() for k, v in result.items()}, str(Path(out_dir) / f"rank{rank}.safetensors"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_gloo(
    fn: Callable[..., dict[str, torch.Tensor]], world: int, out_dir: Path, *args: object, timeout: float = 300.0
) -> list[dict[str, torch.Tensor]]:
    """Run `fn(rank, world, *args)` in `world` fresh processes joined in one gloo group on loopback.

    Returns each rank's returned tensors (an empty dict for ranks that return nothing).
    """
    ctx = mp.start_processes(
        _entry, args=(fn, world, free_port(), str(out_dir), args), nprocs=world, join=False, start_method="spawn"
    )
    while not ctx.join(timeout=timeout):
        pass
    results = []
    for r in range(world):
        p = Path(out_dir) / f"rank{r}.safetensors"
        results.append(load_file(str(p)) if p.exists() else {})
    return results


def parallel_logits_worker(rank: int, world: int, mode: str, model_dir: str, ids: list[int]) -> dict[str, torch.Tensor]:
    """Logits of `ids` computed by a `world`-way tensor-parallel ("tp") or pipeline ("pp") model."""
    from spindle_attention.distributed.comm import RankGroup

    from .config import ModelConfig
    from .llama import CausalAttention, LlamaModel
    from .parallel import shard_range
    from .weights import load_state_dict

    config = ModelConfig.from_dir(model_dir)
    weights = load_state_dict(Path(model_dir))
    tokens = torch.tensor(ids)
    pos = torch.arange(len(ids))
    with torch.inference_mode():
        if mode in ("tp", "tp-rank-group"):
            group = dist.group.WORLD if mode == "tp" else RankGroup(tuple(range(world)))
            model = LlamaModel(config, tp_group=group)
            model.load_weights(weights)
            logits = model.compute_logits(model(pos, CausalAttention(), input_ids=tokens))
            return {"logits": logits} if rank == 0 else {}
        if mode != "pp":
            raise ValueError(f"unknown mode {mode!r}")
        model = LlamaModel(config, layer_range=shard_range(config.num_layers, world, rank))
        model.load_weights(weights)
        hidden = None
        if rank > 0:
            hidden = torch.empty(len(ids), config.hidden_size)
            dist.recv(hidden, src=rank - 1)
        out = model(pos, CausalAttention(), input_ids=tokens if rank == 0 else None, hidden=hidden)
        if rank < world - 1:
            dist.send(out.contiguous(), dst=rank + 1)
            return {}
        return {"logits": model.compute_logits(out)}


def rank_group_all_reduce_worker(rank: int, world: int, shape: list[int]) -> dict[str, torch.Tensor]:
    """All-reduce over a RankGroup of every rank (in reverse order, so group rank != global rank) of a
    tensor seeded by the global rank; returns the input and the result."""
    from spindle_attention.distributed.comm import RankGroup

    from .parallel import all_reduce_

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(rank))
    out = x.clone()
    all_reduce_(out, RankGroup(tuple(reversed(range(world)))))
    return {"input": x, "output": out}


def tiny_tp_logits_worker(rank: int, world: int, ids: list[int]) -> dict[str, torch.Tensor]:
    """Logits of `ids` from `tiny_llama()` tensor-parallel over a RankGroup of every rank."""
    from spindle_attention.distributed.comm import RankGroup

    from .llama import CausalAttention, LlamaModel

    hf, full = tiny_llama()
    model = LlamaModel(full.config, tp_group=RankGroup(tuple(range(world))))
    model.load_weights(hf.state_dict())
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.arange(len(ids)), CausalAttention(), input_ids=torch.tensor(ids)))
    return {"logits": logits}


def tiny_llama(
    seed: int = 0, *, num_layers: int = 3, vocab_size: int = 301, max_positions: int = 512, tie: bool = True
):  # -> (transformers.LlamaForCausalLM, LlamaModel)
    """A tiny random-weight Llama (GQA 9:3, odd sizes) as a transformers model and the same weights as ours."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .config import ModelConfig
    from .llama import LlamaModel

    torch.manual_seed(seed)
    hc = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=72,
        intermediate_size=100,
        num_hidden_layers=num_layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=max_positions,
        rope_theta=1e4,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )
    hf = LlamaForCausalLM(hc).eval()
    model = LlamaModel(ModelConfig.from_hf(hc.to_dict()))
    model.load_weights(hf.state_dict())
    return hf, model
