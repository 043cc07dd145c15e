"""One small registry type for swappable parts: a name -> factory map that refuses a duplicate name.

    ENCODERS = Registry("encoder")

    @ENCODERS.register("resnet50_trunc")
    def resnet50_trunc(**kwargs): ...

    ENCODERS.get("resnet50_trunc")        # the factory; ConfigError listing the names for an unknown one

Registering a second factory under a name already taken raises ValueError (a silent overwrite would
make the part that runs depend on import order); the same function defined again (a notebook cell run twice,
a reloaded module: same module and name) replaces it. Used by every swappable part: feature encoders
(:mod:`wsi_milssl.features.encoders`), instance models (:mod:`wsi_milssl.mil.models`), slide readers
(:mod:`wsi_milssl.slide.reader`), tissue detectors (:mod:`wsi_milssl.slide.tissue`) and colour maps
(:mod:`wsi_milssl.inference.colormaps`).
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from wsi_milssl.errors import ConfigError

__all__ = ["Registry"]

T = TypeVar("T", bound=Callable)


def _same_definition(a: Callable, b: Callable) -> bool:
    """Whether ``b`` is ``a`` defined again (a notebook cell or a module reloaded): the same module and name."""
    name = getattr(a, "__qualname__", None)
    return (name is not None and not name.endswith("<lambda>") and name == getattr(b, "__qualname__", None)
            and getattr(a, "__module__", None) == getattr(b, "__module__", None))


class Registry(Generic[T]):
    """Factories by name. ``kind`` names the parts in messages ('encoder', 'model')."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering a factory under ``name``; ValueError when the name is taken."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a {self.kind} name must be a non-empty string; got {name!r}.")

        def deco(factory: T) -> T:
            taken = self._items.get(name)
            if taken is not None and taken is not factory and not _same_definition(taken, factory):
                raise ValueError(f"{self.kind} {name!r} is already registered (by {taken.__module__}."
                                 f"{taken.__qualname__}); choose another name (or remove it first with "
                                 f"pop({name!r})).")
            self._items[name] = factory
            return factory

        return deco

    def get(self, name: str) -> T:
        """The factory registered as ``name``; ConfigError naming the registered ones otherwise."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise ConfigError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}.") from None

    def pop(self, name: str) -> T:
        """Remove ``name`` and return its factory (KeyError when not registered); for tests and plugins that
        register a part for a while."""
        return self._items.pop(name)

    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)
