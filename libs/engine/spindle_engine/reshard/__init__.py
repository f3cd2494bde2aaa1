"""Seesaw's dynamic re-sharding (seed 004, §4.1, Fig. 7): one set of processes holds the model as one parallel
configuration for prefill (`PPa[xTPb]`) and another for decode (`TPc`), weights reloaded from one shared host copy,
the prompt's KV moved between them through a shared host-memory KV tier in the HND layout."""

from .config import Parallel, ReshardPlan
from .host_kv import HostKV
from .host_weights import HostWeights

__all__ = ["HostKV", "HostWeights", "Parallel", "ReshardPlan"]
