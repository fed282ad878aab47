"""Fixtures of the local tier."""

from __future__ import annotations

import pytest

import asyncpp
from asyncpp.models.architectures import ARCHITECTURES, build_tiny


@pytest.fixture(scope="session")
def engines():
    """A local engine on the tiny model of every architecture (shared by the tier's modules)."""
    built = {arch: asyncpp.LocalEngine(build_tiny(arch)) for arch in ARCHITECTURES}
    yield built
    for eng in built.values():
        eng.close()
