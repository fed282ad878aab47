"""The location tree a block receives (``m``), its awaitable locations and generation steps."""
