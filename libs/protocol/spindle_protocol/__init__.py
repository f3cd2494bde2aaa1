"""Spindle control plane: subjects, typed messages, tensor headers and NATS helpers."""

from . import subjects
from .bus import Bus
from .codec import ProtocolError, decode, encode
from .messages import *  # noqa: F403
from .tensor_header import check_header, header_for

__all__ = ["Bus", "ProtocolError", "check_header", "decode", "encode", "header_for", "subjects"]
