from .engine import LocalEngine

__all__ = ["LocalEngine"]
