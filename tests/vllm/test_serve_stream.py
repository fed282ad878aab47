"""Streaming over HTTP: `POST /v1/trace` with `"stream": true` answers server-sent events (one per
value a block emits, as it is made, then the trace's answer), and `RemoteEngine` streams with the
trace API (`async for v in h.stream()`) on asyncio, uvloop and trio.

One server subprocess (vLLM, the tiny model, float32) for the module, with `examples/serve_blocks.py`
and a few test-only blocks; its fixture is a copy of the one in tests/test_serve_http.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TEST_TAPS, assert_values_before_their_tokens
from serve_helpers import ALICE_SECRET, ROOT_SECRET, start_server

import asyncpp
from asyncpp.serve import wire

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

# the first test also waits for the server: 20-40 s, or up to ~4 minutes when its compiled engine is
# the first on a fresh machine to compile this graph (in the whole suite, tests/pp compiles it first)
pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
ALICE = {"Authorization": f"Bearer {ALICE_SECRET}"}
ROOT_TOKEN = {"Authorization": f"Bearer {ROOT_SECRET}"}
PROMPT = "The cat sat on the"

TEST_BLOCKS = '''
import time
from typing import Annotated

import asyncpp
from asyncpp.serve import Range, block


@block
async def ticker(m, per_step: Annotated[float, Range(0, 1)] = 0.0):
    """Emit the step's index at every generation step (sleeping per_step on the model thread)."""
    n = 0
    async for _ in m.steps():
        await m.logits
        time.sleep(per_step)
        asyncpp.emit(n)
        n += 1
    return n


@block
async def emit_then_fail(m, message: str):
    """Emit 1 and 2, then raise RuntimeError(message)."""
    asyncpp.emit(1)
    await m.model.layers[0].output
    asyncpp.emit(2)
    raise RuntimeError(message)
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from start_server(
        tmp_path_factory.mktemp("serve-stream"),
        TEST_BLOCKS,
        "--allow-code",
        "--max-body-bytes",
        str(2**20),
        # a compiled engine (the other server tests run eager ones): serving does not depend on the mode
        "--mode",
        "compiled",
        "--taps",
        json.dumps(TEST_TAPS),
        ready_s=280,
    )


def post(server, payload, *, headers=ROOT_TOKEN, timeout=30):
    return httpx.post(
        server.url + "/v1/trace",
        content=wire.encode_json(payload),
        headers={**headers, "Content-Type": "application/json"},
        timeout=timeout,
    )


def events(lines):
    """(event, data decoded from wire JSON) per server-sent event; strict about the format the
    server writes: `event: <name>`, one `data: <json>` line, a blank line."""
    kind = data = None
    for line in lines:
        if line == "":
            assert kind is not None and data is not None, "an event without its event or data line"
            yield kind, wire.decode_json(data)
            kind = data = None
        elif line.startswith("event: "):
            assert kind is None
            kind = line[len("event: ") :]
        elif line.startswith("data: "):
            assert data is None
            data = line[len("data: ") :]
        else:
            raise AssertionError(f"an unexpected line in the event stream: {line!r}")
    assert kind is None and data is None, "the stream ended inside an event"


def stream(server, payload, *, headers=ROOT_TOKEN, timeout=30):
    """Every event of a streamed trace, read to its end."""
    with httpx.stream(
        "POST", server.url + "/v1/trace", content=wire.encode_json({**payload, "stream": True}),
        headers={**headers, "Content-Type": "application/json"}, timeout=timeout,
    ) as r:  # fmt: skip
        assert r.status_code == 200, r.read()[:500]
        assert r.headers["content-type"].startswith("text/event-stream")
        return list(events(r.iter_lines()))


def generate(n, *invokes, ignore_eos=True):
    return {
        "generate": True,
        "max_new_tokens": n,
        "sampling": {"ignore_eos": ignore_eos},
        "invokes": [{"prompt": p, "block": b, "args": a} for p, b, a in invokes],
    }


def clean(before):
    def check(s):  # the server forgot the request, and so did every worker (released within a step)
        idle = all(v == 0 for w in s["workers"] for k, v in w.items() if k not in ("pid", "hot_in"))
        return s["in_flight"] == 0 and s["aborted"] > before["aborted"] and idle

    return check


# --- the protocol --------------------------------------------------------------------------------


def test_values_arrive_while_the_trace_runs_and_a_disconnect_aborts_it(server):
    before = server.stats()
    payload = generate(400, ("x", "ticker", {"per_step": 0.02}))  # about 8 s unless aborted
    with httpx.stream(
        "POST", server.url + "/v1/trace", content=wire.encode_json({**payload, "stream": True}),
        headers={**ROOT_TOKEN, "Content-Type": "application/json"}, timeout=30,
    ) as r:  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        it = events(r.iter_lines())  # (held: closing the generator would close the response)
        first = next(it)
        assert first == ("emit", {"invoke": 0, "value": 0})
        # causal, not timed: the first value is here, and the server still runs the request
        s = server.stats()
        assert s["in_flight"] == 1 and any(
            v for w in s["workers"] for k, v in w.items() if k not in ("pid", "hot_in")
        ), s
    # leaving the `with` closed the connection mid-stream: the server aborts the trace's requests
    s = server.wait_stats(clean(before), timeout=6)
    assert clean(before)(s) and s["aborted"] == before["aborted"] + 1, s
    assert post(server, {"invokes": [{"prompt": "x"}]}).status_code == 200


def test_done_equals_the_answer_without_a_stream_and_invokes_interleave(server):
    payload = generate(
        8, (PROMPT, "lens_stream", {"k": 2}), ("Hello", "ticker", {"per_step": 0.01}), ("A", None, {})
    )
    everything = stream(server, payload)
    plain = post(server, payload)
    assert plain.status_code == 200
    assert everything[-1] == ("done", wire.decode_json(plain.content))
    done = everything[-1][1]["invokes"]
    # tokens events as the tokens are sampled, after that step's emitted value (invokes 0 and 1)
    tokens = [d for k, d in everything[:-1] if k == "tokens"]
    for i in range(3):
        mine = [d for d in tokens if d["invoke"] == i]
        assert [t for d in mine for t in d["tokens"]] == done[i]["tokens"] and len(done[i]["tokens"]) == 8
        text = "".join(d["text"] for d in mine)  # (bytes not yet a character come with a later event)
        assert done[i]["text"].startswith(text) and not done[i]["text"][len(text) :].strip("\ufffd")
        mine_all = [(k, d) for k, d in everything[:-1] if d["invoke"] == i]
        if i == 2:
            assert {k for k, _ in mine_all} == {"tokens"}
        else:
            assert_values_before_their_tokens([(k, d.get("value", d.get("tokens"))) for k, d in mine_all], 8)
    got = [(k, d) for k, d in everything[:-1] if k == "emit"]
    assert len(got) == 16
    order = [d["invoke"] for _, d in got]
    lens = [d["value"] for _, d in got if d["invoke"] == 0]
    ticks = [d["value"] for _, d in got if d["invoke"] == 1]
    assert ticks == list(range(8)) and [v["step"] for v in lens] == list(range(8))
    assert all(len(v["lens"]) == 4 and all(len(t) == 2 for t in v["lens"]) for v in lens)
    assert order.index(1) < len(order) - 1 - order[::-1].index(0), order  # interleaved, as made
    assert [d["result"] for d in done] == [8, 8, None]
    # the lens' own top-1 at each step is the token the model sampled next
    assert [v["logits"][0] for v in lens] == done[0]["tokens"]


def test_a_failing_block_and_refusals(server):
    payload = {"invokes": [
        {"prompt": PROMPT, "block": "emit_then_fail", "args": {"message": "no more"}},
        {"prompt": PROMPT, "block": "read_layer", "args": {"layer": 1}},
    ]}  # fmt: skip
    everything = stream(server, payload)
    got = [(k, d) for k, d in everything if k != "tokens"]
    assert got[:2] == [("emit", {"invoke": 0, "value": 1}), ("emit", {"invoke": 0, "value": 2})]
    kind, done = got[2]
    assert kind == "done" and len(got) == 3
    # each request sampled its one token (the failed block's request ran on)
    tokens = {d["invoke"]: d["tokens"] for k, d in everything if k == "tokens"}
    assert tokens == {0: done["invokes"][0]["tokens"], 1: done["invokes"][1]["tokens"]}
    assert done["invokes"][0]["error"] == {"type": "RuntimeError", "message": "no more"}
    assert done["invokes"][1]["error"] is None and done["invokes"][1]["result"].shape == (128,)
    # what fails before the stream begins answers JSON, as without a stream
    for body, headers, status in (
        ({"stream": True, "invokes": [{"prompt": "x", "block": "nope"}]}, ROOT_TOKEN, 422),
        ({"stream": "yes", "invokes": [{"prompt": "x"}]}, ROOT_TOKEN, 400),
        ({"stream": True, "invokes": [{"prompt": "x"}]}, {"Authorization": "Bearer wrong"}, 401),
        ({"stream": True, "invokes": [{"prompt": "x", "code": "AAAA"}]}, ALICE, 403),
    ):
        r = post(server, body, headers=headers)
        assert r.status_code == status and r.headers["content-type"].startswith("application/json"), r.text
        assert set(r.json()["error"]) == {"type", "message"}
    assert server.wait_stats(lambda s: s["in_flight"] == 0)["in_flight"] == 0


# --- the client: RemoteEngine streams with the trace API ------------------------------------------


@pytest.mark.parametrize("backend", [("asyncio", {}), ("asyncio", {"use_uvloop": True}), ("trio", {})],
                         ids=["asyncio", "uvloop", "trio"])  # fmt: skip
def test_remote_engine_streams_live(server, backend):
    import anyio

    remote = asyncpp.RemoteEngine(server.url, "root-token-4567", binary=backend[0] == "trio")

    async def main():
        seen, live = [], None
        async with asyncpp.generate(remote, max_new_tokens=30, ignore_eos=True) as t:
            a = t.invoke(PROMPT, "ticker", per_step=0.02)
            b = t.invoke("Hello", "lens_stream", k=1)
            async for h, v in t.stream():
                if live is None:  # the first value: the server still runs the trace
                    live = server.stats()["in_flight"]
                seen.append((h.index, v))
        async with asyncpp.generate(remote, max_new_tokens=3) as t2:
            c = t2.invoke("Hi", "lens_stream", k=1)
            values = [v async for v in c.stream()]
        async with asyncpp.generate(remote, max_new_tokens=5, ignore_eos=True) as t3:
            d = t3.invoke(PROMPT, "ticker")
            evs = [(ev.kind, ev.value) async for ev in d.events()]
        return a, b, c, seen, live, values, d, evs

    a, b, c, seen, live, values, d, evs = anyio.run(main, backend=backend[0], backend_options=backend[1])
    toks = d.tokens[0].tolist()
    assert [v for kind, v in evs if kind == "emit"] == list(range(5))
    assert [x for kind, v in evs if kind == "tokens" for x in v] == toks
    assert_values_before_their_tokens(evs, 5)
    assert live == 1
    assert [v for i, v in seen if i == 0] == a.emitted == list(range(30)) and a.result == 30
    assert [v for i, v in seen if i == 1] == b.emitted and len(b.emitted) == 30 and b.result == 30
    assert [v["logits"][0] for v in b.emitted] == b.tokens[0].tolist()
    assert values == c.emitted and [v["step"] for v in values] == [0, 1, 2] and c.result == 3


def test_remote_engine_stream_errors_and_abandon(server):
    import anyio

    remote = asyncpp.RemoteEngine(server.url, "root-token-4567")

    async def failing():
        got = []
        with pytest.raises(RuntimeError, match="stop here"):
            async with asyncpp.trace(remote) as t:
                h = t.invoke(PROMPT, "emit_then_fail", message="stop here")
                got = [v async for v in h.stream()]
        assert got == [1, 2] == h.emitted and isinstance(h.exception, RuntimeError)
        with pytest.raises(asyncpp.serve.BlockArgumentError):  # refused before the stream: as without
            async with asyncpp.trace(remote) as t:
                h = t.invoke(PROMPT, "ticker", per_step=5.0)
                [v async for v in h.stream()]

    anyio.run(failing)
    before = server.stats()

    async def leave_early():
        with pytest.raises(KeyError):
            async with asyncpp.generate(remote, max_new_tokens=400, ignore_eos=True) as t:
                h = t.invoke("x", "ticker", per_step=0.02)  # about 8 s unless aborted
                async for v in h.stream():
                    assert v == 0
                    raise KeyError("the caller gives up")

    anyio.run(leave_early)
    s = server.wait_stats(clean(before), timeout=6)
    assert clean(before)(s) and s["aborted"] == before["aborted"] + 1, s


def test_text_deltas_add_up_to_the_text(tiny):
    from asyncpp.serve.app import _TextDelta

    _, tok = tiny
    ids = tok("héllo wörld, ça va? 日本", add_special_tokens=False)["input_ids"]
    deltas = _TextDelta(tok)
    text = "".join(deltas.add([x]) for x in ids)  # one token at a time, as a generation samples them
    assert text == tok.decode(ids, skip_special_tokens=True) and "\ufffd" not in text


def test_the_client_example_runs_against_the_server(server):
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "serve_client.py"), server.url, ROOT_SECRET],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "blocks: steer, read_layer, logit_lens" in out
    assert out.count("sampled [") == 6 and "step 5: top token per layer" in out
    assert "block error: None" in out
