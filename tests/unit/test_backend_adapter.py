"""The adapter that serves a vLLM Transformers-backend module's ``[1, tokens, ...]`` values as
``[tokens, ...]`` (the form the kernel narrows per request) and puts edits back (no engine needed)."""

from __future__ import annotations

import torch

from asyncpp.engines.vllm.backend import DropBatchDim, DropBatchDimOfCall


def _five() -> int:
    return 5  # the step's tokens


def test_values_are_served_as_views_without_the_batch_dimension():
    held = (torch.randn(1, 5, 4), None, [torch.randn(1, 5, 2)], {"w": torch.randn(3, 5)})
    seen = DropBatchDim(_five).to_blocks(held)
    assert seen[0].shape == (5, 4) and seen[0].data_ptr() == held[0].data_ptr()
    assert seen[1] is None and seen[2][0].shape == (5, 2)
    assert seen[3]["w"] is held[3]["w"]  # (no batch dimension of one: as it is)
    before = held[0].clone()
    seen[0][2] += 1.0  # an in-place edit of a request's rows lands in the model's tensor
    assert torch.equal(held[0][0, 2], before[0, 2] + 1.0) and torch.equal(held[0][0, 3], before[0, 3])
    back = DropBatchDim(_five).to_model(seen, held)  # nothing replaced: the model's own values
    assert back[0] is held[0] and back[2][0] is held[2][0] and back[3]["w"] is held[3]["w"]


def test_a_replacement_gets_the_batch_dimension_back():
    held = torch.randn(1, 5, 4)
    new = torch.zeros(5, 4)
    back = DropBatchDim(_five).to_model(new, held)
    assert back.shape == (1, 5, 4) and back.data_ptr() == new.data_ptr()
    pair = (torch.randn(1, 5, 4), torch.randn(1, 5, 4))
    back = DropBatchDim(_five).to_model((new, DropBatchDim(_five).to_blocks(pair)[1]), pair)
    assert back[0].shape == (1, 5, 4) and torch.equal(back[0], torch.zeros(1, 5, 4))
    assert back[1] is pair[1]


def test_a_call_is_adapted_in_its_arguments_and_keywords():
    x, pos = torch.randn(1, 5, 4), torch.arange(5)[None]
    held = ((x,), {"position_ids": pos, "use_cache": False, "cos_sin": (torch.randn(1, 5, 2),)})
    args, kwargs = DropBatchDimOfCall(_five).to_blocks(held)
    assert args[0].shape == (5, 4) and kwargs["position_ids"].tolist() == [0, 1, 2, 3, 4]
    assert kwargs["use_cache"] is False and kwargs["cos_sin"][0].shape == (5, 2)
    new_args, new_kwargs = DropBatchDimOfCall(_five).to_model(((args[0] * 2,), kwargs), held)
    assert new_args[0].shape == (1, 5, 4) and torch.equal(new_args[0], x * 2)
    assert new_kwargs["position_ids"] is pos and new_kwargs["use_cache"] is False


def test_values_a_module_takes_flat_are_left_as_they_are():
    """A mixture of experts' router gets the tokens flat, [tokens, experts]: with one token in the
    step that is [1, experts], which must not lose its token dimension."""
    one = DropBatchDim(lambda: 1)
    router = torch.randn(1, 4)
    assert one.to_blocks(router) is router and one.to_model(router, router) is router
    stream = torch.randn(1, 1, 8)  # [1, tokens, hidden] with one token: the batch dimension goes
    assert one.to_blocks(stream).shape == (1, 8)
    assert DropBatchDim(_five).to_blocks(torch.randn(5, 4)).shape == (5, 4)  # flat, five tokens


class TransformersForCausalLM(torch.nn.Module):
    """Laid out as vLLM's wrapper of a Hugging Face model (the base model as ``model``)."""

    __module__ = "vllm.model_executor.models.transformers.causal"

    def __init__(self, hf: torch.nn.Module):
        super().__init__()
        self.model = hf.gpt_neox
        self.lm_head = hf.lm_head


def test_the_modules_split_across_pipeline_stages_are_the_pipeline_plans():
    from asyncpp.engines.vllm.backend import split_paths
    from asyncpp.models import build_tiny

    hf = build_tiny("gpt_neox")
    assert split_paths(hf) is None  # not a backend model: every module follows vLLM's own classes
    model = TransformersForCausalLM(hf)
    assert split_paths(model) == (
        "model.embed_in",
        "model.emb_dropout",
        "model.layers",
        "model.final_layer_norm",
        "lm_head",
    )
    # without a plan, vLLM splits the decoder's children that hold parameters
    model.model._pp_plan, model.model.config.base_model_pp_plan = None, None
    assert split_paths(model) == ("model.embed_in", "model.layers", "model.final_layer_norm", "lm_head")
