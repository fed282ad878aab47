"""Tiny models the project builds itself (no downloads), for demos, tests and benchmarks."""

from .architectures import ARCHITECTURES, build_tiny, tiny_checkpoint
from .tiny import TINY_CONFIG, load_tiny, tiny_model_dir

__all__ = ["ARCHITECTURES", "TINY_CONFIG", "build_tiny", "load_tiny", "tiny_checkpoint", "tiny_model_dir"]
