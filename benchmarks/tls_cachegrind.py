"""What the torch thread-local-state swap adds to a tiny-Llama forward trace, counted by callgrind.

Timing the trace with the swap on and off (benchmarks/tls_switch.py) cannot resolve a few
microseconds on a 2 ms trace on this VM. Valgrind's callgrind counts instead: instructions executed
and misses of its simulated caches (32 KiB L1 instruction and data caches, a large last level).
Two processes differ by themselves (the hash seed and the heap layout decide which Python
type-cache entries and cache sets collide), so one process under callgrind (`PYTHONHASHSEED=0`)
runs both modes, in phases: on, off, off, on (`--cycles` times), `--traces` forward traces each
of a block that reads every layer's output (10 switches per trace), after one untimed trace.
The process itself starts and stops the counting around each phase's traces and dumps each phase
on its own (callgrind's client requests, from a small helper the script compiles against
valgrind's headers), so every phase counts exactly its traces; per mode, the mean of its
phases, per trace. Phases of one mode then agree to about 0.1% of their instructions, which
resolves the swap's whole cost: what it does itself and what it costs the code around it (the
calls into it, the Python code that sets it up, the cache lines it displaces).

Printed per trace: the totals' difference (on - off) with the phases' spread, and where the
difference lies, by library (the swap's own functions, the rest of asyncpp's extension, the
Python interpreter, torch, the C runtime including the dynamic loader's thread-local lookups).
The part inside the swap's own functions (`fingerprint`, `switch_in`, `switch_out` and their
slow paths, `state_fork`, `state_dealloc`) repeats exactly from run to run.

Usage (needs valgrind and a C compiler; about 4 minutes)::

    .venv/bin/python benchmarks/tls_cachegrind.py [--traces 10] [--cycles 2] [--write]
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
from collections import defaultdict
from pathlib import Path
from statistics import mean

import bench_common

SECTION = "## Thread-local-state swap, counted (benchmarks/tls_cachegrind.py)"
EVENTS = ("Ir", "I1mr", "D1mr", "D1mw", "DLmr")
SWAP_FUNCTIONS = (
    "fingerprint(",
    "switch_in(",
    "switch_out(",
    "enter_",
    "leave_",
    "adopt_thread_state(",
    "state_fork(",
    "state_dealloc(",
)
SWITCHES_PER_TRACE = 10

# callgrind's client requests, callable from Python through ctypes
HELPER = """
#include <valgrind/callgrind.h>
void cg_begin(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void cg_end(const char* name) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT(name); }
"""

CHILD = """
import ctypes, gc, sys
import torch
torch.set_num_threads(1)
import asyncpp
from asyncpp.native import load
from asyncpp.models import load_tiny
cg = ctypes.CDLL(sys.argv[1])
native = load()
llama, tok = load_tiny()
llama.eval()
engine = asyncpp.LocalEngine(llama, tok)
ids = tok("Hello world", return_tensors="pt")["input_ids"]
traces, phases = int(sys.argv[2]), sys.argv[3].split(",")

async def block(m):
    for layer in m.model.layers:
        await layer.output

def run():
    with asyncpp.trace(engine, grad=False) as t:
        t.invoke(ids, block)

for mode in ("on", "off"):
    engine._switch = native if mode == "on" else None
    for _ in range(5):
        run()
gc.collect()
gc.disable()  # a collection would fall into some phases and not others
for i, mode in enumerate(phases):
    engine._switch = native if mode == "on" else None
    run()  # uncounted: the first trace after the switch is changed
    cg.cg_begin()
    for _ in range(traces):
        run()
    cg.cg_end(f"phase {i} ({mode})".encode())
"""

# where the difference lies: the first group whose pattern the function's name or object file matches
GROUPS = (
    ("the swap's own functions", lambda n: "asyncpp_native" in n and any(f in n for f in SWAP_FUNCTIONS)),
    ("the rest of asyncpp's extension", lambda n: "asyncpp_native" in n),
    ("Python interpreter", lambda n: "libpython" in n),
    ("torch (libtorch_cpu, libc10, libtorch_python)", lambda n: "libtorch" in n or "libc10" in n),
    ("C runtime (libc, libstdc++, dynamic loader)", lambda n: re.search(r"libc\.so|libstdc|ld-linux", n)),
    ("other", lambda n: True),
)


def build_helper(work: Path) -> Path:
    src, lib = work / "cg_helper.c", work / "cg_helper.so"
    src.write_text(HELPER)
    cc = shutil.which("cc") or shutil.which("gcc") or "cc"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def run_phases(phases: list[str], traces: int, work: Path) -> list[Path]:
    """One callgrind process running ``traces`` traces per phase (swap "on"/"off"), counting each
    phase on its own; returns the phases' profiles, in order."""
    helper = build_helper(work)
    script = work / "child.py"
    script.write_text(CHILD)
    out = work / "callgrind.out"
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    cmd = ["valgrind", "--tool=callgrind", "--cache-sim=yes", "--instr-atstart=no"]
    cmd += [f"--callgrind-out-file={out}", sys.executable, str(script), str(helper), str(traces)]
    cmd.append(",".join(phases))
    with open(work / "callgrind.log", "w") as log:
        done = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the callgrind run failed (exit {done.returncode}); see {work / 'callgrind.log'}")
    dumps = sorted(work.glob("callgrind.out.*"), key=lambda p: int(p.suffix[1:]))
    if len(dumps) < len(phases):
        raise RuntimeError(f"callgrind wrote {len(dumps)} dumps for {len(phases)} phases")
    return dumps[-len(phases) :]


def read_profile(path: Path) -> dict[str, dict[str, int]]:
    """Per event: the phase's total and its part in each group, from callgrind_annotate."""
    text = subprocess.run(
        ["callgrind_annotate", "--threshold=100", f"--show={','.join(EVENTS)}", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    parts: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(EVENTS, 0))
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
            group = "total"
        else:
            group = next(g for g, match in GROUPS if match(name))
        for e, v in zip(EVENTS, values, strict=True):
            parts[group][e] += v
    return parts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=int, default=10, help="traces counted per phase (default 10)")
    ap.add_argument("--cycles", type=int, default=2, help="on-off-off-on cycles of phases (default 2)")
    ap.add_argument("--write", action="store_true", help="update docs/performance.md")
    args = ap.parse_args()
    if not shutil.which("valgrind") or not Path("/usr/include/valgrind/callgrind.h").exists():
        print("valgrind (callgrind, with its headers) is not installed: nothing to measure")
        return 1
    import torch

    torch.set_num_threads(1)  # as in the measured process
    info = bench_common.machine_info()
    t0 = time.perf_counter()
    phases = ["on", "off", "off", "on"] * args.cycles  # ABBA: drifts over the run cancel
    with tempfile.TemporaryDirectory() as tmp:
        profiles = [read_profile(p) for p in run_phases(phases, args.traces, Path(tmp))]

    def per_trace(mode: str, group: str, e: str) -> float:
        """The mean over the mode's phases, per trace (means add up: the groups sum to the total)."""
        values = [p[group][e] for p, m in zip(profiles, phases, strict=True) if m == mode]
        return mean(values) / args.traces

    def spread(mode: str, e: str) -> float:
        values = [p["total"][e] for p, m in zip(profiles, phases, strict=True) if m == mode]
        return (max(values) - min(values)) / args.traces

    names = {
        "Ir": "instructions",
        "I1mr": "L1 instruction misses",
        "D1mr": "L1 data read misses",
        "D1mw": "L1 data write misses",
        "DLmr": "last-level data read misses",
    }
    rows = []
    for e in EVENTS:
        on, off = per_trace("on", "total", e), per_trace("off", "total", e)
        swap = per_trace("on", GROUPS[0][0], e)
        rows.append(
            [
                names[e],
                f"{off:,.0f} (phases spread over {spread('off', e):,.0f})",
                f"{on:,.0f} (phases spread over {spread('on', e):,.0f})",
                f"{on - off:+,.0f} ({(on - off) / SWITCHES_PER_TRACE:+,.1f} per switch)",
                f"{swap:,.0f} ({swap / SWITCHES_PER_TRACE:,.1f} per switch)",
            ]
        )
    table = bench_common.md_table(
        [
            "per trace",
            "swap off: mean of phases",
            "swap on: mean of phases",
            "on - off",
            "of which inside the swap's own functions",
        ],
        rows,
    )
    where = []
    for group, _ in GROUPS:
        where.append(
            [group] + [f"{per_trace('on', group, e) - per_trace('off', group, e):+,.0f}" for e in EVENTS]
        )
    where_table = bench_common.md_table(["on - off, per trace, in", *(names[e] for e in EVENTS)], where)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = "\n".join(f"- {k}: {v}" for k, v in info.items())
    doc = __doc__.split("Usage")[0].split("\n\n", 1)[1].strip()
    text = f"""{SECTION}

{doc}

Command: `{bench_common.command_line(__file__)}` ({date}; {time.perf_counter() - t0:.0f} s)

{machine}

{table}

{where_table}
"""
    print(text)
    if args.write:
        bench_common.write_section(SECTION, text)
        print("updated docs/performance.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
