"""Lazy package exports: a package's public names imported from their submodules on first use."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable, Mapping


def lazy_exports(package: str, sources: Mapping[str, str], public: Iterable[str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's module ``__getattr__`` and ``__dir__``.

    ``sources`` maps a public name to the submodule (relative to ``package``) that
    defines it; the first lookup imports it and keeps the value in ``namespace``
    (the package's globals), so later lookups skip ``__getattr__``. Any other name
    that is a submodule (``package.<name>``) is imported as one.
    """
    public = tuple(public)

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        source = sources.get(name)
        if source is None:
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(f"{package}.{source}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *public})

    return __getattr__, __dir__
