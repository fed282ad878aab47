"""A vLLM engine whose worker dies: every trace fails at once with asyncpp's ``EngineDeadError``.

Each test starts an engine of its own (15-30 s) and kills one of its workers for real, with
SIGKILL, while a request is running in it. Eager engines only: a dead process is noticed by the
driver's watch of vLLM's processes, which is the same in either mode, and a compiled engine of
each kind would add a start per test (tests/vllm/test_vllm_compiled.py covers compiled failures
that are a block's own).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time

import pytest

import asyncpp

pytest.importorskip("vllm")


async def slow(m, marker):
    """A long request: writes ``marker`` once it runs in the worker, then steps slowly."""
    import pathlib
    import time

    async for step in m.steps():
        await m.model.layers[0].output
        if step == 0:
            pathlib.Path(marker).write_text("running")
        time.sleep(0.02)


async def quick(m):
    await m.model.layers[0].output
    return 1


def _kill_when_running(pid: int, marker: str, killed: dict) -> threading.Thread:
    def kill():
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # well inside the request (300 steps of 20 ms)
        killed["at"] = time.perf_counter()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(240)
@pytest.mark.parametrize("pp", [1, 2], ids=["pp1", "pp2"])
def test_a_killed_worker_fails_the_trace_and_every_later_one_at_once(pp, tmp_path):
    # pp2 kills the first stage's worker: the last stage's worker then waits for its tensors for
    # good, and vLLM alone took 9 s (5 s grace, SIGTERM, 4 s) to report its engine dead
    engine = asyncpp.VllmEngine(dtype="float32", pipeline_parallel_size=pp)
    try:
        pids = [s["pid"] for s in engine.worker_stats()]
        assert len(pids) == pp
        marker = str(tmp_path / "running")
        killed: dict = {}
        killer = _kill_when_running(pids[0], marker, killed)
        try:
            with asyncpp.generate(engine, max_new_tokens=300, ignore_eos=True) as t:
                t.invoke("Hello", slow, marker)
        except Exception as err:
            failure = err
        else:
            pytest.fail("the trace ran to its end although its worker was killed")
        killer.join()
        assert isinstance(failure, asyncpp.AsyncppError), f"{type(failure)}: {failure}"
        assert type(failure).__name__ == "EngineDeadError", f"{type(failure)}: {failure}"
        message = str(failure)
        assert f"vLLM worker rank 0 (pid {pids[0]}" in message, message
        assert "dead" in message and "create a new VllmEngine" in message, message
        if pp > 1:
            assert "pipeline stage 0" in message, message
        assert engine.dead

        # later traces, sync and async, and worker_stats fail at once with the same message
        with pytest.raises(asyncpp.EngineDeadError) as again:
            with asyncpp.trace(engine) as t:
                t.invoke("Hello", quick)
        assert str(again.value) == message

        async def traced():
            async with asyncpp.trace(engine) as t:
                t.invoke("Hello", quick)

        with pytest.raises(asyncpp.EngineDeadError) as again_async:
            asyncio.run(traced())
        assert str(again_async.value) == message
        with pytest.raises(asyncpp.EngineDeadError):
            engine.worker_stats()
    finally:
        engine.close()
    for pid in pids:  # every worker is gone (the survivors are stopped with the dead one)
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), pid


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.timeout(60)
def test_exit_status_of_a_process_that_has_just_ended():
    import subprocess
    import sys

    from asyncpp.engines.vllm.watch import exit_status

    exits = subprocess.Popen([sys.executable, "-c", "import os; os._exit(3)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    try:
        for proc in (exits, killed):  # not reaped yet: zombies whose status /proc still holds
            deadline = time.monotonic() + 30
            while not _zombie(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
        assert exit_status(exits.pid) == "exited with status 3"
        assert exit_status(killed.pid) == "killed by signal 9 (SIGKILL)"
    finally:
        exits.wait()
        killed.wait()
    assert exit_status(exits.pid) is None  # reaped: nothing to read any more


@pytest.mark.timeout(240)
def test_a_script_that_makes_its_engine_without_a_main_guard_is_told_to_add_one(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    script.write_text('import asyncpp\n\nengine = asyncpp.VllmEngine(mode="eager")\nengine.close()\n')
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    # the child vLLM spawned, which ran the script again, says what to do, naming the script
    assert 'under `if __name__ == "__main__":`' in out, out[-3000:]
    assert f"while {script} was imported to start one of vLLM's processes" in out, out[-3000:]
    # and the script's own process raises that error, not vLLM's "engine core failed"
    raised = [line for line in run.stderr.splitlines() if re.match(r"[\w.]+(Error|Exception): ", line)]
    assert raised and raised[-1].startswith("asyncpp.kernel.errors.AsyncppError: asyncpp.VllmEngine(...)")
