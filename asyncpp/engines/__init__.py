"""Engines run models with blocks attached: local torch models, vLLM (loaded lazily)."""
