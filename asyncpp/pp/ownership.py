"""Which pipeline stage owns each module path, derived from the module trees the stages loaded.

Every stage reports its modules as (path, type name, real) in its own index order, where *real*
means a module the stage actually holds: not a placeholder for a layer another stage holds (vLLM's
``PPMissingLayer``) and not inside one. From the reports of all stages every rank computes the same
union tree (so a path has the same index on every rank and a block written against the full model
resolves everywhere) and the owner of every path:

* a path real on exactly one stage is owned by that stage;
* modules every stage builds but only the last one runs on its output path (the logits processor,
  the sampler, and their sub-modules) are claimed by the last stage;
* other paths real on several stages (the root, containers) are *local*: every stage serves its own
  visits of them;
* a path that is a placeholder on some stages and real on none (never happens with vLLM's models)
  is local too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

LOCAL = -1  # owner of a path every stage serves itself
STUB_TYPES = ("PPMissingLayer",)  # placeholders for modules another stage holds
LAST_STAGE_ROOTS = ("logits_processor", "sampler")  # built everywhere, run on the last stage only

Report = list[tuple[str, str, bool]]


def report(named: Iterable[tuple[str, nn.Module]]) -> Report:
    """This stage's (path, type name, real) entries, in its index order."""
    out: Report = []
    stubs: list[str] = []
    for path, module in named:
        name = type(module).__name__
        inside = any(path == s or path.startswith(s + ".") for s in stubs)
        if name in STUB_TYPES:
            stubs.append(path)
        out.append((path, name, not inside and name not in STUB_TYPES))
    return out


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + ".") for r in roots)


@dataclass
class Ownership:
    """The union tree of all stages and the owner of each path (index-aligned)."""

    entries: list[tuple[str, str]]  # (path, type name) by index, the same on every rank
    owners: list[int]  # stage owning each index, or LOCAL
    stages: int

    @classmethod
    def from_reports(cls, reports: list[Report]) -> Ownership:
        """Combine the reports of stages 0..n-1 (in stage order)."""
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
        last = len(reports) - 1
        owners = []
        for (path, _), stages in zip(entries, real_on, strict=True):
            if _under(path, LAST_STAGE_ROOTS):
                owners.append(last)
            elif len(stages) == 1:
                owners.append(stages[0])
            else:
                owners.append(LOCAL)
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
