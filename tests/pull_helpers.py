"""What the pull transport's tests do to a PullService that the engines never do: look into its
buffer, clear a request, and end a request on every rank at once (blocking). These reach into the
service's state, so that its public surface stays what the engines use."""

from __future__ import annotations

import time
from typing import Any

import torch

from asyncpp.pp.pulls import PullError, PullService, PullTimeout


def same_value(a: Any, b: Any) -> bool:
    """Exactly the same value: container types, dtypes, shapes and bytes (for every dtype,
    including those without equality)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.contiguous().reshape(-1).view(torch.uint8).tolist()
            == b.contiguous().reshape(-1).view(torch.uint8).tolist()
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_value(a[k], b[k]) for k in a)
    if not isinstance(a, (tuple, list)):
        return a == b  # a constant (None, a number, a string)
    return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))


def has(svc: PullService, req: int, key: int, visit: int) -> bool:
    """Whether (req, key, visit) was published (or failed) on this rank and not cleared since."""
    with svc._lock:
        return (key, visit) in svc._values.get(req, {})


def local(svc: PullService, req: int, key: int, visit: int) -> Any:
    """A fresh copy of the value this rank published under (req, key, visit): the owner reading its
    own buffer. Raises PullError if it was failed, KeyError if nothing is there."""
    with svc._lock:
        entry = svc._values.get(req, {}).get((key, visit))
    if entry is None:
        raise KeyError(f"stage {svc.rank} holds no value for request {req}, key {key}, visit {visit}")
    return svc._open(entry, where=f"request {req} key {key} visit {visit}", owner=svc.rank)


def clear(svc: PullService, req: int) -> None:
    """Drop every buffered value of ``req`` on this rank now (pulls waiting for one get an error)."""
    svc._clear(req)


def drain(svc: PullService, req: int) -> None:
    """Request end, called by every rank for the same ``req``: :meth:`PullService.release`, then wait
    until every peer released it too and this rank's buffer of it was cleared. Raises PullTimeout
    after the service's deadline and PullError if a peer or this service closes first (the buffer
    is cleared either way)."""
    svc.release(req)
    if svc.world == 1:
        return
    peers = set(range(svc.world)) - {svc.rank}
    start = time.monotonic()
    problem: PullError | None = None
    with svc._cv:
        while req in svc._released:
            missing = peers - svc._drains.get(req, set())
            if svc._closed or svc._broken is not None:
                state = svc._broken or "closed"
                problem = PullError(f"drain of request {req} on stage {svc.rank} failed: service {state}")
                break
            gone = missing & svc._byes_in
            if gone:
                problem = PullError(
                    f"drain of request {req}: stage(s) {sorted(gone)} closed before draining it"
                )
                break
            left = start + svc.deadline_s - time.monotonic()
            if left <= 0:
                problem = PullTimeout(
                    f"drain of request {req} on stage {svc.rank} timed out after {svc.deadline_s:.1f} s "
                    f"waiting for stage(s) {sorted(missing)}"
                )
                break
            svc._cv.wait(left)
        if problem is not None:
            svc._released.pop(req, None)
            svc._drains.pop(req, None)
    if problem is not None:
        svc._clear(req)
        raise problem
