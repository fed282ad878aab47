"""Tensor-parallel values made whole and split back (engines/vllm/tensor_parallel.py), rank by rank,
without an engine: each rank's slice is cut from a whole tensor as vLLM's linears and attention
layers cut it, and every rank's all-gather returns all of them, as a real group's does."""

from __future__ import annotations

import pytest
import torch

from asyncpp.engines.vllm.tensor_parallel import Arguments, Elements, Sharding


class Group:
    """The ranks' slices of one value: ``all_gather`` gives them all, in rank order."""

    def __init__(self, slices: list[torch.Tensor]):
        self.slices = slices

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        assert any(torch.equal(t, s) for s in self.slices)  # (a rank's own slice)
        return torch.cat(self.slices, dim=dim)


def _qkv(tokens: int, heads: int, kv_heads: int, size: int, tp: int):
    """A fused q-k-v value, whole (q, then k, then v), and each rank's slice: its q heads, and its
    key/value head (heads shared by ``tp // kv_heads`` ranks where the group is larger)."""
    q = torch.randn(tokens, heads * size)
    k, v = torch.randn(tokens, kv_heads * size), torch.randn(tokens, kv_heads * size)
    replicas = max(1, tp // kv_heads)
    local_kv = max(1, kv_heads // tp)
    slices = []
    for r in range(tp):
        qs = q.narrow(-1, r * heads // tp * size, heads // tp * size)
        kv_at = r // replicas * local_kv * size
        slices.append(
            torch.cat([qs, k.narrow(-1, kv_at, local_kv * size), v.narrow(-1, kv_at, local_kv * size)], -1)
        )
    sizes = [heads // tp * size, local_kv * size, local_kv * size]
    return torch.cat([q, k, v], -1), slices, sizes, [1, replicas, replicas]


@pytest.mark.parametrize(("tp", "kv_heads"), [(2, 2), (4, 2), (4, 1), (2, 4)])
def test_a_fused_qkv_is_whole_on_every_rank_and_an_edit_goes_back_to_each(tp, kv_heads):
    whole, slices, sizes, replicas = _qkv(3, 4, kv_heads, 2, tp)
    group = Group(slices)
    edited = whole * 2.0
    for rank in range(tp):
        s = Sharding(sizes, tp, rank, group, replicas)
        assert torch.equal(s.to_blocks(slices[rank]), whole)
        local = slices[rank].clone()
        back = s.to_model(edited, local)
        assert back is local and torch.equal(local, slices[rank] * 2.0)  # in place, this rank's part


def test_heads_with_a_dimension_of_their_own_are_gathered_by_head():
    """``[tokens, heads, head_size]`` (a norm of each head), one head per rank: whole by heads,
    not along the head size."""
    whole = torch.randn(3, 2, 4)
    slices = [whole[:, :1], whole[:, 1:]]
    group = Group([t.flatten(-2) for t in slices])
    for rank in range(2):
        s = Sharding([4], 2, rank, group, None, head_size=4)
        assert torch.equal(s.to_blocks(slices[rank]), whole)
        local = slices[rank].clone()
        assert s.to_model(whole + 1.0, local) is local and torch.equal(local, slices[rank] + 1.0)


def test_a_value_the_model_already_made_whole_is_served_as_it_is():
    s = Sharding([4], 2, 0, Group([]))
    whole = torch.randn(3, 8)  # not this rank's width: no gather
    assert s.to_blocks(whole) is whole and s.to_model(whole, whole) is whole
    assert s.to_blocks(None) is None


def test_arguments_and_elements_gather_the_split_ones_only():
    whole_q, whole_k = torch.randn(3, 4), torch.randn(3, 4)
    q = Sharding([2], 2, 0, Group([whole_q[:, :2], whole_q[:, 2:]]))
    k = Sharding([2], 2, 0, Group([whole_k[:, :2], whole_k[:, 2:]]))
    positions = torch.arange(3)
    call = ((positions, whole_q[:, :2].clone()), {"key": whole_k[:, :2].clone()})
    adapter = Arguments({1: q}, {"key": k})
    (p, qq), kw = adapter.to_blocks(call)
    assert p is positions and torch.equal(qq, whole_q) and torch.equal(kw["key"], whole_k)
    (_, q_local), kw_local = adapter.to_model(((p, qq * 0), {"key": kw["key"] * 0}), call)
    assert q_local is call[0][1] and not q_local.any() and not kw_local["key"].any()
    out = Elements({0: q, 1: k}).to_blocks((whole_q[:, :2], whole_k[:, :2]))
    assert torch.equal(out[0], whole_q) and torch.equal(out[1], whole_k)
