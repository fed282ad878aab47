"""The vLLM engine (imports vLLM only when used): ``asyncpp.VllmEngine``."""

from .engine import VllmEngine
from .node import run_node

__all__ = ["VllmEngine", "run_node"]
