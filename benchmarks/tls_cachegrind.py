"""What the torch thread-local-state swap adds to a tiny-Llama forward trace, counted by callgrind.

Timing the trace with the swap on and off (benchmarks/tls_switch.py) cannot resolve a few
microseconds on a 2 ms trace on this VM. Valgrind's callgrind counts instead: instructions executed
and misses of its simulated caches (32 KiB L1 instruction and data caches, a large last level).
Two processes differ by themselves (the hash seed and the heap layout decide which Python
type-cache entries and cache sets collide: thousands of instructions per trace), so one process
under callgrind (`PYTHONHASHSEED=0`) runs both modes, in phases: on, off, off, on (`--cycles`
times), `--traces` forward traces each of a block that reads every layer's output (10 switches
per trace), after one untimed trace. Instrumentation is on
only during a phase's traces (`callgrind_control -i on` / `-i off`) and each phase is dumped
on its own; per mode, the median of its phases, per trace.

Printed per trace: the totals' difference (on - off), and the part inside the swap's own functions
(`fingerprint`, `enter_impl`, `leave_impl`, `state_fork`, `state_dealloc`) in the on phases.
The part inside the swap is what it does itself, and repeats exactly from run to run. The totals
of a phase move by far more than that from phase to phase within one process, with or without
the swap (the spread is shown): the MKL matrix kernels, most of a trace's instructions, take
paths that depend on where tensors land, and one-off events fall into some phases. So the totals'
difference says only how far on and off stay within that spread; what the swap costs the code
around it (the calls into it, the objects it allocates and frees, the cache lines it displaces)
is below what this can resolve.

Usage (needs valgrind; about 4 minutes)::

    .venv/bin/python benchmarks/tls_cachegrind.py [--traces 10] [--cycles 3] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import bench_common

SECTION = "## Thread-local-state swap, counted (benchmarks/tls_cachegrind.py)"
EVENTS = ("Ir", "I1mr", "D1mr", "D1mw", "DLmr")
SWAP_FUNCTIONS = ("fingerprint()", "enter_impl(", "leave_impl(", "state_fork(", "state_dealloc(")

CHILD = """
import os, sys, time
import torch
torch.set_num_threads(1)
import asyncpp
from asyncpp.native import load
from asyncpp.models import load_tiny
native = load()
llama, tok = load_tiny()
llama.eval()
engine = asyncpp.LocalEngine(llama, tok)
ids = tok("Hello world", return_tensors="pt")["input_ids"]
flag, traces, phases = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")

async def block(m):
    for layer in m.model.layers:
        await layer.output

def run():
    with asyncpp.trace(engine, grad=False) as t:
        t.invoke(ids, block)

def signal(name):
    open(flag + name, "w").close()

def wait(name):
    while not os.path.exists(flag + name):
        time.sleep(0.05)

for mode in ("on", "off"):
    engine._switch = native if mode == "on" else None
    for _ in range(5):
        run()
signal(".ready")
for i, mode in enumerate(phases):
    engine._switch = native if mode == "on" else None
    run()  # untimed: the first trace after the switch is changed
    wait(f".go{i}")
    for _ in range(traces):
        run()
    signal(f".done{i}")
"""


def _wait(path: Path, proc: subprocess.Popen) -> None:
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the callgrind run ended early (exit {proc.returncode})")
        time.sleep(0.5)


def run_phases(phases: list[str], traces: int, work: Path) -> list[Path]:
    """One callgrind process running ``traces`` traces per phase (swap "on"/"off"), counting each
    phase on its own (instrumentation on for the phase's traces only, then dumped); returns the
    phases' profiles."""
    script = work / "child.py"
    script.write_text(CHILD)
    out = work / "callgrind.out"
    flag = work / "flag"
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    cmd = ["valgrind", "--tool=callgrind", "--cache-sim=yes", "--instr-atstart=no"]
    cmd += [
        f"--callgrind-out-file={out}",
        sys.executable,
        str(script),
        str(flag),
        str(traces),
        ",".join(phases),
    ]

    def control(*args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(proc.pid)], check=True, capture_output=True)

    with open(work / "callgrind.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait(Path(f"{flag}.ready"), proc)
            control("--zero")
            for i in range(len(phases)):
                control("-i", "on")
                Path(f"{flag}.go{i}").touch()
                _wait(Path(f"{flag}.done{i}"), proc)
                control("-i", "off")
                control("--dump")
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
    dumps = sorted(work.glob("callgrind.out.*"), key=lambda p: int(p.suffix[1:]))
    if len(dumps) < len(phases):
        raise RuntimeError(f"callgrind wrote {len(dumps)} dumps for {len(phases)} phases")
    return dumps[-len(phases) :]


def read_profile(path: Path) -> tuple[dict[str, int], dict[str, int]]:
    """(totals, the swap's own functions summed) per event, from callgrind_annotate."""
    text = subprocess.run(
        ["callgrind_annotate", "--threshold=100", f"--show={','.join(EVENTS)}", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    totals: dict[str, int] = {}
    swap = dict.fromkeys(EVENTS, 0)
    for line in text.splitlines():
        fields = re.sub(r"\([^)]*%\)", "", line).split()
        if len(fields) <= len(EVENTS):
            continue
        try:
            values = [0 if v == "." else int(v.replace(",", "")) for v in fields[: len(EVENTS)]]
        except ValueError:
            continue
        name = " ".join(fields[len(EVENTS) :])
        if "PROGRAM TOTALS" in name:
            totals = dict(zip(EVENTS, values, strict=True))
        elif "asyncpp_native" in name and any(f in name for f in SWAP_FUNCTIONS):
            for e, v in zip(EVENTS, values, strict=True):
                swap[e] += v
    return totals, swap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=int, default=10, help="traces counted per phase (default 10)")
    ap.add_argument("--cycles", type=int, default=3, help="on-off-off-on cycles of phases (default 3)")
    ap.add_argument("--write", action="store_true", help="update docs/performance.md")
    args = ap.parse_args()
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        print("valgrind (callgrind) is not installed: nothing to measure")
        return 1
    import torch

    torch.set_num_threads(1)  # as in the measured process
    info = bench_common.machine_info()
    t0 = time.perf_counter()
    phases = ["on", "off", "off", "on"] * args.cycles  # ABBA: drifts over the run cancel
    with tempfile.TemporaryDirectory() as tmp:
        profiles = [read_profile(p) for p in run_phases(phases, args.traces, Path(tmp))]

    def per_trace(mode: str, part: int) -> dict[str, float]:
        """The median over the mode's phases (one-off events in a phase do not move it)."""
        return {
            e: median(p[part][e] for p, m in zip(profiles, phases, strict=True) if m == mode) / args.traces
            for e in EVENTS
        }

    on, off = (per_trace("on", 0), per_trace("on", 1)), (per_trace("off", 0), per_trace("off", 1))
    names = {
        "Ir": "instructions",
        "I1mr": "L1 instruction misses",
        "D1mr": "L1 data read misses",
        "D1mw": "L1 data write misses",
        "DLmr": "last-level data read misses",
    }

    def spread(mode: str, e: str) -> float:
        values = [p[0][e] for p, m in zip(profiles, phases, strict=True) if m == mode]
        return (max(values) - min(values)) / args.traces

    rows = []
    for e in EVENTS:
        added = on[0][e] - off[0][e]
        rows.append(
            [
                names[e],
                f"{off[0][e]:,.0f} (phases spread over {spread('off', e):,.0f})",
                f"{on[0][e]:,.0f} (phases spread over {spread('on', e):,.0f})",
                f"{added:+,.0f}",
                f"{on[1][e]:,.0f} ({on[1][e] / 10:,.0f} per switch)",
            ]
        )
    table = bench_common.md_table(
        [
            "per trace",
            "swap off: median of phases",
            "swap on: median of phases",
            "on - off",
            "inside the swap's functions",
        ],
        rows,
    )
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = "\n".join(f"- {k}: {v}" for k, v in info.items())
    doc = __doc__.split("Usage")[0].split("\n\n", 1)[1].strip()
    text = f"""{SECTION}

{doc}

Command: `{bench_common.command_line(__file__)}` ({date}; {time.perf_counter() - t0:.0f} s)

{machine}

{table}
"""
    print(text)
    if args.write:
        bench_common.write_section(SECTION, text)
        print("updated docs/performance.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
