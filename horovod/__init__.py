"""Drop-in `horovod` package: `import horovod.torch as hvd` (or `horovod.tensorflow`,
`horovod.tensorflow.keras`, `horovod.keras`, `horovod.jax`) loads ringvod.

No code of its own beyond aliasing: `horovod.torch` *is* `frameworks.torch`, and every
`horovod.torch.X` is `frameworks.torch.X` (the same module objects, so classes, globals and
`isinstance` checks are shared). An import hook maps the names on first import, so importing
`horovod` alone imports no framework.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Sequence

import collective as _collective
from launcher.api import run  # horovod.run(func, num_proc=...): launcher/api.py

# Horovod's API version this package follows, with ringvod's own version as the local label
# (so `Version(horovod.__version__) >= Version("0.21")` checks keep passing).
__version__ = f"0.28.1+ringvod.{_collective.__version__}"

__all__ = ["__version__", "run"]

# alias prefix -> real package. Other adapters add their line here.
_ALIASES = {
    "horovod.torch": "frameworks.torch",
    "horovod.tensorflow": "frameworks.tensorflow",
    "horovod.keras": "frameworks.tensorflow.keras",
    "horovod.jax": "frameworks.jax",
    "horovod.ray": "launcher.ray",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the alias spec on the real module; give it its own back.
        module.__spec__ = self.spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Resolves `horovod.<alias>[.sub]` to the already-imported real module object."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        for alias, real in _ALIASES.items():
            if fullname == alias or fullname.startswith(alias + "."):
                module = importlib.import_module(real + fullname[len(alias):])
                return importlib.machinery.ModuleSpec(fullname, _AliasLoader(module),
                                                      is_package=hasattr(module, "__path__"))
        return None


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())
