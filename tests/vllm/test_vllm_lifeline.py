"""vLLM's processes end with the process that started the engine: a driver killed with SIGKILL
once its engine is up, and a server stopped with SIGTERM while its engine starts. Real engines
(eager, the tiny model) in their own sessions; every process left is SIGKILLed at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parents[2]

DRIVER = """
import time, asyncpp
if __name__ == "__main__":
    engine = asyncpp.VllmEngine(mode="eager", dtype="float32")
    print("ready", flush=True)
    time.sleep(300)
"""


def _session(pgid: int) -> list[tuple[int, str]]:
    """The live processes of session ``pgid`` (pid, command name): vLLM's keep the driver's."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[3]) == pgid and fields[0] != b"Z":
            found.append((int(entry), stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode()))
    return found


def _wait_gone(pgid: int, within: float) -> list[tuple[int, str]]:
    deadline = time.monotonic() + within
    while (left := _session(pgid)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return left


def _wait_for(pgid: int, name: str, within: float) -> None:
    deadline = time.monotonic() + within
    while not any(n.startswith(name) for _, n in _session(pgid)):
        assert time.monotonic() < deadline, f"no {name} process within {within} s"
        time.sleep(0.1)


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def test_a_killed_driver_takes_the_engine_core_and_workers_with_it(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"
        names = [n for _, n in _session(proc.pid)]
        assert any(n.startswith("VLLM::EngineCor") for n in names), names
        assert any(n.startswith("VLLM::Worker") for n in names), names
        proc.kill()
        proc.wait(10)
        assert _wait_gone(proc.pid, 40) == []
    finally:
        proc.stdout.close()
        _kill_session(proc)


def test_a_server_stopped_while_its_engine_starts_leaves_no_process(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncpp.serve", "--port", "0", "--dtype", "float32", "--enforce-eager"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        _wait_for(proc.pid, "VLLM::EngineCor", 60)  # vLLM's start is under way
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        assert _wait_gone(proc.pid, 40) == []
        text = log.read_text(errors="replace")
        assert "stopped while the engine was starting" in text, text[-2000:]
        # the server's own lines (vLLM's processes prefix theirs with "(Worker pid=...)", and may
        # log their own failed start): no traceback of the server itself
        assert not any(line.startswith("Traceback") for line in text.splitlines()), text[-3000:]
    finally:
        _kill_session(proc)
