"""A real `asyncpp serve` subprocess for the serving tests (the tiny model, float32, on 127.0.0.1),
with two tokens: `alice` (untrusted, small limits) and `root` (trusted)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
ALICE_SECRET = "alice-token-0123"
ROOT_SECRET = "root-token-4567"
TOKENS = {
    "tokens": [
        {"token": ALICE_SECRET, "name": "alice", "max_concurrent": 2, "max_new_tokens": 32, "max_invokes": 4},
        {"token": ROOT_SECRET, "name": "root", "trusted": True, "max_concurrent": 64},
    ]
}


# test-only blocks: one that raises, one that stalls the model thread, one that crawls through a
# generation unless it is aborted
FAILING_AND_SLOW_BLOCKS = '''
import time
from typing import Annotated

from asyncpp.serve import Range, block


@block
async def boom(m, message: str):
    """Raise RuntimeError(message) after the first layer."""
    await m.model.layers[0].output
    raise RuntimeError(message)


@block
async def stall(m, seconds: Annotated[float, Range(0, 60)]):
    """Sleep once on the model thread, after the first layer (the server's block budget stops it)."""
    await m.model.layers[0].output
    time.sleep(seconds)
    return "woke"


@block
async def crawl(m, per_step: Annotated[float, Range(0, 1)]):
    """Sleep at every generation step: a generation that takes long unless it is aborted."""
    n = 0
    async for _ in m.steps():
        await m.logits
        time.sleep(per_step)
        n += 1
    return n
'''


class Server:
    """A running server: its process, base URL and log."""

    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stats(self) -> dict:
        r = httpx.get(self.url + "/v1/stats", headers={"Authorization": f"Bearer {ROOT_SECRET}"}, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_stats(self, pred, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if pred(s) or time.monotonic() > deadline:
                return s
            time.sleep(0.05)


def start_server(
    directory: Path, test_blocks: str, *options: str, cls: type = Server, ready_s: float = 180
) -> Iterator[Server]:
    """Start the server with examples/serve_blocks.py and ``test_blocks`` (module source), wait until
    it is ready (at most ``ready_s``), yield it, and stop it (SIGTERM, then SIGKILL): a fixture's
    body, ``yield from``."""
    tokens = directory / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    blocks = directory / "test_blocks.py"
    blocks.write_text(test_blocks)
    log = directory / "server.log"
    cmd = [
        sys.executable, "-m", "asyncpp.serve", "--port", "0", "--dtype", "float32",
        "--blocks", str(ROOT / "examples" / "serve_blocks.py"), "--blocks", str(blocks),
        "--tokens", str(tokens), *options,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "ASYNCPP_TOKENS"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = None
    deadline = time.monotonic() + ready_s
    try:
        while url is None:
            text = log.read_text(errors="replace")
            for line in text.splitlines():
                if line.startswith("asyncpp: serving ") and " on http://" in line:
                    url = line.split(" on ", 1)[1].strip()
            if proc.poll() is not None:
                pytest.fail(f"the server exited ({proc.returncode}) before it was ready:\n{text[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"the server was not ready within {ready_s:.0f} s:\n{text[-3000:]}")
            time.sleep(0.2)
        assert url.startswith("http://127.0.0.1:")
        yield cls(proc, url, log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
