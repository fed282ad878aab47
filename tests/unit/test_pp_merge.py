"""Unit tests for merging per-stage results of a block on a pipeline-parallel engine."""

from __future__ import annotations

import math
import pickle
import warnings
from collections import OrderedDict, defaultdict, namedtuple
from typing import NamedTuple

import cloudpickle
import pytest
import torch

from asyncpp.pp.merge import NOT_HERE, RankDivergenceWarning, _NotHere, merge

Point = namedtuple("Point", ["x", "y"])


class Out(NamedTuple):
    hidden: torch.Tensor
    logits: torch.Tensor


def t(*vals, dtype=torch.float32):
    return torch.tensor(vals, dtype=dtype)


# ---------------------------------------------------------------- the sentinel


def test_not_here_is_a_singleton_with_a_repr():
    assert _NotHere() is NOT_HERE
    assert repr(NOT_HERE) == "<not on this rank>"


@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps], ids=["pickle", "cloudpickle"])
def test_not_here_pickles_back_to_the_singleton(dumps):
    assert pickle.loads(dumps(NOT_HERE)) is NOT_HERE
    nested = pickle.loads(dumps({"a": [NOT_HERE, 1], "b": (NOT_HERE,)}))
    assert nested["a"][0] is NOT_HERE and nested["b"][0] is NOT_HERE


def test_not_here_survives_copy():
    import copy

    assert copy.copy(NOT_HERE) is NOT_HERE
    assert copy.deepcopy([NOT_HERE])[0] is NOT_HERE


# ---------------------------------------------------------------- NOT_HERE and leaves


def test_all_not_here_gives_not_here():
    assert merge([NOT_HERE, NOT_HERE]) is NOT_HERE
    assert merge([NOT_HERE]) is NOT_HERE
    assert merge([]) is NOT_HERE


def test_not_here_loses_to_anything_real():
    x = t(1.0, 2.0)
    assert merge([NOT_HERE, x]) is x
    assert merge([x, NOT_HERE]) is x
    assert merge([NOT_HERE, None]) is None
    assert merge([0, NOT_HERE]) == 0
    assert merge([NOT_HERE, "s", NOT_HERE]) == "s"


def test_single_real_container_is_returned_as_is():
    d = {"a": t(1.0)}
    assert merge([NOT_HERE, d]) is d


def test_equal_leaves_keep_the_first_without_warning():
    a, b = t(1.0, 2.0), t(1.0, 2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert merge([a, b]) is a
        assert merge([3, 3, 3]) == 3
        assert merge(["x", "x"]) == "x"
        assert merge([None, None]) is None
        assert merge([a, a]) is a


def test_nan_equality_does_not_warn():
    nan_a, nan_b = float("nan"), float("nan")
    ta, tb = t(1.0, math.nan, math.inf), t(1.0, math.nan, math.inf)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert math.isnan(merge([nan_a, nan_b]))
        assert merge([ta, tb]) is ta
        assert merge([{"loss": nan_a}, {"loss": nan_b}])["loss"] is nan_a


def test_nan_against_number_diverges():
    with pytest.warns(RankDivergenceWarning, match=r"result"):
        assert merge([math.nan, 1.0]) == 1.0


def test_differing_tensors_warn_and_keep_the_highest_stage():
    a, b = t(1.0), t(2.0)
    with pytest.warns(RankDivergenceWarning, match=r"stages 0, 1 .*result\b.*keeping stage 1"):
        assert merge([a, b]) is b


@pytest.mark.parametrize(
    "a, b",
    [
        (t(1.0, 2.0), t(1.0, 2.0, dtype=torch.float64)),  # dtype
        (t(1.0, 2.0), t(1.0, 2.0).reshape(2, 1)),  # shape
        (t(1.0), 1.0),  # tensor against number
        (None, t(1.0)),  # None is a real value
        (t(1.0), None),
        ({"a": t(1.0)}, t(1.0)),  # containers that do not line up
        ((1, 2), (1, 2, 3)),  # tuples of different lengths
        ((1, 2), [1, 2]),  # a tuple against a list
        ([t(1.0)], {0: t(1.0)}),  # a list against a dict
    ],
)
def test_mismatches_are_divergences_not_crashes(a, b):
    with pytest.warns(RankDivergenceWarning, match=r"stages 0, 1 returned different values for result "):
        assert merge([a, b]) is b


def test_eq_that_raises_is_a_divergence():
    class Grumpy:
        def __eq__(self, other):
            raise RuntimeError("no comparing")

        __hash__ = object.__hash__

    a, b = Grumpy(), Grumpy()
    with pytest.warns(RankDivergenceWarning):
        assert merge([a, b]) is b
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert merge([a, a]) is a  # the same object needs no ==


def test_none_against_tensor_in_a_slot_warns():
    x = t(1.0)
    with pytest.warns(RankDivergenceWarning, match=r"result\['h'\]"):
        out = merge([{"h": None}, {"h": x}])
    assert out["h"] is x


# ---------------------------------------------------------------- dicts


def test_dicts_union_by_key_in_first_appearance_order():
    a, b, c = t(1.0), t(2.0), t(3.0)
    out = merge([{"b": b, "a": NOT_HERE}, {"c": c, "a": a, "b": NOT_HERE}])
    assert list(out) == ["b", "a", "c"]
    assert out["a"] is a and out["b"] is b and out["c"] is c


def test_dict_keys_all_not_here_stay_not_here():
    out = merge([{"a": NOT_HERE}, {"a": NOT_HERE, "b": 1}])
    assert out == {"a": NOT_HERE, "b": 1}


def test_dict_divergence_names_the_key():
    with pytest.warns(RankDivergenceWarning, match=r"result\['logits'\]") as rec:
        out = merge([{"logits": t(1.0), "h": t(0.0)}, {"logits": t(2.0), "h": t(0.0)}])
    assert len(rec) == 1
    assert torch.equal(out["logits"], t(2.0))


def test_ordered_dict_and_defaultdict_keep_their_type():
    od = merge([OrderedDict(a=1), OrderedDict(b=2)])
    assert type(od) is OrderedDict and list(od.items()) == [("a", 1), ("b", 2)]

    d0, d1 = defaultdict(list), defaultdict(list)
    d0["a"].append(1)
    d1["b"].append(2)
    dd = merge([d0, d1])
    assert type(dd) is defaultdict and dd.default_factory is list
    assert dict(dd) == {"a": [1], "b": [2]}


def test_mixed_dict_types_merge_as_a_plain_dict():
    out = merge([OrderedDict(a=1), {"b": 2}])
    assert type(out) is dict and out == {"a": 1, "b": 2}


# ---------------------------------------------------------------- lists and tuples


def test_lists_merge_by_position_and_longer_lists_contribute():
    a, b, c = t(1.0), t(2.0), t(3.0)
    out = merge([[a, NOT_HERE], [NOT_HERE, b, c]])
    assert type(out) is list and len(out) == 3
    assert out[0] is a and out[1] is b and out[2] is c


def test_list_divergence_names_the_position():
    with pytest.warns(RankDivergenceWarning, match=r"result\[1\]"):
        out = merge([[1, 2], [1, 5]])
    assert out == [1, 5]


def test_tuples_rebuild_elementwise():
    a, b = t(1.0), t(2.0)
    out = merge([(a, NOT_HERE), (NOT_HERE, b)])
    assert type(out) is tuple and out[0] is a and out[1] is b


def test_tuple_divergence_names_the_position():
    with pytest.warns(RankDivergenceWarning, match=r"result\[0\]"):
        out = merge([(1, NOT_HERE), (2, 3)])
    assert out == (2, 3)


def test_named_tuples_rebuild_as_their_class():
    h, lg = t(1.0), t(2.0)
    out = merge([Out(h, NOT_HERE), Out(NOT_HERE, lg)])
    assert type(out) is Out and out.hidden is h and out.logits is lg

    p = merge([Point(1, NOT_HERE), Point(NOT_HERE, 2)])
    assert type(p) is Point and p == Point(1, 2)


def test_named_tuple_divergence_names_the_field():
    with pytest.warns(RankDivergenceWarning, match=r"result\.hidden\b"):
        out = merge([Out(t(1.0), NOT_HERE), Out(t(9.0), t(2.0))])
    assert torch.equal(out.hidden, t(9.0))


def test_torch_return_types_rebuild():
    x = torch.arange(6.0).reshape(2, 3)
    full = torch.max(x, dim=1)
    out = merge([type(full)((full.values, NOT_HERE)), type(full)((NOT_HERE, full.indices))])
    assert type(out) is type(full)
    assert out.values is full.values and out.indices is full.indices
    with pytest.warns(RankDivergenceWarning, match=r"result\.indices"):
        merge([full, type(full)((full.values, full.indices + 1))])


def test_nested_dict_of_lists_of_tuples():
    a, b, c, d = t(1.0), t(2.0), t(3.0), t(4.0)
    s0 = {"layers": [(a, NOT_HERE), NOT_HERE], "early": a, "late": NOT_HERE}
    s1 = {"layers": [NOT_HERE, (c, NOT_HERE), (d,)], "late": NOT_HERE}
    s2 = {"layers": [(NOT_HERE, b), (NOT_HERE, d)], "late": {"logits": [d]}}
    out = merge([s0, s1, s2])
    assert list(out) == ["layers", "early", "late"]
    assert out["early"] is a
    assert out["late"] == {"logits": [d]}
    layers = out["layers"]
    assert len(layers) == 3
    assert layers[0][0] is a and layers[0][1] is b
    assert layers[1][0] is c and layers[1][1] is d
    assert layers[2] == (d,)


def test_nested_divergence_path_and_stages():
    s0 = {"logits": [t(0.0), t(0.0), (t(1.0), 1)]}
    s1 = {"logits": [t(0.0), NOT_HERE, (t(1.0), 1)]}
    s2 = {"logits": [NOT_HERE, t(0.0), (t(2.0), 1)]}
    with pytest.warns(RankDivergenceWarning) as rec:
        out = merge([s0, s1, s2])
    assert len(rec) == 1
    msg = str(rec[0].message)
    assert "result['logits'][2][0]" in msg
    assert "stages 0, 1, 2" in msg
    assert "stages 0, 1: tensor" in msg and "stage 2: tensor" in msg
    assert "keeping stage 2's value" in msg
    assert torch.equal(out["logits"][2][0], t(2.0))


def test_where_names_the_root():
    with pytest.warns(RankDivergenceWarning, match=r"invoke 3\['x'\]"):
        merge([{"x": 1}, {"x": 2}], where="invoke 3")


# ---------------------------------------------------------------- several stages, several requests


def test_three_stages_highest_real_value_wins():
    with pytest.warns(RankDivergenceWarning, match=r"stages 0, 1 returned .*keeping stage 1"):
        assert merge([1, 2, NOT_HERE]) == 2
    with pytest.warns(RankDivergenceWarning, match=r"stages 0, 2 returned .*keeping stage 2"):
        assert merge([1, NOT_HERE, 3]) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert merge([NOT_HERE, NOT_HERE, 7]) == 7
        assert merge([{"a": 1}, {"b": 2}, {"c": 3}]) == {"a": 1, "b": 2, "c": 3}


def test_two_requests_stay_distinct():
    a, b, c = t(1.0), t(2.0), t(3.0)
    req1 = [[a, NOT_HERE], [NOT_HERE, b]]
    req2 = [[c], [NOT_HERE, NOT_HERE, a, b]]
    out1 = merge(req1)
    out2 = merge(req2)
    assert len(out1) == 2 and out1[0] is a and out1[1] is b
    assert len(out2) == 4
    assert out2[0] is c and out2[1] is NOT_HERE and out2[2] is a and out2[3] is b
    assert out1 is not out2
    # merging the first request again gives the same answer in a fresh list
    again = merge(req1)
    assert len(again) == 2 and again[0] is a and again[1] is b and again is not out1


def test_inputs_are_not_mutated():
    s0 = {"a": [t(1.0), NOT_HERE]}
    s1 = {"a": [NOT_HERE, t(2.0)], "b": 1}
    merge([s0, s1])
    assert list(s0) == ["a"] and s0["a"][1] is NOT_HERE
    assert s1["a"][0] is NOT_HERE


def test_many_tensors_merge_without_copies():
    n = 500
    s0 = {f"layer{i}": (torch.randn(4, 8) if i < n // 2 else NOT_HERE) for i in range(n)}
    s1 = {f"layer{i}": (NOT_HERE if i < n // 2 else torch.randn(4, 8)) for i in range(n)}
    out = merge([s0, s1])
    assert all(out[f"layer{i}"] is s0[f"layer{i}"] for i in range(n // 2))
