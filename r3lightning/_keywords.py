"""Constructor keywords that 0.2 moved into settings objects: refused with a ``TypeError`` that
names what replaced each one, rather than Python's bare "unexpected keyword argument"."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = ["refuse_moved_keywords"]

Init = TypeVar("Init", bound=Callable[..., None])


def refuse_moved_keywords(moved: Mapping[str, str]) -> Callable[[Init], Init]:
    """Decorate an ``__init__``: a keyword named in ``moved`` raises ``TypeError`` naming its
    replacement ``moved[keyword]`` (see docs/migration.md); the signature seen by ``inspect`` is kept.

    Args:
        moved: old keyword -> where its value goes now (e.g. ``"schema=RouteSchema(num_layers=)"``).

    Returns:
        The decorator.
    """

    def decorate(init: Init) -> Init:
        @functools.wraps(init)
        def checked(self: Any, *args: Any, **kwargs: Any) -> None:
            old = [name for name in kwargs if name in moved]
            if old:
                detail = "; ".join(f"{name}= is now {moved[name]}" for name in old)
                raise TypeError(f"{type(self).__name__}() no longer takes {detail} (docs: migration.md)")
            init(self, *args, **kwargs)

        checked.moved_keywords = dict(moved)  # type: ignore[attr-defined]  # the migration table's test reads it
        return checked  # type: ignore[return-value]

    return decorate
