"""Which pipeline stage owns each module path, derived from the module trees the stages loaded.

Every stage reports its modules as (path, type name, real) in its own index order, where *real*
means a module the stage actually holds: not a placeholder for a layer another stage holds (vLLM's
``PPMissingLayer``) and not inside one. With the full architecture grafted under the placeholders
(:mod:`asyncpp.pp.graft`) every stage reports the same paths in the same order, and a placeholder
reports the real module's type; :meth:`Ownership.from_reports` checks that and computes the owner
of every path:

* a path real on exactly one stage is owned by that stage;
* modules every stage builds but only the last one runs on its output path (the logits processor,
  the sampler, and their sub-modules) are claimed by the last stage;
* a path real on several stages that holds no module owned by one stage (vLLM's Gemma-2, GPT-2,
  Mixtral and Qwen2-MoE build their embedding and final norm on every stage; a tied embedding is
  built on the first and the last) runs on one stage only: the stage of the closest stage-owned
  module before it in index order (the final norm follows the last layer), or the first stage when
  none comes before it (the embedding). Where the model says which modules it splits across
  stages (``split``: vLLM's Transformers backend splits those of the Hugging Face model's pipeline
  plan), that holds only under them: a module built on several stages outside them runs on every
  stage where it is built (a base model's rotary embedding) and is *local*;
* other paths real on several stages (the root, containers) are *local*: every stage serves its own
  visits of them;
* a path that is a placeholder on some stages and real on none (never happens with vLLM's models)
  is local too.

Where the graft could not be built, the stages' trees differ and ``union=True`` combines them into
their union instead (stage 0's order, then new paths of later stages).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from .graft import STUB_TYPES, Grafted

LOCAL = -1  # owner of a path every stage serves itself
LAST_STAGE_ROOTS = ("logits_processor", "sampler")  # built everywhere, run on the last stage only

Report = list[tuple[str, str, bool]]


def report(named: Iterable[tuple[str, nn.Module]], grafted: Grafted | None = None) -> Report:
    """This stage's (path, type name, real) entries, in its index order. With ``grafted`` (what
    :func:`~asyncpp.pp.graft.graft` did to this stage's model) a placeholder is named by the type of
    the module it stands for, and grafted modules are not real."""
    out: Report = []
    stubs: list[str] = []
    types = grafted.types if grafted is not None else {}
    added = frozenset(grafted.added) if grafted is not None else frozenset()
    for path, module in named:
        name = type(module).__name__
        inside = any(path.startswith(s) for s in stubs)
        stub = name in STUB_TYPES or path in added
        if stub:
            stubs.append(path + ".")
            name = types.get(path, name)
        out.append((path, name, not inside and not stub))
    return out


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + ".") for r in roots)


class TreeMismatch(ValueError):
    """Stages whose grafted module trees differ."""


@dataclass
class Ownership:
    """The tree every stage shares and the owner of each path (index-aligned)."""

    entries: list[tuple[str, str]]  # (path, type name) by index, the same on every rank
    owners: list[int]  # stage owning each index, or LOCAL
    stages: int

    @classmethod
    def from_reports(
        cls, reports: list[Report], union: bool = False, split: tuple[str, ...] | None = None
    ) -> Ownership:
        """Combine the reports of stages 0..n-1 (in stage order). Every stage must report the same
        (path, type) list, else :class:`TreeMismatch` names the first difference; with ``union``
        the stages' trees may differ and are combined into their union. ``split``: the paths of
        the modules the model splits across stages, where it says (None: every module)."""
        if union:
            entries, real_on = _union(reports)
        else:
            entries, real_on = _same(reports)
        last = len(reports) - 1
        owners = []
        for (path, _), stages in zip(entries, real_on, strict=True):
            if _under(path, LAST_STAGE_ROOTS):
                owners.append(last)
            elif len(stages) == 1:
                owners.append(stages[0])
            else:
                owners.append(LOCAL)
        _settle_replicated(entries, real_on, owners, split)
        return cls(entries, owners, len(reports))

    @property
    def paths(self) -> list[str]:
        return [p for p, _ in self.entries]

    def owner_of(self, index: int) -> int:
        return self.owners[index]

    def describe(self, stage: int) -> str:
        """A one-line summary for logs: how many paths each stage owns."""
        counts = [sum(1 for o in self.owners if o == s) for s in range(self.stages)]
        local = sum(1 for o in self.owners if o == LOCAL)
        return f"stage {stage} of {self.stages}: owned paths per stage {counts}, {local} served everywhere"


def _settle_replicated(
    entries: list[tuple[str, str]], real_on: list[list[int]], owners: list[int], split: tuple[str, ...] | None
) -> None:
    """Give a module built on several stages but run on one (it holds no stage-owned module and,
    where ``split`` says which modules are split, is under one of them) the stage of the closest
    stage-owned module before it, or the first stage."""
    holders = set()  # every ancestor of a stage-owned path
    for i, owner in enumerate(owners):
        if owner != LOCAL and len(real_on[i]) == 1:
            parts = entries[i][0].split(".")
            holders.update(".".join(parts[:n]) for n in range(len(parts)))
    before = 0
    for i, ((path, _), stages) in enumerate(zip(entries, real_on, strict=True)):
        if owners[i] != LOCAL:
            if len(stages) == 1:
                before = owners[i]
            continue
        if len(stages) > 1 and path not in holders and (split is None or _under(path, split)):
            owners[i] = before


def _same(reports: list[Report]) -> tuple[list[tuple[str, str]], list[list[int]]]:
    first = reports[0]
    for stage, rep in enumerate(reports[1:], 1):
        for i, ((p0, t0, _), (p, t, _)) in enumerate(zip(first, rep, strict=False)):
            if p0 != p or t0 != t:
                raise TreeMismatch(
                    f"pipeline stages 0 and {stage} loaded different module trees: at index {i} "
                    f"stage 0 has {p0!r} ({t0}), stage {stage} has {p!r} ({t})"
                )
        if len(rep) != len(first):
            longer, n = (0, first) if len(first) > len(rep) else (stage, rep)
            i = min(len(first), len(rep))
            raise TreeMismatch(
                f"pipeline stages 0 and {stage} loaded different module trees: only stage {longer} "
                f"has {n[i][0]!r} ({n[i][1]}) at index {i}"
            )
    entries = [(p, t) for p, t, _ in first]
    real_on = [[s for s, rep in enumerate(reports) if rep[i][2]] for i in range(len(first))]
    return entries, real_on


def _union(reports: list[Report]) -> tuple[list[tuple[str, str]], list[list[int]]]:
    index: dict[str, int] = {}
    entries: list[tuple[str, str]] = []
    real_on: list[list[int]] = []
    for stage, rep in enumerate(reports):
        for path, type_name, real in rep:
            i = index.get(path)
            if i is None:
                i = index[path] = len(entries)
                entries.append((path, type_name))
                real_on.append([])
            if real:
                real_on[i].append(stage)
                if entries[i][1] in STUB_TYPES:
                    entries[i] = (path, type_name)  # the real module's type, not the stub's
    return entries, real_on
