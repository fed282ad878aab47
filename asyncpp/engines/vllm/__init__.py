"""The vLLM engine (imports vLLM only when used): ``asyncpp.VllmEngine``."""

from .engine import VllmEngine

__all__ = ["VllmEngine"]
