"""Medha: slack-aware scheduling with adaptive chunking and prefill-prefill batching on colocated replicas."""

from .strategy import MedhaStrategy

__all__ = ["MedhaStrategy"]
