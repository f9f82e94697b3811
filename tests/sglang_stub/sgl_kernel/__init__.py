"""Test-only stand-in for the CUDA-only `sgl_kernel`, so SGLang's real engine imports on a CPU host.

The real package's pure-Python modules `version` and `scalar_type` are loaded from its own files.
Every other name (and every other submodule) is a function that raises when called: on SGLang's
torch-native CPU path none is called, and if one ever is, the test fails loudly instead of computing
something fake. Never shipped: it is only on PYTHONPATH for tests/sglang.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any, NoReturn

_HERE = Path(__file__).resolve().parent.parent
_REAL_SPEC = importlib.machinery.PathFinder.find_spec(
    "sgl_kernel", [p for p in sys.path if Path(p or ".").resolve() != _HERE])
if _REAL_SPEC is None or not _REAL_SPEC.submodule_search_locations:
    raise ImportError("the real sgl_kernel package (installed with sglang) was not found")
_REAL_DIR = Path(next(iter(_REAL_SPEC.submodule_search_locations)))
_PURE = {"version", "scalar_type"}


class CompiledOpCalled(RuntimeError):
    pass


def _raiser(qualname: str) -> Any:
    def op(*_: Any, **__: Any) -> NoReturn:
        raise CompiledOpCalled(f"sgl_kernel stand-in: compiled op {qualname} was called on the CPU path")

    op.__name__ = op.__qualname__ = qualname.rsplit(".", 1)[-1]
    return op


def _load_pure(name: str) -> types.ModuleType:
    full = f"{__name__}.{name}"
    spec = importlib.util.spec_from_file_location(full, _REAL_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    spec.loader.exec_module(module)
    return module


class _Stub(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _raiser(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(__name__ + ".") and fullname.split(".")[1] not in _PURE:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Stub(spec.name)
        module.__path__ = []  # a package, so deeper submodules resolve through this finder too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.insert(0, _StubFinder())
version = _load_pure("version")
scalar_type = _load_pure("scalar_type")
__version__ = version.__version__


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _raiser(f"{__name__}.{name}")
