"""Tiny models the project builds itself (no downloads), for demos, tests and benchmarks."""

from .tiny import TINY_CONFIG, load_tiny, tiny_model_dir

__all__ = ["TINY_CONFIG", "load_tiny", "tiny_model_dir"]
