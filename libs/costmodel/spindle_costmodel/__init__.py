"""Spindle's cost model: seconds and bytes for any Llama shape on any GPU cluster under TP / PP / SP / KVP /
chunking, roofline terms at fitted efficiencies. Pure (numpy at most); the simulator and every strategy use it.

    from spindle_costmodel import CostModel, Parallelism, get_hardware, get_model
    cm = CostModel(get_model("llama3-8b"), get_hardware("a100-80g"))
    cm.prefill(100_000, par=Parallelism(sp=8)).total_s
"""

from pathlib import Path

from .breakdown import Breakdown, OpCost
from .costs import Chunk, CostModel
from .hardware import HARDWARE, Efficiency, Hardware, Link, get_hardware, hardware_names
from .memory import MemoryPlan, OutOfMemory
from .model import MODELS, ModelShape, from_hf_config, get_model
from .parallel import Parallelism

# numbers transcribed from the five papers, with their sources: what the calibration tests hold the model to
PAPER_FIGURES = Path(__file__).parent / "data" / "paper_figures.json"

__all__ = [
    "HARDWARE",
    "MODELS",
    "PAPER_FIGURES",
    "Breakdown",
    "Chunk",
    "CostModel",
    "Efficiency",
    "Hardware",
    "Link",
    "MemoryPlan",
    "ModelShape",
    "OpCost",
    "OutOfMemory",
    "Parallelism",
    "from_hf_config",
    "get_hardware",
    "get_model",
    "hardware_names",
]
