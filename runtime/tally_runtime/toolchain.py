"""Can this image compile what SGLang compiles at run time on a GPU node? (`python -m tally_runtime.toolchain`)

Triton, which runs SGLang's kernels, builds a small C launcher for each kernel the first time it runs one (during
CUDA graph capture, so at start-up): it takes the compiler from `CC`, else `gcc`, else `clang`, the Python headers
of sysconfig's install scheme (Debian's `posix_local` read as `posix_prefix`), compiles a shared object and loads
it as an extension module (triton/runtime/build.py). An image without them starts, loads the model and then dies
with "Failed to find C compiler". This does the same with a tiny extension and imports it: exit 0 when it works,
1 saying what is missing. The GPU variants of runtime/Dockerfile run it as their last build step, so such an
image is never built. Standard library only: it also runs by path, before Tally is installed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tally_toolchain_probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_tally_toolchain_probe(void) { return PyModule_Create(&module); }
"""


def compiler() -> str | None:
    """The compiler Triton would use."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def python_headers() -> Path:
    """Where Triton looks for Python.h."""
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":
        scheme = "posix_prefix"
    return Path(sysconfig.get_paths(scheme=scheme)["include"])


def check() -> str:
    """'' when a tiny extension compiles with Triton's command and imports; otherwise what went wrong."""
    cc = compiler()
    if cc is None:
        return "no C compiler: set CC or install gcc (Triton compiles its kernel launchers at run time)"
    headers = python_headers()
    if not (headers / "Python.h").is_file():
        return f"no Python headers in {headers} (install the python3-dev package of this Python)"
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "probe.c"
        source.write_text(SOURCE)
        built = Path(tmp) / f"tally_toolchain_probe{sysconfig.get_config_var('EXT_SUFFIX')}"
        command = [cc, str(source), "-O3", "-shared", "-fPIC", "-Wno-psabi", "-o", str(built), f"-I{headers}"]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except OSError as err:
            return f"the C compiler {cc!r} cannot run: {err}"
        if result.returncode != 0:
            return f"{' '.join(command)} failed: {result.stderr.strip()[-500:]}"
        spec = importlib.util.spec_from_file_location("tally_toolchain_probe", built)
        if spec is None or spec.loader is None:
            return f"the compiled extension {built} cannot be loaded"
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except ImportError as err:
            return f"the compiled extension does not import: {err}"
        if module.answer() != 42:
            return "the compiled extension answered wrongly"
    return ""


def main() -> None:
    problem = check()
    if problem:
        print(f"tally toolchain check: {problem}", file=sys.stderr)
        sys.exit(1)
    print(f"tally toolchain check: {compiler()} builds and loads extensions against {python_headers()}")


if __name__ == "__main__":
    main()
