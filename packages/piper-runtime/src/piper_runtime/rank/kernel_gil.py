"""Inductor's CPU kernels, called with the GIL released.

Inductor calls each C++ kernel it generates for a CPU through a small Python binding of its
own (``CppPythonBindingsCodeCache``), which holds the GIL for the whole kernel. Where ranks
are threads of one process (the ``local`` runtime), one rank's compiled kernel then stops
every other rank's Python and compiled kernels, so two ranks' compiled segments run one at a
time where their eager operators (aten releases the GIL) run side by side: measured on this
2-core machine, a thread counting in Python while another ran one compiled kernel advanced
10x slower than while it ran the same operators eagerly.

``releasing_gil`` changes, while inductor generates code, the binding's call of the kernel:
the arguments are read from their Python objects with the GIL held, as before, and the
kernel runs with it released (an RAII guard takes it back however the kernel returns). A
kernel only reads and writes the memory behind its pointers, so it needs no Python. The
generated source differs from inductor's own, so its on-disk cache keeps the two apart.
Where the installed torch's binding is not the one this was written against (another torch
version), nothing is changed and kernels hold the GIL as inductor makes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

#: The binding's call and its extra definitions as torch 2.13's inductor writes them.
_INDUCTOR_CALL = "kernel({}); Py_RETURN_NONE;"
_INDUCTOR_EXTRA = ""

#: The same call with the arguments parsed first (GIL held), then the kernel run without it.
#: Both strings go through ``str.format`` once (``{}``: the parsed arguments), hence ``{{``.
_RELEASING_CALL = (
    "{{ auto piper_args = std::make_tuple({}); "
    "{{ PiperGilRelease piper_released; std::apply(kernel, piper_args); }} }} Py_RETURN_NONE;"
)
_RELEASING_EXTRA = """
#include <tuple>
struct PiperGilRelease {{
    PyThreadState* state;
    PiperGilRelease() : state(PyEval_SaveThread()) {{}}
    ~PiperGilRelease() {{ PyEval_RestoreThread(state); }}
    PiperGilRelease(const PiperGilRelease&) = delete;
    PiperGilRelease& operator=(const PiperGilRelease&) = delete;
}};
"""


def binding_class() -> type | None:
    """Inductor's binding code cache, if it is the one ``releasing_gil`` knows how to change."""
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache
    except ImportError:
        return None
    known = (CppPythonBindingsCodeCache.__dict__.get("call_entry_function") in (_INDUCTOR_CALL, _RELEASING_CALL)
             and CppPythonBindingsCodeCache.__dict__.get("extra_parse_arg") in (_INDUCTOR_EXTRA, _RELEASING_EXTRA))
    return CppPythonBindingsCodeCache if known else None


@contextmanager
def releasing_gil() -> Iterator[bool]:
    """Within: inductor's CPU kernel bindings release the GIL around each kernel (module doc).
    Yields whether it could; not reentrant across threads (hold the compile lock)."""
    cls = binding_class()
    if cls is None:
        yield False
        return
    saved = (cls.call_entry_function, cls.extra_parse_arg)
    cls.call_entry_function, cls.extra_parse_arg = _RELEASING_CALL, _RELEASING_EXTRA
    try:
        yield True
    finally:
        cls.call_entry_function, cls.extra_parse_arg = saved
