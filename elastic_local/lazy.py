"""A package's names imported on first use (PEP 562 module `__getattr__`): torch takes seconds to import, and
the commands that need no model (`--help`, `paths`, `profiles`) should not wait for it."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def exports(package: str, homes: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, whose name N lives in its submodule `homes[N]` (relative)."""

    def __getattr__(name: str) -> object:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name], package), name)
        setattr(sys.modules[package], name, value)  # looked up once
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(homes))

    return __getattr__, __dir__
