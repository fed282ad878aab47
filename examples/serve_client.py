"""A client of `asyncpp serve`: traces with the same API as a local engine, a streamed logit lens
with its tokens, and the OpenAI-compatible routes.

Start a server with the example blocks, then run this against it:

    .venv/bin/asyncpp serve --blocks examples/serve_blocks.py          # prints its URL when ready
    .venv/bin/python examples/serve_client.py [http://127.0.0.1:8000] [TOKEN]

The client sends data only (block names and typed arguments; tensors as safetensors): nothing it
receives is unpickled, and nothing it sends is code.
"""

from __future__ import annotations

import asyncio
import sys

import httpx
import torch

import asyncpp


async def main(url: str, token: str | None) -> None:
    remote = asyncpp.RemoteEngine(url, token)
    print("blocks:", ", ".join(b["name"] for b in remote.blocks()))

    # a trace: several invokes, registered blocks named with their arguments
    vec = torch.randn(await hidden_size(remote)) * 4.0
    async with asyncpp.trace(remote) as t:
        plain = t.invoke("The cat sat on the", "read_layer", layer=1)
        steered = t.invoke("The cat sat on the", "steer", layer=1, vec=vec)
    print(f"layer-1 residual at the last token: norm {plain.result.norm():.3f}")
    print(f"steered next-token logits: top id {int(steered.result.argmax())}")

    # a streamed generation: the logit lens at every step, and each step's token, as they are made
    async with asyncpp.generate(remote, max_new_tokens=6, ignore_eos=True) as t:
        h = t.invoke("Once upon a time", "lens_stream", k=1)
        async for ev in h.events():
            if ev.kind == "emit":
                lens = [top[0] for top in ev.value["lens"]]
                print(f"step {ev.value['step']}: top token per layer {lens}")
            else:
                print(f"  sampled {ev.value}")
    print("tokens:", h.tokens[0].tolist())

    # the OpenAI-compatible routes answer any OpenAI client (here plain HTTP)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        r = await http.post(
            "/v1/completions",
            json={"model": model, "prompt": "Hello", "max_tokens": 5, "temperature": 0,
                  "asyncpp": {"block": "read_layer", "args": {"layer": 0}}},
        )  # fmt: skip
        r.raise_for_status()
        answer = r.json()
        print(f"completion: {answer['choices'][0]['text']!r}; block error: {answer['asyncpp']['error']}")


async def hidden_size(remote: asyncpp.RemoteEngine) -> int:
    """The served model's hidden size: the length of one residual-stream read."""
    async with asyncpp.trace(remote) as t:
        h = t.invoke("x", "read_layer", layer=0)
    return int(h.result.shape[-1])


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000", *sys.argv[2:3] or [None]))
