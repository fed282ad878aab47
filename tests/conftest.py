"""Shared fixtures: real torch modules and the embedded tiny Llama (built once per session).

The tests come in tiers, one folder each, and each test is marked with its folder's name:
``unit`` (the kernel, the wire formats, merge, ownership and graft, driven directly), ``local``
(LocalEngine on real torch and Hugging Face models), ``vllm`` (real vLLM engines and servers on
CPU), ``pp`` (pipeline parallel: spawned gloo ranks, and vLLM engines, which are also marked
``vllm``) and ``multinode`` (vLLM engines spanning two node processes on this host, also ``vllm``). ``pytest -m "not vllm"`` is the quick loop; ``pytest`` runs everything.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import asyncpp


class Twice(nn.Module):
    """Calls its shared ``inner`` module twice per forward: two occurrences of one location."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.inner(torch.relu(self.inner(x))))


class Pair(nn.Module):
    """Returns a tuple: (hidden, aux)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, scale: float = 1.0):
        h = self.lin(x) * scale
        return h, h.sum(-1)


class TupleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.pair = Pair()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h, aux = self.pair(x, scale=2.0)
        return self.head(h) + aux[:, None]


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)]).eval()


@pytest.fixture
def twice():
    torch.manual_seed(0)
    return Twice().eval()


@pytest.fixture
def tuplenet():
    torch.manual_seed(0)
    return TupleNet().eval()


@pytest.fixture(scope="session")
def tiny():
    from asyncpp.models import load_tiny

    model, tok = load_tiny()
    return model, tok


@pytest.fixture(scope="session")
def engine(tiny):
    model, tok = tiny
    eng = asyncpp.LocalEngine(model, tok)
    yield eng
    eng.close()


TIERS = ("unit", "local", "vllm", "pp", "multinode")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.fspath)).parent.name
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
