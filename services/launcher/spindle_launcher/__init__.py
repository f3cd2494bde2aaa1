"""`spindle up`: the whole Spindle stack on one machine, supervised (see README.md)."""

from .plan import Runtime, ServiceSpec, StackConfig, build_plan
from .stack import Stack, StackError, StackInterrupted

__all__ = ["Runtime", "ServiceSpec", "Stack", "StackConfig", "StackError", "StackInterrupted", "build_plan"]
