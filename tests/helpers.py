"""Small helpers shared by the tests."""

from __future__ import annotations

import threading

import torch
from torch import nn

import asyncpp

# the strict modes of VllmEngine: the vLLM tests run each engine they share in both
MODES = ("eager", "compiled")
# and the default, auto (compiled, a request whose block needs a location that is no tap eagerly):
# the main engine tests run on it too, where their blocks mix compiled and eager steps
ALL_MODES = (*MODES, "auto")
# the compiled engines' taps beyond the default set (each decoder layer): what the tests await
TEST_TAPS = (
    "model.layers.*.mlp",
    "model.layers.*.mlp.gate_up_proj",
    "model.layers.*.mlp.act_fn",
    "model.layers.*.self_attn.qkv_proj",
    "model.layers.*.self_attn.o_proj.input",
    "model.layers.*.self_attn.inputs",  # (called by keyword: positions=, hidden_states=)
)


def mode_options(mode: str) -> dict:
    """VllmEngine options for ``mode``: a compiled engine gets the taps the tests await."""
    return {"mode": mode, "taps": TEST_TAPS} if mode == "compiled" else {"mode": mode}


class Gate(nn.Module):
    """A real module whose forward blocks until the test opens it (from its event loop, which must
    keep running while the forward waits)."""

    def __init__(self, wait_s: float = 10.0):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.wait_s = wait_s

    def forward(self, x):
        self.entered.set()
        assert self.opened.wait(self.wait_s), "the gate was never opened: was the caller's loop blocked?"
        return self.lin(x)


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


def assert_values_before_their_tokens(events, steps: int) -> None:
    """``events``: one invoke's stream as ``(kind, value)``, a value emitted at each step and token
    events (lists of ids). Step k's value comes before step k's token, and the tokens are ``steps``
    in all. (A token event may hold several tokens when the reader fell behind, and step k+1's
    value may come before step k's token: vLLM overlaps a step's output with the next forward.)"""
    delivered, step = 0, 0
    for kind, value in events:
        if kind == "emit":
            assert delivered <= step, (step, events)  # no token of this step or later has come yet
            step += 1
        else:
            assert kind == "tokens" and value, (kind, value)
            delivered += len(value)
    assert step == steps and delivered == steps, (step, delivered, events)


async def std_points(m):
    """Every standard point (``m.std``) of every layer (cloned: later layers edit the stream in place)."""
    out = {"embed": (await m.std.embed).clone()}
    for i, layer in enumerate(m.std.layers):
        for point in ("resid_in", "attn_out", "mlp_out", "resid_out"):
            out[f"{point}{i}"] = (await getattr(layer, point)).clone()
    out["final_norm"] = (await m.std.final_norm).clone()
    out["logits"] = (await m.std.logits).clone()
    return out


# parity of a split engine (pipeline stages, nodes) with one stage, at float32
COS = 0.9999


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Cosine similarity of ``a`` and ``b`` at least :data:`COS`."""
    a, b = a.double().flatten(), b.double().flatten()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0)
    assert cos >= COS, f"cosine {float(cos):.6f}"


def same_logits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Logits: the same argmax everywhere, and :func:`same`."""
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    same(a, b)


# --- blocks for split engines (every stage runs them): layer 0 is on stage 0 of 2, layer 3 on 1


async def cross_stage_rmw(m):
    early = await m.model.layers[0].output  # upstream of layer 3's stage: pulled in place there
    late = await m.model.layers[3].output
    late[0][:] += 0.25 * early[0]  # read a local layer, use an upstream value, write the local layer
    return (await m.logits).clone()


async def generate_with_cross_stage_write(m):
    tokens = []
    async for _ in m.steps():
        early = await m.model.layers[0].output
        late = await m.model.layers[3].output
        late[0][:] += 0.5 * early[0]
        tokens.append((await m.samples).sampled_token_ids[0, 0].clone())
    return tokens
