"""The driver's lifeline on real processes: a stand-in driver (`sleep`), a stand-in engine core
(a Python process) and, as its child, a process that runs `lifeline.watch_driver` as asyncpp's
worker does. When the driver ends, the engine core gets SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from asyncpp.engines.vllm import lifeline

pytestmark = pytest.mark.timeout(60)

# the engine core: starts the watcher as its child, prints the child's pid, then waits to be ended
CORE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(120)
"""
WATCHER = """
import time
from asyncpp.engines.vllm import lifeline
print("watching" if lifeline.watch_driver() else "nothing to watch", flush=True)
time.sleep(120)
"""


def _start(token: str) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, lifeline.ENV: token}
    core = subprocess.Popen([sys.executable, "-c", CORE, WATCHER], env=env, stdout=subprocess.PIPE, text=True)
    return core, int(core.stdout.readline())


def _stop(core: subprocess.Popen, watcher: int) -> None:
    for pid in (core.pid, watcher):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    core.wait(10)
    core.stdout.close()


def test_the_engine_core_is_ended_when_the_driver_is_killed():
    driver = subprocess.Popen(["sleep", "120"])
    core, watcher = _start(lifeline.driver_token(driver.pid))
    try:
        time.sleep(1.0)  # the watcher has started watching
        assert core.poll() is None
        driver.kill()
        driver.wait()
        assert core.wait(10) == -signal.SIGTERM
    finally:
        driver.kill()
        _stop(core, watcher)


def test_a_driver_already_gone_or_replaced_ends_the_engine_core_at_once():
    driver = subprocess.Popen(["sleep", "120"])
    token = lifeline.driver_token(driver.pid)
    boot, pid, started = token.rsplit(":", 2)
    replaced = f"{boot}:{pid}:{int(started) + 1}"  # the same pid, another process's start time
    core, watcher = _start(replaced)
    try:
        assert core.wait(10) == -signal.SIGTERM
    finally:
        driver.kill()
        driver.wait()
        _stop(core, watcher)
    core, watcher = _start(token)  # the driver is dead now
    try:
        assert core.wait(10) == -signal.SIGTERM
    finally:
        _stop(core, watcher)


def test_nothing_is_watched_for_a_driver_on_another_host_or_in_this_process():
    assert lifeline.watch_driver("") is None
    assert lifeline.watch_driver(lifeline.driver_token()) is None  # this process is the driver
    boot, pid, started = lifeline.driver_token(os.getppid()).rsplit(":", 2)
    assert lifeline.watch_driver(f"another-boot:{pid}:{started}") is None


PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(120)
"""
RAY_LIKE_WORKER = """
import time
from asyncpp.engines.vllm import lifeline
lifeline.watch_driver(parent_is_engine=False)
print("watching", flush=True)
time.sleep(120)
"""
ORPHANED_WORKER = """
import time
from asyncpp.engines.vllm import lifeline
lifeline.watch_parent()
print("watching", flush=True)
time.sleep(120)
"""


def _start_pair(child_code: str, token: str = "") -> tuple[subprocess.Popen, int]:
    env = {**os.environ, lifeline.ENV: token}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, child_code], env=env, stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "watching"  # (the child writes to its parent's stdout)
    return parent, child


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def test_a_worker_of_another_executor_ends_itself_not_its_parent():
    driver = subprocess.Popen(["sleep", "120"])
    parent, worker = _start_pair(RAY_LIKE_WORKER, lifeline.driver_token(driver.pid))
    try:
        driver.kill()
        driver.wait()
        assert _wait_gone(worker, 15)  # the worker ended itself
        assert parent.poll() is None  # its parent (a Ray raylet, say) is left alone
    finally:
        driver.kill()
        _stop(parent, worker)


def test_a_worker_ends_when_its_parent_does():
    parent, worker = _start_pair(ORPHANED_WORKER)
    try:
        parent.kill()
        parent.wait()
        assert _wait_gone(worker, 15)
    finally:
        _stop(parent, worker)
