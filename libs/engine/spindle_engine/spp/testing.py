"""A sequence-pipeline-parallel engine on local gloo processes with the tiny random Llama (tests).

`pipeline_worker` runs under `spindle_model.testing.run_gloo`: `world` ranks as `world // tp` stages of `tp` ranks;
rank 0 leads. The leader plays the same script (`tp.testing.run_script`) that the test plays on one full engine.
"""

from __future__ import annotations

import json

import torch

from spindle_attention.distributed.comm import RankGroup
from spindle_model import LlamaModel
from spindle_model.testing import tiny_llama

from ..config import EngineConfig
from ..tp.testing import run_script
from .leader import SPPLeaderEngine, spp_engine_config
from .stage import PipelineLayout, PipelineStage, stage_layers

CONFIG = EngineConfig(kv_cache_tokens=1024, block_size=4, max_model_len=256, max_num_batched_tokens=7)


def stage_model(layout: PipelineLayout, rank: int, **tiny: object) -> tuple[LlamaModel, torch.Tensor | None]:
    """The tiny Llama's part at `rank` of `layout` (its stage's layers, its heads of them), and for the leader the
    lm_head weight."""
    hf, full = tiny_llama(**tiny)  # type: ignore[arg-type]
    stage, _ = layout.position(rank)
    ranks = layout.stages[stage]
    group = RankGroup(ranks) if len(ranks) > 1 else None
    model = LlamaModel(full.config, layer_range=stage_layers(full.config.num_layers, layout.spp, stage), tp_group=group)
    weights = hf.state_dict()
    model.load_weights(weights)
    if rank != layout.leader:
        return model, None
    key = "model.embed_tokens.weight" if full.config.tie_word_embeddings else "lm_head.weight"
    return model, weights[key]


def pipeline_worker(rank: int, world: int, script_json: str, tie: bool = True, tp: int = 1) -> dict[str, torch.Tensor]:
    layout = PipelineLayout.consecutive(0, world // tp, tp)
    model, head = stage_model(layout, rank, tie=tie)
    config = spp_engine_config(CONFIG, model.config, layout.spp, tp)
    if rank != layout.leader:
        stage = PipelineStage(model, layout, rank, num_blocks=config.kv_cache_tokens // config.block_size,
                              block_size=config.block_size)  # fmt: skip
        stage.serve()
        return {"steps": torch.tensor([stage.stats.steps]), "tokens": torch.tensor([stage.stats.tokens])}
    assert head is not None
    leader = SPPLeaderEngine(config, model, head, layout, keepalive_s=3600.0)
    tokens = run_script(leader, json.loads(script_json))
    out = {f"tokens:{rid}": torch.tensor(t) for rid, t in tokens.items()}
    out["blocks_used"] = torch.tensor([leader.allocator.num_used])
    out["steps"] = torch.tensor([leader.stats.steps])
    out["steps_not_waited"] = torch.tensor([leader.stats.steps_not_waited])
    leader.close()
    return out
