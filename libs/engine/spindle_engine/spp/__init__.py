"""Sequence pipeline parallelism (Medha §3.3): an engine split into layer-range stages on consecutive ranks, where
consecutive prefill chunks of one request flow through the stages back to back (leader.py, stage.py, wire.py)."""

from .leader import SPPLeaderEngine, load_stage, spp_engine_config
from .stage import PipelineLayout, PipelineStage, serve_stage, stage_layers
from .wire import SPPError, StageStep

__all__ = [
    "PipelineLayout",
    "PipelineStage",
    "SPPError",
    "SPPLeaderEngine",
    "StageStep",
    "load_stage",
    "serve_stage",
    "spp_engine_config",
    "stage_layers",
]
