"""Pipeline parallel, unit tier (one process): ownership from module trees, lazy remote values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncpp.pp import pull_format as fmt
from asyncpp.pp import remote
from asyncpp.pp.merge import NOT_HERE
from asyncpp.pp.ownership import LOCAL, Ownership, report
from asyncpp.pp.remote import Lazy, RemoteValue, RemoteValueError

# --- ownership ----------------------------------------------------------------------------------


class PPMissingLayer(nn.Identity):
    """Named like vLLM's placeholder for a layer another stage holds."""


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Linear(4, 4)


class Stage(nn.Module):
    """A 4-layer model as one of two pipeline stages loads it."""

    def __init__(self, stage: int):
        super().__init__()
        self.embed = nn.Embedding(8, 4) if stage == 0 else PPMissingLayer()
        self.layers = nn.ModuleList(
            [Layer() if (i < 2) == (stage == 0) else PPMissingLayer() for i in range(4)]
        )
        self.norm = nn.LayerNorm(4) if stage == 1 else PPMissingLayer()
        self.logits_processor = nn.Identity()  # built on every stage, run on the last


def test_ownership_from_the_union_of_loaded_trees():
    """The fallback when no full copy could be grafted: the stages' trees differ."""
    reports = [report(Stage(s).named_modules()) for s in range(2)]
    own = Ownership.from_reports(reports, union=True)
    idx = {p: i for i, p in enumerate(own.paths)}
    assert own.owners[idx["embed"]] == 0
    assert own.owners[idx["layers.0"]] == own.owners[idx["layers.1.mlp"]] == 0
    assert own.owners[idx["layers.2"]] == own.owners[idx["layers.3.attn"]] == 1
    assert own.owners[idx["norm"]] == 1
    assert own.owners[idx["logits_processor"]] == 1  # claimed by the last stage
    assert own.owners[idx[""]] == own.owners[idx["layers"]] == LOCAL
    # every path of the full model resolves, with the real module's type, the same on every rank
    types = dict(own.entries)
    assert types["layers.3"] == "Layer" and types["embed"] == "Embedding" and "layers.3.attn" in types
    assert Ownership.from_reports(reports, union=True).entries == own.entries
    # a parent always comes before its children (the tree is built in index order)
    for i, p in enumerate(own.paths):
        if p:
            assert idx[p.rpartition(".")[0]] < i


class BackendStage(nn.Module):
    """A stage of vLLM's Transformers backend: the modules of the pipeline plan (embedding, layers,
    final norm) split, a tied embedding built on the first and the last stage, and a rotary
    embedding outside the plan built (and run) on every stage."""

    def __init__(self, stage: int):
        super().__init__()
        self.embed = nn.Embedding(8, 4)  # tied to the head: on both stages, run on the first
        self.layers = nn.ModuleList([Layer() if i == stage else PPMissingLayer() for i in range(2)])
        self.norm = nn.LayerNorm(4) if stage == 1 else PPMissingLayer()
        self.rotary = nn.Linear(1, 2)


def test_ownership_where_the_model_says_which_modules_it_splits():
    reports = [report(BackendStage(s).named_modules()) for s in range(2)]
    for split, rotary in ((None, 1), (("embed", "layers", "norm"), LOCAL)):
        own = Ownership.from_reports(reports, union=True, split=split)
        idx = {p: i for i, p in enumerate(own.paths)}
        assert own.owners[idx["embed"]] == 0  # built on both, run on the first either way
        assert (
            own.owners[idx["layers.0"]] == 0 and own.owners[idx["layers.1"]] == own.owners[idx["norm"]] == 1
        )
        # outside the split modules: every stage serves its own (else the stage after the norm)
        assert own.owners[idx["rotary"]] == rotary


def test_report_marks_stubs_and_their_children_not_real():
    rep = {p: real for p, _, real in report(Stage(0).named_modules())}
    assert rep["layers.0.attn"] and not rep["layers.2"] and not rep["norm"]


# --- lazy remote values ----------------------------------------------------------------------------


class _Store(remote.Resolver):
    """The values a stage could pull, as the transport would deliver them."""

    def __init__(self, stage: int, values: dict[str, torch.Tensor]):
        self._stage, self.values, self.pulls, self.rounds = stage, values, [], []

    def stage(self) -> int:
        return self._stage

    def available(self, leaf: RemoteValue) -> bool:
        return leaf.owner < self._stage

    def fetch(self, leaf: RemoteValue, select: tuple = ()):
        self.pulls.append(leaf.where if not select else (leaf.where, select))
        return fmt.apply_selection(self.values[leaf.where], select)

    def fetch_all(self, plan):
        self.rounds.append(len(plan))  # one round: every pull of the plan is sent, then waited for
        return super().fetch_all(plan)


@pytest.fixture
def store():
    h = torch.arange(12.0).reshape(3, 4)
    s = _Store(1, {"layers.0.output": h, "layers.3.output": h * 10})
    remote.set_resolver(s)
    yield s
    remote.set_resolver(None)


def test_remote_value_is_lazy_until_used(store):
    up = RemoteValue(0, 7, 9, 0, 0, "layers.0.output")
    y = (up[1:] * 2 + 1).sum(-1)  # indexing, arithmetic, a method: all lazy
    z = torch.softmax(up, dim=-1)  # a torch function: lazy
    assert isinstance(y, Lazy) and isinstance(z, Lazy) and store.pulls == []
    assert torch.equal(y.force(), (store.values["layers.0.output"][1:] * 2 + 1).sum(-1))
    assert store.pulls == [("layers.0.output", (("index", slice(1, None)),))]  # the rows used only
    assert torch.allclose(z.force(), torch.softmax(store.values["layers.0.output"], -1))
    assert store.pulls[1:] == ["layers.0.output"]  # the whole value, for the use that needs it
    assert up.shape == (3, 4) and torch.equal(up[0].force(), store.values["layers.0.output"][0])
    assert len(store.pulls) == 2  # then kept: metadata and later selections use it here


def test_inplace_edit_of_a_real_tensor_with_an_upstream_value_pulls_it(store):
    out = torch.ones(3, 4)
    out += RemoteValue(0, 7, 9, 0, 0, "layers.0.output")
    assert torch.equal(out, 1 + store.values["layers.0.output"])


def test_downstream_value_cannot_be_used_synchronously(store):
    down = RemoteValue(2, 7, 9, 0, 0, "layers.3.output")
    with pytest.raises(RemoteValueError, match=r"layers\.3\.output is owned by stage 2.*await"):
        bool(down.sum() > 0)
    with pytest.raises(RemoteValueError, match="await"):
        torch.ones(3, 4).add_(down)
    down[0] = 5  # an edit of a remote value is absorbed: its owner makes it


def test_await_of_a_lazy_value_yields_a_pull_trap(store):
    lazy = RemoteValue(2, 7, 9, 0, 0, "layers.3.output") + 1

    async def block():
        return await lazy

    co = block()
    trap = co.send(None)
    assert trap.TRAP == remote.PULL and trap.value is lazy
    with pytest.raises(StopIteration) as stop:
        co.send("value")
    assert stop.value.value == "value"


def test_results_keep_what_this_stage_holds(store):
    from asyncpp.pp.stage import StageSession

    up = RemoteValue(0, 7, 9, 0, 0, "layers.0.output")
    down = RemoteValue(2, 7, 9, 0, 0, "layers.3.output")
    session = object.__new__(StageSession)  # only its result() is exercised: no kernel needed
    session._stage = 1
    local = torch.ones(3, 4)  # a value this stage holds
    got = session.result(
        {"up": up, "scaled": up * 2, "with_local": up + local, "down": down, "mixed": up + down, "n": 3}
    )
    assert got["up"] is NOT_HERE and got["scaled"] is NOT_HERE  # the owner of `up` returns them
    assert torch.equal(got["with_local"], store.values["layers.0.output"] + 1)  # only here: computed
    assert got["down"] is NOT_HERE and got["mixed"] is NOT_HERE and got["n"] == 3
    assert store.pulls == ["layers.0.output"]


def test_unpacking_a_remote_value_stays_lazy(store):
    down = RemoteValue(2, 7, 9, 0, 0, "layers.3.output")  # downstream: cannot be pulled here
    mlp_out, residual = down  # how vLLM layer outputs are usually taken apart
    assert isinstance(mlp_out, Lazy) and isinstance(residual, Lazy) and store.pulls == []
    with pytest.raises(RemoteValueError, match="await"):
        list(down)  # any other iteration needs the data
    up = RemoteValue(0, 7, 9, 0, 0, "layers.0.output")
    first, second, third = up
    assert torch.equal(third.force(), store.values["layers.0.output"][2])


def test_a_selection_forced_at_once_is_pulled_once_and_not_recomputed(store):
    up = RemoteValue(0, 7, 9, 0, 0, "layers.0.output")
    row = up[0][-1]
    assert torch.equal(row.force(), store.values["layers.0.output"][0][-1])
    assert store.pulls == [("layers.0.output", (("index", 0), ("index", -1)))]  # nothing else


def test_values_forced_together_are_pulled_in_one_round(store):
    a = RemoteValue(0, 7, 9, 0, 0, "layers.0.output")
    b = RemoteValue(0, 7, 10, 0, 0, "layers.3.output")
    both = torch.stack([a[0], b[-1]])  # two selections, of two remote values
    assert torch.equal(
        both.force(), torch.stack([store.values["layers.0.output"][0], store.values["layers.3.output"][-1]])
    )
    assert store.rounds == [2] and len(store.pulls) == 2
