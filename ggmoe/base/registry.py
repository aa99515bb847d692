"""A tiny name -> class registry: policies and predictors register like any extension."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from ggmoe.base.errors import UsageError

T = TypeVar("T")


def check_choice(name: str, choices: tuple[str, ...] | list[str], kind: str) -> str:
    """``name`` if it is one of ``choices``; else one clear UsageError listing them (``kind``: "miss policy")."""
    if name not in choices:
        raise UsageError(f"unknown {kind} {name!r}; choose one of {', '.join(choices)}")
    return name


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind  # e.g. "policy", for messages
        self._items: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def deco(cls: type[T]) -> type[T]:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = cls
            cls.name = name  # type: ignore[attr-defined]
            return cls

        return deco

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests that register a throwaway entry clean up with this)."""
        self._items.pop(name, None)

    def get(self, name: str) -> type[T]:
        try:
            return self._items[name]
        except KeyError:
            raise UsageError(f"unknown {self.kind} {name!r}; choose one of {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._items)
