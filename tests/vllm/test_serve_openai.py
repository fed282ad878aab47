"""OpenAI-compatible generation on `asyncpp serve`, through the `openai` client, over real HTTP.

One server subprocess (vLLM, the embedded tiny model, float32) for the module, with two tokens:
`alice` (max_concurrent 2, max_new_tokens 32) and `root`. Greedy tokens are checked against
Hugging Face's greedy generation on the same checkpoint, in this process. The server's engine is
eager (these routes are vLLM's own, over the engine's `AsyncLLM`, in either mode; test_serve_stream.py
serves a compiled engine, and test_vllm_compiled.py checks compiled greedy tokens against stock vLLM).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from serve_helpers import ALICE_SECRET, FAILING_AND_SLOW_BLOCKS, ROOT_SECRET, Server, start_server

from asyncpp.serve import wire

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.timeout(240)  # the first test also waits for the server (compiled: 20-90 s)

ROOT = Path(__file__).resolve().parents[2]
MODEL = "asyncpp-tiny-llama"
ALICE = ALICE_SECRET
ROOT_TOKEN = ROOT_SECRET
PROMPT = "The cat sat on the"
TEST_BLOCKS = FAILING_AND_SLOW_BLOCKS


class OpenAIServer(Server):
    def client(self, token: str = ROOT_TOKEN, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=token, max_retries=0, timeout=30, **kw)

    def aclient(self, token: str = ROOT_TOKEN) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=token, max_retries=0, timeout=30)

    def wait_idle(self, timeout: float = 10.0) -> dict:
        def idle(s: dict) -> bool:
            return s["in_flight"] == 0 and all(w["requests"] == 0 for w in s["workers"])

        return self.wait_stats(idle, timeout)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from start_server(tmp_path_factory.mktemp("serve_openai"), TEST_BLOCKS, cls=OpenAIServer)


def hf_greedy(tiny, prompt_ids: list[int], n: int) -> list[int]:
    model, _tok = tiny
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def block_args(**kw) -> dict:
    return json.loads(wire.encode_json(kw))


def complete(client, n=8, **kw):
    extra = kw.pop("extra_body", {})
    return client.completions.create(
        model=MODEL, prompt=kw.pop("prompt", PROMPT), max_tokens=n, temperature=0,
        extra_body={"return_token_ids": True, **extra}, **kw,
    )  # fmt: skip


def test_models_and_auth(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        server.client("nope").models.list()
    with pytest.raises(openai.AuthenticationError):
        complete(server.client("nope"))
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="other-model", prompt=PROMPT, max_tokens=2)


def test_greedy_completion_matches_hf(server, tiny):
    _model, tok = tiny
    r = complete(server.client(), n=12)
    choice = r.choices[0]
    assert r.model == MODEL and choice.finish_reason == "length" and r.usage.completion_tokens == 12
    assert choice.prompt_token_ids == tok(PROMPT)["input_ids"]
    assert choice.token_ids == hf_greedy(tiny, choice.prompt_token_ids, 12)
    # (the text: these byte tokens are not valid UTF-8 alone, and vLLM's detokenizer holds them back)
    assert isinstance(choice.text, str)
    assert "asyncpp" not in (r.model_extra or {})  # no block: no asyncpp field


def test_streamed_completion_equals_unstreamed(server):
    client = server.client()
    whole = complete(client, n=10, prompt="Once upon a time")
    chunks = list(complete(client, n=10, prompt="Once upon a time", stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])]
    assert text == whole.choices[0].text
    assert ids == whole.choices[0].token_ids
    assert chunks[-1].choices[0].finish_reason == "length"


def test_async_client_concurrent(server):
    async def main():
        client = server.aclient()
        alone = [complete(server.client(), n=6, prompt=p).choices[0].token_ids for p in ("a b", "c d e")]
        outs = await asyncio.gather(
            *(
                client.completions.create(
                    model=MODEL, prompt=p, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
                )
                for p in ("a b", "c d e") * 4
            )
        )
        assert [o.choices[0].token_ids for o in outs] == alone * 4
        stream = await client.completions.create(
            model=MODEL, prompt="a b", max_tokens=6, temperature=0, stream=True
        )
        text = "".join([c.choices[0].text async for c in stream if c.choices])
        assert text == outs[0].choices[0].text
        await client.close()

    asyncio.run(main())


def test_chat_completion(server):
    """The tiny tokenizer has no chat template: the server uses asyncpp's plain fallback one."""
    client = server.client()
    msgs = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 6
    prompt = complete(client, n=6, prompt="user: hello there\nassistant:")
    assert r.choices[0].message.content == prompt.choices[0].text  # what the template renders
    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r.choices[0].message.content


def test_block_result_and_steering(server, tiny):
    client = server.client()
    plain = complete(client, n=8)
    torch.manual_seed(0)
    vec = torch.randn(128)
    steer = {"asyncpp": {"block": "steer", "args": block_args(layer=1, vec=vec, scale=8.0)}}
    r = complete(client, n=8, extra_body=steer)
    out = r.model_extra["asyncpp"]
    assert out["block"] == "steer" and out["error"] is None
    logits = wire.decode_json(json.dumps(out["result"]))
    assert logits.shape == (len(tiny[1]),) and logits.dtype == torch.float32
    assert logits.argmax().item() == r.choices[0].token_ids[0]
    assert r.choices[0].token_ids != plain.choices[0].token_ids  # the steering changed the tokens
    zero = {"asyncpp": {"block": "steer", "args": block_args(layer=1, vec=torch.zeros(128))}}
    assert complete(client, n=8, extra_body=zero).choices[0].token_ids == plain.choices[0].token_ids
    # streamed: the outcome comes as one last chunk without choices
    chunks = list(complete(client, n=8, stream=True, extra_body=steer))
    last = chunks[-1]
    assert last.choices == [] and last.model_extra["asyncpp"]["error"] is None
    assert torch.equal(wire.decode_json(json.dumps(last.model_extra["asyncpp"]["result"])), logits)
    ids = [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])]
    assert ids == r.choices[0].token_ids
    # chat with a block
    c = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        extra_body={"asyncpp": {"block": "read_layer", "args": {"layer": 2}}},
    )  # fmt: skip
    res = c.model_extra["asyncpp"]
    assert res["error"] is None and wire.decode_json(json.dumps(res["result"])).shape == (128,)
    assert server.wait_idle()["in_flight"] == 0


def test_streamed_answers_carry_emitted_values_as_they_come(server):
    client = server.client()
    lens = {
        "asyncpp": {"block": "lens_stream", "args": {"k": 1}},
        "return_token_ids": True,
        "ignore_eos": True,
    }
    chunks = list(complete(client, n=6, stream=True, extra_body=lens))
    final = chunks[-1].model_extra["asyncpp"]
    assert final["error"] is None and final["result"] == 6
    # before each token chunk, a chunk without choices with the values emitted meanwhile
    order, live = [], []
    for c in chunks[:-1]:
        extra = (c.model_extra or {}).get("asyncpp")
        if extra is not None:
            assert c.choices == [] and set(extra) == {"emitted"}
            live += extra["emitted"]
            order += [("emit", v["step"], v["logits"][0]) for v in extra["emitted"]]
        for t in c.choices[0].token_ids or [] if c.choices else []:
            order.append(("token", sum(e[0] == "token" for e in order), t))
    assert live == final["emitted"] and [v["step"] for v in live] == list(range(6))
    # the lens' top-1 of step k (the model's own logits) is the token sampled at step k, and it comes
    # before it (step k+1's value may come before step k's token: vLLM overlaps the two)
    tokens = [e[2] for e in order if e[0] == "token"]
    assert tokens == [v["logits"][0] for v in live]
    for k in range(6):
        assert order.index(("emit", k, tokens[k])) < order.index(("token", k, tokens[k])), order
    # chat, streamed: the same extra chunks
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0, stream=True,
        extra_body={"asyncpp": {"block": "lens_stream", "args": {"k": 1}}},
    )  # fmt: skip
    extras = [(c.model_extra or {}).get("asyncpp") for c in stream]
    got = [v for e in extras if e is not None and "result" not in e for v in e["emitted"]]
    assert [v["step"] for v in got] == [0, 1, 2]
    assert server.wait_idle()["in_flight"] == 0


def test_block_errors(server):
    client = server.client()
    r = complete(client, n=4, extra_body={"asyncpp": {"block": "boom", "args": {"message": "kaput"}}})
    assert r.model_extra["asyncpp"]["error"] == {"type": "RuntimeError", "message": "kaput"}
    assert len(r.choices[0].token_ids) == 4  # the request itself still generated
    with pytest.raises(openai.UnprocessableEntityError, match="nosuch"):
        complete(client, extra_body={"asyncpp": {"block": "nosuch"}})
    with pytest.raises(openai.UnprocessableEntityError):
        complete(client, extra_body={"asyncpp": {"block": "read_layer", "args": {"layer": "two"}}})
    with pytest.raises(openai.PermissionDeniedError):
        complete(client, extra_body={"asyncpp": {"code": "AAAA"}})
    with pytest.raises(openai.BadRequestError):
        complete(client, extra_body={"asyncpp": {"block": "read_layer", "args": {"layer": 1}}, "n": 2})
    # a client's vllm_xargs never reach asyncpp's keys: no block runs, nothing breaks
    r = complete(client, n=4, extra_body={"vllm_xargs": {"asyncpp": "x", "asyncpp_id": "y"}})
    assert len(r.choices[0].token_ids) == 4
    assert server.wait_idle()["in_flight"] == 0


def test_limits(server):
    alice = server.client(ALICE)
    with pytest.raises(openai.BadRequestError, match="limit of 32"):
        complete(alice, n=33)
    r = alice.completions.create(model=MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 32  # no max_tokens: the token's limit
    with pytest.raises(openai.BadRequestError):
        alice.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=64)
    crawl = {"asyncpp": {"block": "crawl", "args": {"per_step": 0.1}}}

    async def main():
        client = server.aclient(ALICE)
        slow = [
            asyncio.ensure_future(
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, extra_body=crawl)
            )
            for _ in range(2)
        ]
        await asyncio.sleep(0.5)
        with pytest.raises(openai.RateLimitError):
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        outs = await asyncio.gather(*slow)
        assert [o.model_extra["asyncpp"]["result"] for o in outs] == [o.usage.completion_tokens for o in outs]
        await client.close()

    asyncio.run(main())


def test_disconnect_aborts(server):
    """A client that goes away mid-generation aborts its request (streamed or not)."""
    crawl = {"asyncpp": {"block": "crawl", "args": {"per_step": 0.2}}}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, **crawl}
    headers = {"Authorization": f"Bearer {ROOT_TOKEN}"}
    before = server.stats()["aborted"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=1.0)
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=headers, timeout=10
    ) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    s = server.wait_idle(timeout=15)
    assert s["in_flight"] == 0 and all(w["requests"] == 0 and w["blocks"] == 0 for w in s["workers"]), s
    assert s["aborted"] >= before + 1
    assert len(complete(server.client(), n=3).choices[0].token_ids) == 3
