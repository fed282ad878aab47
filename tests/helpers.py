"""Small helpers shared by the tests."""

from __future__ import annotations

import asyncpp


def run(target, *invokes, **kw):
    """Run one sync trace; each invoke is (input, block, *args). Returns the handles."""
    with asyncpp.trace(target, **kw) as t:
        handles = [t.invoke(*inv) for inv in invokes]
    return handles


def steer_hook(vec):
    """A plain PyTorch forward hook adding ``vec`` at the last position: the reference edit."""

    def hook(mod, args, out):
        out = out.clone()
        out[:, -1] += vec
        return out

    return hook
