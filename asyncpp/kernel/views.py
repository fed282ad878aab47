"""Value views: location keys that present the value reached so far in another form.

A :class:`ValueView` sits in a location's keys like an index does (``m.std`` builds locations
with one). Reading applies :meth:`ValueView.present`, which returns a view of the model's own
storage, so in-place edits of what a block reads land in the model; writing copies the new value
into what ``present`` returns. Keys after the view index the presented value.
"""

from __future__ import annotations

import zlib
from typing import Any

from torch import Tensor

from .errors import WriteError


class ValueView:
    """A presented form of a location's value (subclasses say which form)."""

    __slots__ = ()
    #: whether :meth:`remote` may run on the owning pipeline stage instead, so that only its
    #: result crosses (a pull's selection): true for views whose remote form is a plain value
    travels: bool = True

    def present(self, value: Any, block: Any) -> Any:
        """The form a block reads: a view of ``value``'s storage, never a copy (``block`` is the
        reader; None where no block reads, such as a remote stage's lazy value)."""
        raise NotImplementedError

    def remote(self, value: Any) -> Any:
        """The same form computed from the owner's published value on another pipeline stage (given
        the pulled value when a lazy remote value is forced; no in-place edits)."""
        return self.present(value, None)

    def write(self, value: Any, new: Any, block: Any, where: str) -> None:
        """Replace the presented value by ``new``, in place (so the model goes on with it)."""
        target = self.present(value, block)
        if not isinstance(new, Tensor):
            raise WriteError(f"{where}: the replacement must be a tensor, got {type(new).__name__}")
        if new.shape != target.shape:
            raise WriteError(
                f"{where}: the replacement has shape {tuple(new.shape)}, but this invoke's value has "
                f"shape {tuple(target.shape)}"
            )
        if new is not target:
            target.copy_(new)


def _class_code(cls: type) -> int:
    return zlib.crc32(f"{cls.__module__}.{cls.__qualname__}".encode())


def view_code(view: ValueView) -> int:
    """A number naming ``view``'s class on every process running the same code (for the wire)."""
    return _class_code(type(view))


_BY_CODE: dict[int, type] = {}  # the view classes seen so far, by code


def view_of_code(code: int) -> ValueView | None:
    """A view of the class :func:`view_code` names (views are stateless), or None."""
    cls = _BY_CODE.get(code)
    if cls is None:  # a class not seen yet (defined since the last walk): walk the subclasses again
        todo = list(ValueView.__subclasses__())
        while todo:
            sub = todo.pop()
            todo.extend(sub.__subclasses__())
            _BY_CODE.setdefault(_class_code(sub), sub)
        cls = _BY_CODE.get(code)
    return None if cls is None else cls()


__all__ = ["ValueView", "view_code", "view_of_code"]
