"""The examples that run on a local Hugging Face model, each run as a script (a subprocess), and a
check that every example is written on the standard view (``m.std``), not on raw module paths.

The scripts run three at a time (one torch thread each) as soon as the first test asks for one;
each has a hard timeout. The plotting examples write their PNG into the test's temporary folder
(``--out``). ``pipeline_parallel.py`` (two vLLM engines) and ``serve_blocks.py`` (blocks for
``asyncpp serve``: tests/vllm/test_serve_http.py and test_serve_stream.py run them) are not run here.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TIMEOUT = 120  # seconds, per script
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None  # in the test extra
PLOTS = ("logit_lens", "ablation", "attribution_patching")
SCRIPTS = (
    "logit_lens",
    "steering",
    "ablation",
    "generation_steering",
    "activation_patching",
    "read_hidden_states",
    "streaming_logit_lens",
    "attribution_patching",
    "demo",  # the local engine by default
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> a future of (the completed process, the PNG path it was given or None)."""
    out = tmp_path_factory.mktemp("example_plots")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}

    def run(name: str):
        png = out / f"{name}.png" if name in PLOTS else None
        args = [sys.executable, str(EXAMPLES / f"{name}.py")] + (["--out", str(png)] if png else [])
        proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
        return proc, png

    with ThreadPoolExecutor(max_workers=3) as pool:
        futures: dict[str, Future] = {name: pool.submit(run, name) for name in SCRIPTS}
        yield futures
        for f in futures.values():
            f.cancel()


def finished(runs, name: str):
    proc, png = runs[name].result()
    assert proc.returncode == 0, f"{name}.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    if png is not None and not HAVE_MATPLOTLIB:
        assert "pip install 'asyncpp[plot]'" in proc.stdout
    elif png is not None:
        assert f"to {png}" in proc.stdout, proc.stdout  # it says where it saved the picture
        assert png.is_file() and png.stat().st_size > 1000, f"{name}.py wrote no PNG at {png}"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return proc.stdout


def test_logit_lens(runs):
    out = finished(runs, "logit_lens")
    assert "last layer through the lens equals the model's logits: True" in out
    rows = re.findall(r"^\s*(\d+)\s+'.+?'\s+((?:'.*?'\s+0\.\d{3}\s*){4})$", out, re.M)
    assert [int(pos) for pos, _ in rows] == list(range(len("The quick brown fox")))  # every position


def test_steering(runs):
    out = finished(runs, "steering")
    before, after = map(float, re.search(r"p\('!'\) (\d\.\d+) -> (\d\.\d+)", out).groups())
    assert after > before  # steered towards '!'
    assert "in-place edit and .set() agree: True" in out


def test_ablation(runs):
    out = finished(runs, "ablation")
    rows = re.findall(r"^\s+(\d)\s+(\d\.\d{4}) '.*?'\s+(\d\.\d{4}) '.*?'", out, re.M)
    assert [r[0] for r in rows] == ["0", "1", "2", "3"] and all(float(x) > 0 for r in rows for x in r[1:])
    assert "mlp_out.set(zeros) of layers[1] equals zeroing it in place: True" in out
    assert "equals setting its resid_out to its resid_in: True" in out
    assert "skip from a partial invoke: WriteError:" in out


def test_generation_steering(runs):
    out = finished(runs, "generation_steering")
    assert re.search(r"every step\s+'!{10}'\s+\(10 steps\)", out), out
    assert "the first 5 tokens are untouched when steering starts at step 5: True" in out


def test_activation_patching(runs):
    out = finished(runs, "activation_patching")
    recovered = [float(x) for x in re.findall(r"^\s+\d\s+\d\.\d{4}\s+(-?[\d.]+)%$", out, re.M)]
    assert len(recovered) == 4 and recovered[-1] == 100.0
    assert "final layer patched: logits equal the clean run's: True" in out


def test_read_hidden_states(runs):
    out = finished(runs, "read_hidden_states")
    assert out.count("resid_out (1, 12, 128)") == 4
    assert "resid_in + attn_out + mlp_out == resid_out: True" in out
    assert "layers[2].resid_out is layers[3].resid_in: True" in out
    assert re.search(r"'Hi'\s+\(1, 2, 128\)", out)  # its own tokens, not the batch's padding


def test_streaming_logit_lens(runs):
    out = finished(runs, "streaming_logit_lens")
    steps = re.findall(r"^\s+step (\d)\s+[\d.]+ ms\s+layers: ((?:'.*?'\s+){4})-> '.*?'$", out, re.M)
    assert [int(s) for s, _ in steps] == list(range(8))
    assert "generated:" in out


def test_attribution_patching(runs):
    out = finished(runs, "attribution_patching")
    layers = re.findall(r"^\s+(\d)\s+([+-]\d\.\d{5})$", out, re.M)
    assert [n for n, _ in layers] == ["0", "1", "2", "3"] and any(abs(float(v)) > 1e-3 for _, v in layers)
    total, change = map(
        float,
        re.search(r"sum ([+-][\d.]+) vs metric\(clean\) - metric\(corrupt\) ([+-][\d.]+)", out).groups(),
    )
    assert abs(total - change) < 0.02 * abs(change) + 1e-4  # completeness


def test_demo(runs):
    out = finished(runs, "demo")
    assert re.search(r"top token per layer: ('.*?' 0\.\d{3}\s*){4}", out)
    assert "OrderError at wrong_order(), line" in out


def test_plot_is_optional(tmp_path):
    """Without matplotlib a plotting example says how to get the plot and prints its table."""
    hide = tmp_path / "hide"
    (hide / "matplotlib").mkdir(parents=True)
    (hide / "matplotlib" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(hide)}
    png = tmp_path / "lens.png"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "logit_lens.py"), "--out", str(png)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pip install 'asyncpp[plot]'" in proc.stdout
    assert "last layer through the lens equals the model's logits: True" in proc.stdout
    assert not png.exists()


# --- the examples are written on the standard view -----------------------------------------------

#: substrings of raw module paths and model-specific calls that no example should contain
RAW = ("m.model.", ".transformer.", "lm_head(", "model.norm(", ".model.layers", "embed_tokens")
RAW_LOGITS = re.compile(r"\bm\.logits\b")  # the raw logits location (std's is m.std.logits)

#: (example, a line's text that may hold one) -> why
ALLOWED: dict[tuple[str, str], str] = {}  # none at present


def test_examples_use_the_standard_view():
    found = []
    for path in sorted(EXAMPLES.glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not (any(s in line for s in RAW) or RAW_LOGITS.search(line)):
                continue
            if any(name == path.name and text in line for name, text in ALLOWED):
                continue
            found.append(f"{path.name}:{n}: {line.strip()}")
    assert not found, "raw module paths in the examples (use m.std):\n" + "\n".join(found)


def test_the_allowed_exceptions_are_still_there():
    """An allowed raw path that an example no longer has is dropped from ALLOWED."""
    for name, text in ALLOWED:
        assert text in (EXAMPLES / name).read_text(), f"{name} no longer has {text!r}: drop it from ALLOWED"
