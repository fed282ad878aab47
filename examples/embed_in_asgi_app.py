"""asyncpp's server inside your own ASGI application: your routes and asyncpp's, one process.

`create_app(engine, registry)` returns asyncpp's FastAPI app for an engine; mount it wherever you
like. The engine belongs to your application: open it when the app starts, close it when it stops
(here in the parent app's lifespan). Run it:

    .venv/bin/python examples/embed_in_asgi_app.py              # serves on 127.0.0.1:8001
    .venv/bin/python examples/embed_in_asgi_app.py --check      # starts, makes two requests, exits

Then `asyncpp.RemoteEngine("http://127.0.0.1:8001/asyncpp")` talks to the mounted app.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI

import asyncpp
from asyncpp.serve import ServeLimits, create_app, load_module

HERE = Path(__file__).resolve().parent


def build_app() -> FastAPI:
    """Your application, with asyncpp's app mounted at /asyncpp on a vLLM engine."""
    holder: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(parent: FastAPI):
        engine = holder["engine"] = asyncpp.VllmEngine(dtype="float32")  # the embedded tiny model
        blocks = load_module(str(HERE / "serve_blocks.py"))
        parent.mount("/asyncpp", create_app(engine, blocks, limits=ServeLimits(max_concurrent=8)))
        try:
            yield
        finally:
            engine.close()

    parent = FastAPI(lifespan=lifespan)

    @parent.get("/hello")
    async def hello() -> dict:
        return {"app": "mine", "asyncpp": "mounted at /asyncpp"}

    return parent


async def check(base: str) -> None:
    """What a client of the mounted app sees: your route, and a trace through RemoteEngine."""
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        print("GET /hello:", (await http.get("/hello")).json())
    remote = asyncpp.RemoteEngine(base + "/asyncpp")
    async with asyncpp.trace(remote) as t:
        h = t.invoke("The cat sat on the", "read_layer", layer=1)
    print("read_layer through the mounted app: shape", tuple(h.result.shape), "tokens", h.tokens.tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8001, help="0: any free port")
    parser.add_argument("--check", action="store_true", help="start, make two requests, stop")
    args = parser.parse_args()
    config = uvicorn.Config(build_app(), host="127.0.0.1", port=args.port, log_level="warning")
    server = uvicorn.Server(config)
    if not args.check:
        server.run()
        return

    async def run_and_check() -> None:
        serving = asyncio.create_task(server.serve())
        while not server.started:
            if serving.done():
                serving.result()  # (raises what stopped it)
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]  # (the one picked, with --port 0)
        try:
            await check(f"http://127.0.0.1:{port}")
        finally:
            server.should_exit = True
            await serving

    asyncio.run(run_and_check())


if __name__ == "__main__":
    main()
