"""What every benchmark script here shares: the machine it ran on, the command, markdown tables,
and replacing its own section of docs/performance.md."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"

# the text the throughput benchmarks cut their distinct prompts from
PROMPT_TEXT = (
    "It was a bright cold day in April, and the clocks were striking thirteen. The hallway smelt of "
    "boiled cabbage and old rag mats. At one end of it a coloured poster, too large for indoor "
    "display, had been tacked to the wall. Outside, even through the shut window-pane, the world "
    "looked cold. Down in the street little eddies of wind were whirling dust and torn paper into "
    "spirals, and though the sun was shining and the sky a harsh blue, there seemed to be no colour "
    "in anything, except the posters that were plastered everywhere."
)


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 0


def git_rev() -> str:
    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def load_average(note: str = "expect noisier figures") -> str:
    """The load averages before a run, flagged when other work was running."""
    if not hasattr(os, "getloadavg"):
        return "?"
    avg = os.getloadavg()
    text = ", ".join(f"{v:.2f}" for v in avg)
    return text + (f" (other work was running: {note})" if avg[0] > 0.5 else "")


def machine_info(
    load_note: str = "expect noisier figures", extra: dict[str, str] | None = None
) -> dict[str, str]:
    """The machine, the versions and the load a benchmark ran with (``extra`` goes before the load)."""
    import torch

    import asyncpp

    rev = git_rev()
    where = Path(asyncpp.__file__).resolve().parent
    if where.is_relative_to(ROOT):
        version = asyncpp.__version__ + (f", {rev}" if rev else "")
    else:
        version = f"{asyncpp.__version__} from {where}"
    return {
        "cpu": cpu_model(),
        "cores": f"{os.cpu_count()} logical, {usable_cores()} usable; torch threads {torch.get_num_threads()}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "asyncpp": version,
        **(extra or {}),
        "load average before the run": load_average(load_note),
    }


def command_line(script: str) -> str:
    """The command that ran ``script`` (its ``__file__``), relative to the repository."""
    exe = Path(sys.executable).absolute()
    exe_s = str(exe.relative_to(ROOT)) if exe.is_relative_to(ROOT) else "python"
    path = Path(script).resolve()
    script_s = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    return " ".join([exe_s, script_s, *sys.argv[1:]])


def machine_lines(info: dict[str, str]) -> str:
    """``machine_info()`` as a markdown list."""
    return "\n".join(f"- {k}: {v}" for k, v in info.items())


def verdict(fails: list[str], ok: str = "All checks passed.") -> str:
    """The closing line of a section: ``ok``, or the failed checks as a list."""
    return ok if not fails else "Failed checks:\n\n" + "\n".join(f"- {f}" for f in fails)


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    return sxy / sxx


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def write_section(section: str, text: str, doc: Path = DOC) -> None:
    """Replace (or append) the section headed ``section`` in ``doc``, keeping the others."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    if not doc.exists():
        doc.write_text("# Performance\n\n" + text)
        return
    old = doc.read_text()
    pattern = re.compile(rf"^{re.escape(section)}\n.*?(?=^## |\Z)", re.S | re.M)
    body = text.rstrip("\n") + "\n"
    if pattern.search(old):
        new = pattern.sub(lambda _: body + "\n", old, count=1).rstrip("\n") + "\n"
    else:
        new = old.rstrip("\n") + "\n\n" + body
    doc.write_text(new)


def tv(a: Any, b: Any) -> float:
    """Total variation distance of the next-token distributions of logits ``a`` and ``b`` (float64)."""
    pa, pb = a.double().softmax(-1), b.double().softmax(-1)
    return float(0.5 * (pa - pb).abs().sum())


def max_abs(a: Any, b: Any) -> float:
    """The largest absolute difference of ``a`` and ``b`` (float64)."""
    return float((a.double() - b.double()).abs().max())


def tree_cpu_seconds() -> float:
    """CPU seconds used so far by this process and its live descendants (vLLM's processes)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def finish(section: str, text: str, fails: list[str], write: bool, doc: Path = DOC) -> int:
    """Print a benchmark's section and its failed checks, record it in ``doc`` with ``write``;
    the exit status (1 if a check failed)."""
    print(text)
    for f in fails:
        print(f"FAIL: {f}", file=sys.stderr)
    if write:
        write_section(section, text, doc)
        print(f"wrote the section to {doc.relative_to(ROOT)}")
    return 1 if fails else 0
