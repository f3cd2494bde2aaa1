"""Spindle decode instance (`python -m spindle_decode`)."""

from .instance import DecodeInstance

__all__ = ["DecodeInstance"]
