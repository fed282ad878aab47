"""`asyncpp serve` over real HTTP: one server subprocess (vLLM, the tiny model, float32) for the module.

The server runs `examples/serve_blocks.py` plus a few test-only blocks (a block that raises, one
that crawls through a generation, sleeping on the model thread at every step), with two tokens: `alice`
(untrusted, small limits) and `root` (trusted), and `--allow-code`. Results are checked against the
same checkpoint run in this process by a `LocalEngine` (Hugging Face), and concurrent answers
against the same requests run alone. The app mounted in a parent FastAPI app is served by uvicorn
in a thread, on a `LocalEngine`. The server's engine has the default mode ("auto"): a request whose
block reaches past the taps (e.g. `logit_lens`, through a helper) runs its steps eagerly, and the
requests batched with it run eagerly too, so one request sent twice can come back with float32
values that differ in the last bits (`SAME`), never more.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from serve_helpers import ALICE_SECRET, FAILING_AND_SLOW_BLOCKS, ROOT_SECRET, start_server

import asyncpp
from asyncpp.serve import Registry, wire

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

pytestmark = pytest.mark.timeout(240)  # the first test also waits for the server (compiled: 20-90 s)

ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-4  # float32: vLLM's CPU kernels (batched with other requests) against Hugging Face
SAME = {"rtol": 0, "atol": 1e-6}  # one request twice: batched alike or not, compiled or eager steps
ALICE = {"Authorization": f"Bearer {ALICE_SECRET}"}
ROOT_TOKEN = {"Authorization": f"Bearer {ROOT_SECRET}"}
JSON = {"Content-Type": "application/json"}
BIN = {"Content-Type": wire.CONTENT_TYPE}
PROMPT = "The cat sat on the"

TEST_BLOCKS = FAILING_AND_SLOW_BLOCKS


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from start_server(
        tmp_path_factory.mktemp("serve"), TEST_BLOCKS, "--allow-code", "--max-body-bytes", str(2**20),
        "--block-budget", "1",
    )  # fmt: skip


@pytest.fixture(scope="module")
def local(tiny):
    model, tok = tiny
    engine = asyncpp.LocalEngine(model, tok)
    yield engine
    engine.close()


def post(server, payload, *, headers=ROOT_TOKEN, binary=False, timeout=30):
    body = wire.encode(payload) if binary else wire.encode_json(payload)
    r = httpx.post(
        server.url + "/v1/trace",
        content=body,
        headers={**headers, **(BIN if binary else JSON)},
        timeout=timeout,
    )
    return r


def ok(r):
    assert r.status_code == 200, r.text[:500]
    assert r.headers["content-type"].startswith(
        wire.CONTENT_TYPE if r.request.headers["content-type"] == wire.CONTENT_TYPE else "application/json"
    )
    return wire.decode_body(r.content, r.headers["content-type"])


def refused(r, status, kind=None):
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"type", "message"} and err["message"]
    assert "Traceback" not in r.text
    if kind is not None:
        assert err["type"] == kind, err
    return err


# --- reference values from the same checkpoint, in this process ---------------------------------


def hf_ids(tok, text):
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


def local_steered_logits(local, layer, vec, scale):
    async def steer(m, vec):
        out = await m.model.layers[layer].output
        out[:, -1] += scale * vec
        return (await m.logits)[0, -1]

    with asyncpp.trace(local) as t:
        h = t.invoke(PROMPT, steer, vec)
    return h.result


# --- the server -------------------------------------------------------------------------------


def test_health_blocks_and_auth(server):
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    refused(httpx.get(server.url + "/v1/blocks", timeout=10), 401, "AuthenticationError")
    refused(httpx.get(server.url + "/v1/blocks", headers={"Authorization": "Bearer nope"}), 401)
    refused(httpx.get(server.url + "/v1/blocks", headers={"Authorization": "Basic YWxpY2U="}), 401)
    r = httpx.get(server.url + "/v1/blocks", headers=ALICE, timeout=10)
    assert r.status_code == 200
    names = [b["name"] for b in r.json()["blocks"]]
    assert names[:3] == ["steer", "read_layer", "logit_lens"] and "boom" in names
    steer = r.json()["blocks"][0]
    assert [p["name"] for p in steer["params"]] == ["layer", "vec", "scale"]
    assert steer["params"][1] == {
        "name": "vec", "type": "tensor", "dtype": "float32", "max_shape": [16384],
        "nullable": False, "required": True,
    }  # fmt: skip
    refused(httpx.get(server.url + "/v1/stats", headers=ALICE, timeout=10), 403, "PermissionError")
    refused(httpx.get(server.url + "/nowhere", timeout=10), 404, "NotFound")


def test_steering_and_reads_match_local_engine(server, local, tiny):
    model, tok = tiny
    torch.manual_seed(0)
    vec = torch.randn(128)
    payload = {
        "invokes": [
            {"prompt": PROMPT, "block": "steer", "args": {"layer": 1, "vec": vec, "scale": 3.0}},
            {"prompt": PROMPT, "block": "read_layer", "args": {"layer": 2}},
            {"prompt": PROMPT, "block": "steer", "args": {"layer": 1, "vec": torch.zeros(128)}},
            {"prompt": PROMPT},
        ]
    }
    out = ok(post(server, payload, binary=True))
    assert out["model"] == "asyncpp-tiny-llama"
    steered, hidden, unsteered, plain = out["invokes"]
    for inv in out["invokes"]:
        assert inv["error"] is None and len(inv["tokens"]) == 1
        assert inv["text"] == tok.decode(inv["tokens"], skip_special_tokens=True)
    assert plain["result"] is None
    with torch.no_grad():
        ref = model(hf_ids(tok, PROMPT), output_hidden_states=True)
    torch.testing.assert_close(hidden["result"], ref.hidden_states[3][0, -1], rtol=0, atol=ATOL)
    torch.testing.assert_close(unsteered["result"], ref.logits[0, -1], rtol=0, atol=ATOL)
    expected = local_steered_logits(local, 1, vec, 3.0)
    torch.testing.assert_close(steered["result"], expected, rtol=0, atol=ATOL)
    assert (steered["result"] - unsteered["result"]).abs().max() > 0.1  # the edit did something
    assert steered["tokens"] == [int(expected.argmax())]
    assert plain["tokens"] == unsteered["tokens"] == [int(ref.logits[0, -1].argmax())]


def test_logit_lens_invariants_json(server, tiny):
    model, tok = tiny
    out = ok(post(server, {"invokes": [{"prompt": PROMPT, "block": "logit_lens", "args": {"k": 3}}]}))
    inv = out["invokes"][0]
    lens = inv["result"]["lens"]
    assert len(lens) == 4 and all(len(row) == 3 for row in lens)
    # the lens of the last layer is the model's own logits, and top-1 is the sampled token
    assert lens[-1] == inv["result"]["logits"]
    assert lens[-1][0] == inv["tokens"][0]
    with torch.no_grad():
        hs = model(hf_ids(tok, PROMPT), output_hidden_states=True).hidden_states
        ref = [model.lm_head(model.model.norm(hs[i + 1][0, -1])).topk(3).indices.tolist() for i in range(3)]
    assert lens[:3] == ref


def test_generate_several_invokes_both_content_types(server, tiny):
    model, tok = tiny
    prompts = ["Hello", "The quick brown fox", tok("Once upon", add_special_tokens=False)["input_ids"]]
    payload = {
        "generate": True,
        "max_new_tokens": 6,
        "sampling": {"ignore_eos": True},
        "invokes": [
            {"prompt": prompts[0]},
            {"prompt": prompts[1], "block": "read_layer", "args": {"layer": 0}},
            {"prompt": prompts[2], "block": "logit_lens"},
        ],
    }
    as_json = ok(post(server, payload))
    as_bin = ok(post(server, payload, binary=True))
    for a, b, prompt in zip(as_json["invokes"], as_bin["invokes"], prompts):
        assert a["error"] is None and len(a["tokens"]) == 6
        assert a["tokens"] == b["tokens"] and a["text"] == b["text"]
        ids = hf_ids(tok, prompt) if isinstance(prompt, str) else torch.tensor([prompt])
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
        assert a["tokens"] == ref[0, ids.shape[1] :].tolist()
    torch.testing.assert_close(as_json["invokes"][1]["result"], as_bin["invokes"][1]["result"], **SAME)
    assert as_json["invokes"][2]["result"]["lens"][-1][0] == as_json["invokes"][2]["tokens"][0]


def test_a_block_that_raises_fails_only_its_invoke(server):
    payload = {
        "invokes": [
            {"prompt": PROMPT, "block": "read_layer", "args": {"layer": 1}},
            {"prompt": PROMPT, "block": "boom", "args": {"message": "kaboom 42"}},
            {"prompt": PROMPT, "block": "steer", "args": {"layer": 1, "vec": torch.ones(64)}},
            {"prompt": PROMPT, "block": "read_layer", "args": {"layer": 9}},
            {"prompt": PROMPT, "block": "read_layer", "args": {"layer": 1}},
        ]
    }
    good, boom, bad_vec, bad_layer, again = ok(post(server, payload, binary=True))["invokes"]
    assert boom["error"] == {"type": "RuntimeError", "message": "kaboom 42"} and boom["result"] is None
    assert bad_vec["error"]["type"] == "ValueError" and "hidden size is 128" in bad_vec["error"]["message"]
    assert bad_layer["error"] is not None and bad_layer["result"] is None
    assert good["error"] is None and again["error"] is None
    torch.testing.assert_close(good["result"], again["result"], rtol=0, atol=ATOL)
    assert "Traceback" not in json.dumps([boom["error"], bad_vec["error"], bad_layer["error"]])


def _big_json_tensor():
    return json.dumps(
        {
            "invokes": [
                {
                    "prompt": "x",
                    "block": "steer",
                    "args": {
                        "layer": 0,
                        "vec": {"__tensor__": {"dtype": "float32", "shape": [2**25], "data": ""}},
                    },
                }
            ]
        }
    ).encode()


def _code(block, *args, **kwargs) -> str:
    from asyncpp.engines.vllm.packing import pack_block

    return base64.b64encode(pack_block(block, args, kwargs)).decode("ascii")


async def shipped_block(m, layer, scale=1.0):
    mlp_out, residual = await m.model.layers[layer].output
    return ((mlp_out + residual)[-1] * scale).float()


async def returns_a_set(m):
    await m.logits
    return {1, 2}  # pickles back from the worker, but is not wire data


ERROR_CASES = [
    # (name, body bytes or payload, content type, headers, status, error type)
    ("malformed JSON", b'{"invokes": [', "application/json", ROOT_TOKEN, 400, "WireError"),
    ("not an object", b"[1, 2]", "application/json", ROOT_TOKEN, 400, "RequestError"),
    ("NaN literal", b'{"invokes": NaN}', "application/json", ROOT_TOKEN, 400, "WireError"),
    ("bad wire body", b"APW1\x05", wire.CONTENT_TYPE, ROOT_TOKEN, 400, "WireError"),
    ("content type", b"{}", "text/plain", ROOT_TOKEN, 400, "WireError"),
    ("unknown key", {"invokes": [{"prompt": "x"}], "streaming": True}, None, ROOT_TOKEN, 400, "RequestError"),
    ("stream type", {"invokes": [{"prompt": "x"}], "stream": "yes"}, None, ROOT_TOKEN, 400, "RequestError"),
    ("unknown invoke key", {"invokes": [{"prompt": "x", "blok": "steer"}]}, None, ROOT_TOKEN, 400, "RequestError"),
    ("no invokes", {"invokes": []}, None, ROOT_TOKEN, 400, "RequestError"),
    ("prompt type", {"invokes": [{"prompt": 3}]}, None, ROOT_TOKEN, 400, "RequestError"),
    ("prompt ids", {"invokes": [{"prompt": [1, True]}]}, None, ROOT_TOKEN, 400, "RequestError"),
    ("generate without n", {"generate": True, "invokes": [{"prompt": "x"}]}, None, ROOT_TOKEN, 400, "RequestError"),
    ("n without generate", {"max_new_tokens": 3, "invokes": [{"prompt": "x"}]}, None, ROOT_TOKEN, 400, "RequestError"),
    ("sampling key", {"sampling": {"max_tokens": 3}, "invokes": [{"prompt": "x"}]}, None, ROOT_TOKEN, 400, "RequestError"),
    ("sampling type", {"sampling": {"temperature": "hot"}, "invokes": [{"prompt": "x"}]}, None, ROOT_TOKEN, 400, "RequestError"),
    ("empty prompt", {"invokes": [{"prompt": ""}]}, None, ROOT_TOKEN, 400, "InputError"),
    ("prompt too long", {"invokes": [{"prompt": [5] * 600}]}, None, ROOT_TOKEN, 400, "InputError"),
    ("unknown block", {"invokes": [{"prompt": "x", "block": "stear"}]}, None, ROOT_TOKEN, 422, "UnknownBlockError"),
    ("arg type", {"invokes": [{"prompt": "x", "block": "read_layer", "args": {"layer": "1"}}]}, None, ROOT_TOKEN, 422, "BlockArgumentError"),
    ("arg range", {"invokes": [{"prompt": "x", "block": "read_layer", "args": {"layer": -1}}]}, None, ROOT_TOKEN, 422, "BlockArgumentError"),
    ("missing arg", {"invokes": [{"prompt": "x", "block": "read_layer"}]}, None, ROOT_TOKEN, 422, "BlockArgumentError"),
    ("extra arg", {"invokes": [{"prompt": "x", "block": "read_layer", "args": {"layer": 1, "x": 2}}]}, None, ROOT_TOKEN, 422, "BlockArgumentError"),
    ("tensor dtype", {"invokes": [{"prompt": "x", "block": "steer", "args": {"layer": 1, "vec": torch.zeros(128, dtype=torch.float64)}}]}, None, ROOT_TOKEN, 422, "BlockArgumentError"),
    ("tensor shape", {"invokes": [{"prompt": "x", "block": "steer", "args": {"layer": 1, "vec": torch.zeros(2, 128)}}]}, None, ROOT_TOKEN, 422, "BlockArgumentError"),
    ("tensor over the wire limit", _big_json_tensor(), "application/json", ROOT_TOKEN, 413, "WireLimitError"),
    ("too many invokes", {"invokes": [{"prompt": "x"}] * 5}, None, ALICE, 400, "RequestError"),
    ("max_new_tokens cap", {"generate": True, "max_new_tokens": 33, "invokes": [{"prompt": "x"}]}, None, ALICE, 400, "RequestError"),
    ("no token", {"invokes": [{"prompt": "x"}]}, None, {}, 401, "AuthenticationError"),
    ("bad token", {"invokes": [{"prompt": "x"}]}, None, {"Authorization": "Bearer alice-token-012"}, 401, "AuthenticationError"),
    ("code, untrusted", {"invokes": [{"prompt": "x", "code": "not even base64"}]}, None, ALICE, 403, "PermissionError"),
    ("code and block", {"invokes": [{"prompt": "x", "code": "AAAA", "block": "steer"}]}, None, ROOT_TOKEN, 400, "RequestError"),
    ("code not base64", {"invokes": [{"prompt": "x", "code": "@@@"}]}, None, ROOT_TOKEN, 400, "RequestError"),
]  # fmt: skip


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_error_statuses(server, case):
    _, body, ctype, headers, status, kind = case
    if ctype is None:
        ctype, body = "application/json", wire.encode_json(body)
    r = httpx.post(
        server.url + "/v1/trace", content=body, headers={**headers, "Content-Type": ctype}, timeout=30
    )
    err = refused(r, status, kind)
    if case[0] == "max_new_tokens cap":
        assert "32" in err["message"]
    if case[0] == "too many invokes":
        assert "4" in err["message"]


def test_oversized_bodies(server):
    big = b"{" + b" " * (2**20) + b"}"  # one byte over the server's --max-body-bytes of 1 MiB
    r = httpx.post(server.url + "/v1/trace", content=big, headers={**ROOT_TOKEN, **JSON}, timeout=30)
    refused(r, 413, "WireLimitError")

    def chunks():  # no Content-Length: the server counts what it reads
        for _ in range(20):
            yield b" " * 65536

    r = httpx.post(server.url + "/v1/trace", content=chunks(), headers={**ROOT_TOKEN, **JSON}, timeout=30)
    refused(r, 413, "WireLimitError")
    # a body just under the limit is read (and then judged on its content)
    r = httpx.post(
        server.url + "/v1/trace", content=b" " * (2**20 - 10) + b"[]", headers={**ROOT_TOKEN, **JSON}
    )
    refused(r, 400, "RequestError")


def test_shipped_code_from_the_trusted_token(server):
    payload = {
        "invokes": [
            {"prompt": PROMPT, "code": _code(shipped_block, 2, scale=2.0)},
            {"prompt": PROMPT, "block": "read_layer", "args": {"layer": 2}},
            {"prompt": PROMPT, "code": _code(returns_a_set)},
        ]
    }
    code, registered, not_data = ok(post(server, payload, binary=True))["invokes"]
    assert code["error"] is None and registered["error"] is None
    assert not_data["result"] is None and not_data["error"]["type"] == "WireError"
    assert "set" in not_data["error"]["message"] and len(not_data["tokens"]) == 1
    torch.testing.assert_close(code["result"], 2.0 * registered["result"], rtol=0, atol=ATOL)
    # the same code from the untrusted token is refused before it is looked at
    refused(post(server, payload, headers=ALICE), 403, "PermissionError")


def crawling(n, per_step):
    return {
        "generate": True,
        "max_new_tokens": n,
        "sampling": {"ignore_eos": True},
        "invokes": [{"prompt": "x", "block": "crawl", "args": {"per_step": per_step}}],
    }


def test_concurrency_limit_per_token(server):
    slow = crawling(32, 0.04)  # two of them: about 2.5 s (the steps' sleeps add up)
    answers = []
    threads = [
        threading.Thread(target=lambda: answers.append(post(server, slow, headers=ALICE))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    s = server.wait_stats(lambda s: s["in_flight"] >= 2)
    assert s["in_flight"] >= 2, s
    r = post(server, {"invokes": [{"prompt": "x"}]}, headers=ALICE)
    refused(r, 429, "TooManyRequests")
    ok(post(server, {"invokes": [{"prompt": "x"}]}))  # another token is not limited by alice's
    for t in threads:
        t.join(30)
    assert [a.status_code for a in answers] == [200, 200]
    assert [a.json()["invokes"][0]["result"] for a in answers] == [32, 32]
    ok(post(server, {"invokes": [{"prompt": "x"}]}, headers=ALICE))  # her slots are free again


def test_disconnect_aborts_the_trace(server):
    before = server.stats()
    crawl = crawling(400, 0.02)  # about 8 s (400 steps x 20 ms) unless aborted
    with pytest.raises(httpx.ReadTimeout):
        post(server, crawl, timeout=0.8)

    def clean(s):  # the server forgot the request, and so did every worker (released within a step)
        idle = all(v == 0 for w in s["workers"] for k, v in w.items() if k not in ("pid", "hot_in"))
        return s["in_flight"] == 0 and s["aborted"] > before["aborted"] and idle

    s = server.wait_stats(clean, timeout=6)
    assert clean(s) and s["aborted"] == before["aborted"] + 1, s
    # the engine is free at once: a short request is answered quickly
    ok(post(server, {"invokes": [{"prompt": "x"}]}))


def test_a_stalling_block_is_stopped_by_the_budget_and_fails_alone(server, tiny):
    """One block sleeps 30 s on the model thread; the server's 1 s budget interrupts it at its line,
    its request fails with BlockTimeoutError, and four concurrent generations finish as alone."""
    plain = {"generate": True, "max_new_tokens": 12, "sampling": {"ignore_eos": True}}
    prompts = ["Once upon a time", "The cat sat on the", "Hello world", "A"]
    alone = [ok(post(server, {**plain, "invokes": [{"prompt": p}]}))["invokes"][0]["tokens"] for p in prompts]
    answers: dict[str, httpx.Response] = {}

    def send(key, payload):
        answers[key] = post(server, payload, timeout=25)  # (without the budget: 30 s, a ReadTimeout)

    stalled = {**plain, "invokes": [{"prompt": "x", "block": "stall", "args": {"seconds": 30}}]}
    threads = [threading.Thread(target=send, args=("stall", stalled))] + [
        threading.Thread(target=send, args=(p, {**plain, "invokes": [{"prompt": p}]})) for p in prompts
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    inv = ok(answers["stall"])["invokes"][0]
    assert inv["result"] is None and inv["error"]["type"] == "BlockTimeoutError", inv
    assert "'stall'" in inv["error"]["message"] and "1 s" in inv["error"]["message"]
    assert "test_blocks.py:" in inv["error"]["message"]  # the line it was stopped at
    assert len(inv["tokens"]) == 12  # its request ran to its end; only its block was stopped
    for p, tokens in zip(prompts, alone, strict=True):
        got = ok(answers[p])["invokes"][0]
        assert got["error"] is None and got["tokens"] == tokens
    s = server.wait_stats(lambda s: s["in_flight"] == 0)
    for w in s["workers"]:
        assert w["requests"] == 0 and w["blocks"] == 0, w


def _good_requests(tok):
    torch.manual_seed(1)
    vec = torch.randn(128)
    return [
        ({"invokes": [{"prompt": PROMPT, "block": "steer", "args": {"layer": 2, "vec": vec, "scale": 2.0}}]}, True),
        ({"invokes": [{"prompt": "Hello world", "block": "logit_lens", "args": {"k": 2}}]}, False),
        (
            {
                "generate": True,
                "max_new_tokens": 8,
                "sampling": {"ignore_eos": True},
                "invokes": [{"prompt": "Once upon a time"}, {"prompt": "A", "block": "read_layer", "args": {"layer": 3}}],
            },
            True,
        ),
        ({"invokes": [{"prompt": tok("abc", add_special_tokens=False)["input_ids"], "block": "read_layer", "args": {"layer": 0}}]}, False),
        ({"invokes": [{"prompt": PROMPT, "code": _code(shipped_block, 1)}]}, True),
    ]  # fmt: skip


_BAD_REQUESTS = [
    (b'{"invokes": [{"prompt": "x", "block": "nope"}]}', ROOT_TOKEN, 422),
    (b'{"invokes": [{"prompt": "x"}', ROOT_TOKEN, 400),
    (b'{"invokes": [{"prompt": "x", "block": "read_layer", "args": {"layer": 1.5}}]}', ROOT_TOKEN, 422),
    (b'{"invokes": [{"prompt": "x"}]}', {"Authorization": "Bearer wrong"}, 401),
    (b'{"invokes": [{"prompt": "x", "code": "AAAA"}]}', ALICE, 403),
    (b'{"invokes": [{"prompt": "x", "block": "boom", "args": {"message": "bad"}}]}', ROOT_TOKEN, 200),
]


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def _sse(text):
    """(event, data) per server-sent event of a whole response body (``data`` as sent)."""
    out = []
    for chunk in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in chunk.split("\n"))
        out.append((fields.get("event", "message"), fields["data"]))
    return out


def _completion(prompt, stream):
    return {"model": "asyncpp-tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip


def _completion_text(r, stream):
    assert r.status_code == 200, r.text[:300]
    if not stream:
        return r.json()["choices"][0]["text"]
    events = _sse(r.text)
    assert events[-1] == ("message", "[DONE]")
    return "".join(json.loads(d)["choices"][0]["text"] for _, d in events[:-1] if json.loads(d)["choices"])


def _streamed_trace(r):
    """(the emitted values per invoke, each invoke's tokens from its tokens events, the done answer)."""
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text[:300]
    emitted, tokens, done = {}, {}, None
    for kind, data in _sse(r.text):
        d = wire.decode_json(data)
        if kind == "emit":
            emitted.setdefault(d["invoke"], []).append(d["value"])
        elif kind == "tokens":
            tokens.setdefault(d["invoke"], []).extend(d["tokens"])
        else:
            assert kind == "done" and done is None, (kind, d)
            done = d
    assert done is not None
    return emitted, tokens, done


@pytest.mark.timeout(120)
def test_64_concurrent_clients_mixing_completions_traces_streams_and_bad_requests(server, tiny):
    """64 clients at once: plain and streamed completions, traces, streamed traces and bad
    requests; every answer equals the same request's answer alone, every refusal is its own."""
    _, tok = tiny
    good = _good_requests(tok)
    alone = [ok(post(server, payload, binary=binary)) for payload, binary in good]
    prompts = ["Once upon a time", "The cat sat on the", "Hello world", "A b c"]
    texts = {
        (p, st): _completion_text(httpx.post(server.url + "/v1/completions", json=_completion(p, st),
                                             headers=ROOT_TOKEN, timeout=30), st)
        for p in prompts for st in (False, True)
    }  # fmt: skip
    streamed = {
        "generate": True, "max_new_tokens": 6, "sampling": {"ignore_eos": True}, "stream": True,
        "invokes": [{"prompt": "Hello", "block": "lens_stream", "args": {"k": 2}}, {"prompt": "A"}],
    }  # fmt: skip
    once = _streamed_trace(httpx.post(server.url + "/v1/trace", content=wire.encode_json(streamed),
                                      headers={**ROOT_TOKEN, **JSON}, timeout=30))  # fmt: skip
    assert len(once[0][0]) == 6 and [len(once[1][i]) for i in (0, 1)] == [6, 6]
    n_clients = 64

    async def client(i, http):
        kind = i % 4
        if kind == 0:  # a bad request of some kind
            body, headers, status = _BAD_REQUESTS[(i // 4) % len(_BAD_REQUESTS)]
            r = await http.post("/v1/trace", content=body, headers={**headers, **JSON})
            assert r.status_code == status, r.text[:300]
            if status == 200:
                inv = r.json()["invokes"][0]
                assert inv["error"] == {"type": "RuntimeError", "message": "bad"}
            else:
                assert set(r.json()["error"]) == {"type", "message"}
            return "bad"
        if kind == 1:  # a trace
            k = (i // 4) % len(good)
            payload, binary = good[k]
            body = wire.encode(payload) if binary else wire.encode_json(payload)
            r = await http.post(
                "/v1/trace", content=body, headers={**ROOT_TOKEN, **(BIN if binary else JSON)}
            )
            assert r.status_code == 200, r.text[:300]
            got = wire.decode_body(r.content, r.headers["content-type"])
            for a, b in zip(got["invokes"], alone[k]["invokes"], strict=True):
                assert a["error"] is None and a["tokens"] == b["tokens"] and a["text"] == b["text"]
                _same(a["result"], b["result"])
            return "trace"
        if kind == 2:  # a completion, plain or streamed
            p, st = prompts[(i // 4) % len(prompts)], (i // 4) % 2 == 1
            r = await http.post("/v1/completions", json=_completion(p, st), headers=ROOT_TOKEN)
            assert _completion_text(r, st) == texts[(p, st)]
            return "completion"
        r = await http.post("/v1/trace", content=wire.encode_json(streamed), headers={**ROOT_TOKEN, **JSON})
        emitted, tokens, done = _streamed_trace(r)
        _same(emitted, once[0])
        assert tokens == once[1]
        _same(done, once[2])
        return "stream"

    async def main():
        limits = httpx.Limits(max_connections=n_clients)
        async with httpx.AsyncClient(base_url=server.url, timeout=90, limits=limits) as http:
            return await asyncio.gather(*(client(i, http) for i in range(n_clients)))

    kinds = asyncio.run(main())
    assert sorted(set(kinds)) == ["bad", "completion", "stream", "trace"]
    assert all(kinds.count(k) == 16 for k in set(kinds))
    s = server.wait_stats(lambda s: s["in_flight"] == 0)
    assert s["in_flight"] == 0
    for w in s["workers"]:
        assert w["requests"] == 0 and w["blocks"] == 0, w


# --- the app mounted in a user's own ASGI app (uvicorn in a thread, on a LocalEngine) -----------------


def test_create_app_mounted_in_a_parent_app(local, tiny):
    from fastapi import FastAPI

    from asyncpp.serve.app import ServeLimits, create_app

    _, tok = tiny
    reg = Registry()

    @reg.block
    async def last_hidden(m, layer: int):
        """The HF layer output at the last position."""
        return (await m.model.layers[layer].output)[0, -1]

    parent = FastAPI()

    @parent.get("/mine")
    async def mine():
        return {"parent": True}

    parent.mount("/asyncpp", create_app(local, reg, limits=ServeLimits(max_invokes=2), model_name="tiny-hf"))
    config = uvicorn.Config(parent, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not srv.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.02)
        port = srv.servers[0].sockets[0].getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/mine").json() == {"parent": True}
        assert httpx.get(base + "/asyncpp/health").json() == {"status": "ok"}
        assert httpx.get(base + "/asyncpp/v1/blocks").json()["blocks"][0]["name"] == "last_hidden"
        body = wire.encode({"invokes": [{"prompt": PROMPT, "block": "last_hidden", "args": {"layer": 1}}]})
        r = httpx.post(base + "/asyncpp/v1/trace", content=body, headers=BIN, timeout=30)
        assert r.status_code == 200, r.text
        out = wire.decode(r.content)
        assert out["model"] == "tiny-hf"
        model, _ = tiny
        with torch.no_grad():
            ref = model(hf_ids(tok, PROMPT), output_hidden_states=True).hidden_states[2][0, -1]
        torch.testing.assert_close(out["invokes"][0]["result"], ref, rtol=0, atol=1e-6)
        # no code without allow_code, whatever the (absent) token; limits apply
        code = {"invokes": [{"prompt": PROMPT, "code": "AAAA"}]}
        refused(httpx.post(base + "/asyncpp/v1/trace", content=wire.encode_json(code), headers=JSON), 403)
        three = {"invokes": [{"prompt": "a"}] * 3}
        refused(httpx.post(base + "/asyncpp/v1/trace", content=wire.encode_json(three), headers=JSON), 400)
    finally:
        srv.should_exit = True
        thread.join(10)


def test_dead_engine_answers_503():
    from asyncpp.serve.app import create_app

    class DeadEngine:
        dead = True
        tokenizer = None

    async def main():
        transport = httpx.ASGITransport(app=create_app(DeadEngine()))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            r = await http.get("/health")
            assert r.status_code == 503 and r.json() == {"status": "dead"}
            r = await http.post("/v1/trace", content=b'{"invokes": [{"prompt": "x"}]}', headers=JSON)
            refused(r, 503, "EngineDeadError")

    asyncio.run(main())


# --- the command line -------------------------------------------------------------------------


def test_cli_splits_engine_options():
    from asyncpp.serve.cli import parse_args

    args, engine = parse_args(
        ["serve", "some/model", "--dtype", "float32", "--tensor-parallel-size", "2", "--port", "0",
         "--enforce-eager", "--blocks", "a.py", "--blocks=b", "--seed=-1", "--max-body-bytes", "10"]
    )  # fmt: skip
    assert args.model == "some/model" and args.port == 0 and args.blocks == ["a.py", "b"]
    assert args.max_body_bytes == 10 and args.host == "127.0.0.1" and not args.allow_code
    assert engine == {"dtype": "float32", "tensor_parallel_size": 2, "enforce_eager": True, "seed": -1}
    assert args.block_budget is None  # the default: 2 s, none on a tensor-parallel engine
    args, engine = parse_args(["--model", "m", "--kv-cache-gib", "0.5", "--block-budget", "0.5"])
    assert args.model == "m" and engine == {"kv_cache_gib": 0.5} and args.block_budget == 0.5


@pytest.mark.timeout(60)
def test_cli_refuses_a_public_host_without_tokens(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ASYNCPP_TOKENS"}
    r = subprocess.run(
        [sys.executable, "-m", "asyncpp.serve", "--host", "0.0.0.0", "--port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=50, env=env,
    )  # fmt: skip
    assert r.returncode == 2 and "refusing to serve on 0.0.0.0 without tokens" in r.stderr
    bad = tmp_path / "tokens.json"
    bad.write_text('{"tokens": [{"token": "t", "name": "a", "max_concurent": 3}]}')
    r = subprocess.run(
        [sys.executable, "-m", "asyncpp.serve", "--tokens", str(bad)],
        cwd=ROOT, capture_output=True, text=True, timeout=50, env=env,
    )  # fmt: skip
    assert r.returncode == 2 and "unknown keys ['max_concurent']" in r.stderr


def test_tokens_file_and_constant_time_lookup():
    from asyncpp.serve.auth import TokenError, Tokens

    toks = Tokens.from_data(
        {
            "tokens": [
                {"token": "a-1", "name": "a"},
                {"token": "b-2", "name": "b", "trusted": True, "max_invokes": 2},
            ]
        }
    )
    assert toks.authenticate("Bearer b-2").name == "b" and toks.authenticate("bearer  a-1 ").name == "a"
    assert toks.authenticate("Bearer b-") is None and toks.authenticate(None) is None
    assert toks.authenticate("b-2") is None and "b-2" not in repr(list(toks))
    for bad in (
        {"tokens": [{"token": "x", "name": "a"}, {"token": "x", "name": "b"}]},
        {"tokens": [{"token": "x", "name": "a"}, {"token": "y", "name": "a"}]},
        {"tokens": [{"token": "x", "name": "a", "trusted": "yes"}]},
        {"tokens": [{"token": "x", "name": "a", "max_concurrent": 0}]},
        {"tokens": [{"token": "x y", "name": "a"}]},
        {"tokens": []},
        {"tokenz": []},
    ):
        with pytest.raises(TokenError):
            Tokens.from_data(bad)


# --- last: shutdown (ends the module's server) ---------------------------------------------------


# --- the client: asyncpp.serve.RemoteEngine, the same trace API as a local engine ----------------


def _remote(server, headers=ROOT_TOKEN, **kw):
    return asyncpp.RemoteEngine(server.url, headers["Authorization"].split(" ", 1)[1], **kw)


@pytest.mark.parametrize("backend", [("asyncio", {}), ("asyncio", {"use_uvloop": True}), ("trio", {})],
                         ids=["asyncio", "uvloop", "trio"])  # fmt: skip
def test_remote_engine_traces_equal_the_protocols_answers(server, backend):
    import anyio

    torch.manual_seed(1)
    vec = torch.randn(128)
    raw = ok(post(server, {"invokes": [
        {"prompt": PROMPT, "block": "steer", "args": {"layer": 1, "vec": vec, "scale": 2.0}},
        {"prompt": PROMPT, "block": "read_layer", "args": {"layer": 2}},
    ]}, binary=True))["invokes"]  # fmt: skip

    async def main(remote):
        async with asyncpp.trace(remote) as t:
            a = t.invoke(PROMPT, "steer", layer=1, vec=vec, scale=2.0)
            b = t.invoke(PROMPT, "read_layer", 2)  # positional: matched to the block's parameters
        return a, b

    for binary in (True, False):
        remote = _remote(server, binary=binary)
        a, b = anyio.run(main, remote, backend=backend[0], backend_options=backend[1])
        torch.testing.assert_close(a.result, raw[0]["result"], **SAME)
        torch.testing.assert_close(b.result, raw[1]["result"], **SAME)
        assert a.tokens.tolist() == [raw[0]["tokens"]] and a.output == raw[0]["text"]
        assert a.name == "steer" and b.name == "read_layer"


def test_remote_engine_generate_and_sync_entry(server, tiny):
    model, tok = tiny
    remote = _remote(server)
    with asyncpp.generate(remote, max_new_tokens=5) as t:
        a = t.invoke(PROMPT, "read_layer", layer=1)
        b = t.invoke("Hello", "read_layer", layer=1)
    for text, h in ((PROMPT, a), ("Hello", b)):
        x = hf_ids(tok, text)
        with torch.no_grad():
            ref = model.generate(x, max_new_tokens=5, do_sample=False, pad_token_id=256)
        assert h.tokens.tolist() == ref[:, x.shape[1] :].tolist()
    assert [blk["name"] for blk in remote.blocks()][:3] == ["steer", "read_layer", "logit_lens"]
    # an invoke without a block ships no code: the untrusted token may send it
    with asyncpp.generate(_remote(server, ALICE), max_new_tokens=5) as t:
        c = t.invoke(PROMPT)
    assert c.result is None and c.tokens.tolist() == a.tokens.tolist()


def test_remote_engine_raises_errors_as_a_local_engine_would(server):
    remote = _remote(server)
    with pytest.raises(ValueError, match=r"takes the sampling options .*not \['logprobs'\]"):
        asyncpp.generate(remote, max_new_tokens=2, logprobs=3)  # refused where it is made
    with pytest.raises(RuntimeError, match="the block says no") as info:
        with asyncpp.trace(remote) as t:
            failing = t.invoke(PROMPT, "boom", message="the block says no")
            fine = t.invoke(PROMPT, "read_layer", layer=0)
    assert "asyncpp server" in "".join(getattr(info.value, "__notes__", []))
    assert isinstance(failing.exception, RuntimeError) and fine.result.shape == (128,)
    with pytest.raises(asyncpp.serve.BlockArgumentError, match="parameter 'layer'"):
        with asyncpp.trace(remote) as t:
            t.invoke(PROMPT, "steer", layer="one", vec=torch.zeros(128))
    with pytest.raises(asyncpp.serve.RemoteError) as info:
        with asyncpp.trace(asyncpp.RemoteEngine(server.url, "not-a-token")) as t:
            t.invoke(PROMPT, "read_layer", layer=0)
    assert info.value.status == 401
    with pytest.raises(asyncpp.AsyncppError, match="no block 'nope'"):
        with asyncpp.trace(remote) as t:
            t.invoke(PROMPT, "nope", 1)


def test_remote_engine_ships_code_only_for_a_trusted_token(server):
    async def own_block(m, layer):
        h = await m.model.layers[layer].output
        return (h[0] + h[1])[-1].norm().item()

    with asyncpp.trace(_remote(server)) as t:
        h = t.invoke(PROMPT, own_block, 1)
    with asyncpp.trace(_remote(server)) as t:
        ref = t.invoke(PROMPT, "read_layer", layer=1)
    assert h.result == pytest.approx(float(ref.result.norm()), rel=1e-5)
    with pytest.raises(asyncpp.serve.RemoteError) as info:
        with asyncpp.trace(_remote(server, ALICE)) as t:
            t.invoke(PROMPT, own_block, 1)
    assert info.value.status == 403


def test_zz_shutdown_finishes_in_flight_requests_and_closes_the_engine(server):
    answers = []
    slow = crawling(50, 0.02)  # about 1-2 s
    thread = threading.Thread(target=lambda: answers.append(post(server, slow)))
    thread.start()
    assert server.wait_stats(lambda s: s["in_flight"] >= 1)["in_flight"] >= 1
    server.proc.send_signal(signal.SIGTERM)
    thread.join(30)
    assert [a.status_code for a in answers] == [200], server.log_tail()
    assert answers[0].json()["invokes"][0]["result"] == 50
    rc = server.proc.wait(40)
    log = server.log_tail(20000)
    assert rc == 0, log[-3000:]
    assert "asyncpp: stopped" in log and "Traceback" not in log, log[-3000:]


@pytest.mark.timeout(180)
def test_the_embedding_example_serves_a_vllm_engine_inside_a_parent_app():
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "embed_in_asgi_app.py"), "--check", "--port", "0"],
        capture_output=True, text=True, timeout=170, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "GET /hello: {'app': 'mine'" in r.stdout
    assert "read_layer through the mounted app: shape (128,) tokens [[" in r.stdout
