"""Pipeline parallel, unit tier (one process): grafting the full architecture under a stage's
placeholders, and ownership from the grafted trees, on real torch modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncpp.pp.graft import graft
from asyncpp.pp.ownership import LOCAL, Ownership, TreeMismatch, report


class PPMissingLayer(nn.Identity):
    """Named like vLLM's placeholder for a layer another stage holds."""


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


class Model(nn.Module):
    """A 4-layer model as one stage of a pipeline of ``stages`` builds it (``stages=1``: all of
    it). Like vLLM's models, the logits processor only exists on the last stage (no placeholder)."""

    def __init__(self, stage: int = 0, stages: int = 1):
        super().__init__()
        first, last = stage == 0, stage == stages - 1
        per = 4 // stages
        self.embed = nn.Embedding(8, 4) if first else PPMissingLayer()
        self.layers = nn.ModuleList(
            [Layer() if stage * per <= i < (stage + 1) * per else PPMissingLayer() for i in range(4)]
        )
        self.norm = nn.LayerNorm(4) if last else PPMissingLayer()
        if last:
            self.logits_processor = nn.Identity()
        self.tail = nn.Identity()  # after the logits processor in the full model

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            if not isinstance(layer, PPMissingLayer):
                h = layer.mlp(layer.attn(h))
        return self.tail(self.norm(h))


def meta_full() -> nn.Module:
    with torch.device("meta"):
        return Model()


def paths(model: nn.Module) -> list[str]:
    return [p for p, _ in model.named_modules()]


def grafted_stages(stages: int) -> list[tuple[nn.Module, object]]:
    out = []
    for s in range(stages):
        model = Model(s, stages)
        out.append((model, graft(model, meta_full())))
    return out


@pytest.mark.parametrize("stages", [2, 4])
def test_every_stage_gets_the_full_models_paths_in_its_order(stages):
    full = Model()
    for model, done in grafted_stages(stages):
        assert paths(model) == paths(full)
        types = {p: t for p, t, _ in report(model.named_modules(), done)}
        assert types == {p: type(m).__name__ for p, m in full.named_modules()}


def test_placeholders_stay_and_hold_the_meta_copys_children():
    model = Model(1, 2)
    stub, real = model.layers[0], model.layers[2]
    full = meta_full()
    done = graft(model, full)
    assert model.layers[0] is stub and isinstance(stub, PPMissingLayer)
    assert stub.attn is full.layers[0].attn and stub.attn.weight.is_meta
    assert model.layers[2] is real and not real.attn.weight.is_meta  # the stage's own layer untouched
    assert done.added == [] and done.types["layers.0"] == "Layer" and done.types["embed"] == "Embedding"
    # the stages' forwards never call a placeholder's children: they still compute, meeting no meta
    first = Model(0, 2)
    graft(first, meta_full())
    h = model(first(torch.tensor([1, 2])))
    assert h.shape == (2, 4) and not h.is_meta


def test_a_module_missing_without_placeholder_is_added_in_the_full_order():
    model = Model(0, 2)
    assert "logits_processor" not in paths(model)
    done = graft(model, meta_full())
    assert done.added == ["logits_processor"]
    assert [n for n, _ in model.named_children()] == ["embed", "layers", "norm", "logits_processor", "tail"]
    real = {p: r for p, _, r in report(model.named_modules(), done)}
    assert real["layers.0.mlp.0"] and real["tail"]
    assert not real["logits_processor"] and not real["layers.2"] and not real["layers.3.mlp.2"]


def test_ownership_from_grafted_trees():
    stages = grafted_stages(2)
    own = Ownership.from_reports([report(m.named_modules(), d) for m, d in stages])
    idx = {p: i for i, p in enumerate(own.paths)}
    assert own.paths == paths(Model())
    assert own.owners[idx["embed"]] == own.owners[idx["layers.1.mlp.2"]] == 0
    assert own.owners[idx["layers.2"]] == own.owners[idx["norm"]] == 1
    assert own.owners[idx["logits_processor"]] == 1
    assert own.owners[idx[""]] == own.owners[idx["layers"]] == LOCAL
    assert own.owners[idx["tail"]] == 1  # built everywhere, after the last stage's layers
    assert dict(own.entries)["layers.3"] == "Layer"


class Replicated(nn.Module):
    """One stage of a model that, like vLLM's Gemma-2, GPT-2, Mixtral and Qwen2-MoE, builds its
    embeddings and final norm on every stage but runs them on the first and the last only."""

    def __init__(self, stage: int, stages: int):
        super().__init__()
        per = 6 // stages
        self.embed = nn.Embedding(8, 4)
        self.pos = nn.Embedding(8, 4)
        self.layers = nn.ModuleList(
            [Layer() if stage * per <= i < (stage + 1) * per else PPMissingLayer() for i in range(6)]
        )
        self.norm = nn.LayerNorm(4)
        self.logits_processor = nn.Identity()


@pytest.mark.parametrize("stages", [2, 3])
def test_modules_built_on_every_stage_are_owned_by_the_stage_that_runs_them(stages):
    reports = [report(Replicated(s, stages).named_modules()) for s in range(stages)]
    own = Ownership.from_reports(reports, union=True)
    idx = {p: i for i, p in enumerate(own.paths)}
    assert own.owners[idx["embed"]] == own.owners[idx["pos"]] == 0
    assert own.owners[idx["norm"]] == own.owners[idx["logits_processor"]] == stages - 1
    assert own.owners[idx["layers.5.mlp.2"]] == stages - 1
    assert own.owners[idx[""]] == own.owners[idx["layers"]] == LOCAL


def test_stages_with_different_trees_name_the_first_difference():
    grafted = [report(m.named_modules(), d) for m, d in grafted_stages(2)]
    plain = report(Model(1, 2).named_modules())  # not grafted: placeholders, no children
    with pytest.raises(
        TreeMismatch, match=r"index 1 stage 0 has 'embed' \(Embedding\), stage 1 has 'embed' \(PPM"
    ):
        Ownership.from_reports([grafted[0], plain])
    skipped = grafted[1][:3] + grafted[1][4:]
    with pytest.raises(
        TreeMismatch, match=r"index 3 stage 0 has 'layers\.0' \(Layer\), stage 1 has 'layers\.0\.attn'"
    ):
        Ownership.from_reports([grafted[0], skipped])
    with pytest.raises(TreeMismatch, match=r"only stage 0 has"):
        Ownership.from_reports([grafted[0], grafted[1][:-3]])


def test_a_different_architecture_is_refused_before_anything_changes():
    class Longer(nn.Module):  # one more layer: the stage's layer list would have to change
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.layers = nn.ModuleList([Layer() for _ in range(5)])

    model = Model(1, 2)
    before = paths(model)
    with pytest.raises(LookupError, match="sequence"):
        graft(model, Longer())
    assert paths(model) == before


def test_grafting_twice_is_refused():
    model = Model(1, 2)
    graft(model, meta_full())
    with pytest.raises(LookupError, match="grafted twice"):
        graft(model, meta_full())
