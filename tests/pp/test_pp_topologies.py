"""Pipeline parallel, engine tier: three stages against one, and TP=2 x PP=2 against TP=2, each
engine in its own processes, running the same blocks. Parity: argmax equal, cosine >= 0.9999.

Each class holds its two engines for its own tests only (class-scoped), so at most two engines
run at once. Eager engines only: test_pp_engine.py runs PP=2 on eager and compiled engines, and
the topologies here add nothing mode-specific (the tap operator is the same on every stage), while
compiled PP=3 and TP=2 x PP=2 engines would add minutes of compilation on a fresh machine.
"""

from __future__ import annotations

import pytest
import torch
from test_pp_engine import (
    check_concurrent_invokes_of_different_lengths,
    check_full_tree_on_every_stage,
    check_stage_local_write,
    cross_stage_rmw,
    generate_with_cross_stage_write,
    read_logits_and_hidden,
    run,
    same,
    same_logits,
)

import asyncpp

pytestmark = pytest.mark.vllm  # real vLLM engines (besides the pp tier)

pytest.importorskip("vllm")


async def last_from_first(m):
    """At PP=3: a write on the last stage (layer 3) computed from the first stage's value (layer 0),
    skipping the middle stage."""
    first = await m.model.layers[0].output
    last = await m.model.layers[3].output
    last[0][:] = last[0] - 0.5 * (first[0] + first[1])
    return (await m.logits).clone()


def engine(**options):
    return asyncpp.VllmEngine(dtype="float32", **options)


def engine_pair(first: dict, second: dict):
    """Two engines, started one after the other, both closed after the class's tests."""
    a = engine(**first)
    try:
        b = engine(**second)
    except BaseException:
        a.close()
        raise
    yield a, b
    b.close()
    a.close()


class SplitAgainstReference:
    """The comparisons every split topology runs against its reference engine; a subclass gives
    the class-scoped ``engines`` fixture (reference, split), ``ranks`` and ``new_tokens``."""

    ranks: int
    new_tokens: int

    def test_every_rank_has_the_reference_tree(self, engines):
        check_full_tree_on_every_stage(*engines, self.ranks)

    def test_logits_and_hidden_states(self, engines):
        ref, split = engines
        a, b = run(ref, read_logits_and_hidden).result, run(split, read_logits_and_hidden).result
        same(a["early"], b["early"])
        same(a["late"], b["late"])
        same_logits(a["logits"], b["logits"])

    def test_stage_local_write(self, engines):
        check_stage_local_write(*engines)

    def test_cross_stage_read_modify_write(self, engines):
        ref, split = engines
        same_logits(run(ref, cross_stage_rmw).result, run(split, cross_stage_rmw).result)

    def test_concurrent_invokes_of_different_lengths(self, engines):
        check_concurrent_invokes_of_different_lengths(*engines)

    def test_generation_with_a_cross_stage_write_every_step(self, engines):
        ref, split = engines
        a = run(ref, generate_with_cross_stage_write, max_new_tokens=self.new_tokens)
        b = run(split, generate_with_cross_stage_write, max_new_tokens=self.new_tokens)
        assert a.tokens.tolist() == b.tokens.tolist()


class TestThreeStages(SplitAgainstReference):
    ranks, new_tokens = 3, 6

    @pytest.fixture(scope="class")
    def engines(self):
        yield from engine_pair({}, {"pipeline_parallel_size": 3})

    def test_last_stage_write_from_first_stage_value(self, engines):
        one, three = engines
        a, b = run(one, last_from_first).result, run(three, last_from_first).result
        same_logits(a, b)
        plain = run(one, read_logits_and_hidden).result["logits"]
        assert not torch.allclose(plain, a)


class TestTensorAndPipeline(SplitAgainstReference):
    ranks, new_tokens = 4, 5

    @pytest.fixture(scope="class")
    def engines(self):
        yield from engine_pair(
            {"tensor_parallel_size": 2}, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}
        )
