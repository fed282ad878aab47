"""Small helpers shared by the tests."""

from __future__ import annotations

import asyncpp


def run(target, *invokes, **kw):
    """Run one sync trace; each invoke is (input, block, *args). Returns the handles."""
    with asyncpp.trace(target, **kw) as t:
        handles = [t.invoke(*inv) for inv in invokes]
    return handles
