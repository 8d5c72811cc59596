"""A package's public names, imported from their modules on first use (PEP 562), so importing
the package loads nothing heavy (TorchRec, fbgemm) until a name that needs it is used."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_names(package: str, public: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The package's __getattr__: each name of `public` from its module (cached in the
    package's `namespace` once imported); any other name is an AttributeError naming it."""

    def __getattr__(name: str) -> Any:
        if name not in public:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(public[name]), name)
        namespace[name] = value
        return value

    return __getattr__
