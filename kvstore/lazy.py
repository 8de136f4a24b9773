"""Names a package exports but imports on first use (PEP 562), so light entry points (the
`kvstore` CLI) do not pay for torch or numpy."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, where: dict[str, str], namespace: dict[str, Any],
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package`, whose name N in `where`
    comes from module `where[N]` when first asked for (then kept in `namespace`, the package's
    `globals()`). Any other name is an AttributeError, which lets `from package import sub`
    fall back to importing the submodule."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace.get("__all__", ())})

    return __getattr__, __dir__
