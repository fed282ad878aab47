"""A trace's keyword arguments on vLLM: the ``SamplingParams`` of its requests.

Checked when the trace is made (``asyncpp.trace(engine, ...)``), so that a misspelt or refused
option fails at the user's line, not inside the run; turned into each request's options there.
"""

from __future__ import annotations

import difflib
from typing import Any

from ..base import RunSpec

# options asyncpp sets itself, and why a trace cannot take them
_SET_BY_ASYNCPP = {
    "max_tokens": "asyncpp sets it: a trace samples 1 token, asyncpp.generate(engine, max_new_tokens=N) N",
    "extra_args": "asyncpp carries each request's block in it",
    "output_kind": "asyncpp asks for the outputs its results and token streams need",
}


def check(spec: RunSpec) -> None:
    """Raise ``TypeError`` for an option that is not vLLM's or is asyncpp's own, ``ValueError``
    for a value vLLM refuses or a request of several sequences (``n`` > 1)."""
    options = spec.model_kwargs
    if not options:
        return
    from vllm import SamplingParams

    call = "asyncpp.generate()" if spec.generate else "asyncpp.trace()"
    for key in options:
        why = _SET_BY_ASYNCPP.get(key)
        if why is not None:
            raise TypeError(f"{call} on a VllmEngine does not take {key!r}: {why}")
    fields = [f for f in SamplingParams.__struct_fields__ if not f.startswith("_")]
    for key in options:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(
                f"{call} on a VllmEngine takes vLLM SamplingParams options as keyword arguments; "
                f"{key!r} is not one of them{hint}"
            )
    n = options.get("n", 1)
    if n != 1:
        raise ValueError(
            f"{call} on a VllmEngine: n={n!r}, but each invoke is one sequence, which its block "
            f"follows; for several samples of a prompt, invoke it several times (with "
            f"temperature > 0)"
        )
    try:
        SamplingParams(max_tokens=spec.max_new_tokens if spec.generate else 1, **request_options(options))
    except Exception as e:  # vLLM's own validation error, TypeError for a value of a wrong type
        raise ValueError(f"{call} on a VllmEngine: vLLM refuses these sampling options: {e}") from None


def request_options(options: dict[str, Any], *, streams_tokens: bool = False) -> dict[str, Any]:
    """The options of one request's ``SamplingParams``, ``max_tokens`` and ``extra_args`` less:
    greedy unless told otherwise."""
    from vllm.sampling_params import RequestOutputKind

    out = {"temperature": 0.0, **options}
    # a run that streams no tokens needs only each request's final output (as vLLM's own server
    # asks for a request that does not stream): no RequestOutput per step
    out["output_kind"] = RequestOutputKind.CUMULATIVE if streams_tokens else RequestOutputKind.FINAL_ONLY
    # made fresh per request: vLLM need not deep-copy them, as its own OpenAI server's are not
    # (about 20 us per request here)
    out.setdefault("skip_clone", True)
    return out
