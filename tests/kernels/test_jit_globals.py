"""Triton kernels may read a module global only when it is a ``tl.constexpr``.

The CPU interpreter (``TRITON_INTERPRET=1``, what CI runs) lets a kernel read any global, while the GPU
compiler refuses a plain ``int`` or ``float`` global with a ``NameError`` at the first launch. This check
catches that on the CPU: every ``@triton.jit`` function in ``hearth.kernels`` is scanned for names that
resolve to plain numbers in its module.
"""

from __future__ import annotations

import importlib
import pkgutil

import triton
from triton.runtime.interpreter import InterpretedFunction

import hearth.kernels

_JIT = (triton.runtime.JITFunction, InterpretedFunction)  # what @triton.jit returns on the GPU / under the interpreter


def _jit_functions():
    for info in pkgutil.walk_packages(hearth.kernels.__path__, "hearth.kernels."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, _JIT) and value.fn.__module__ == info.name:
                yield info.name, value.fn


def test_kernels_read_only_constexpr_globals():
    bad = []
    seen = 0
    for module, fn in _jit_functions():
        seen += 1
        for name in fn.__code__.co_names:
            value = fn.__globals__.get(name)
            if isinstance(value, (bool, int, float)):
                bad.append(f"{module}.{fn.__name__} reads {name} = {value!r}")
    assert seen > 20, f"only {seen} jit functions found: the scan is broken"
    assert not bad, "wrap these globals in tl.constexpr(...):\n" + "\n".join(bad)
