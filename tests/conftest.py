"""Shared test setup: installed packages named like the repository's folders imported first, Qt offscreen,
Triton's interpreter when there is no GPU, the ``gpu`` marker."""

import contextlib
import importlib
import importlib.metadata
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _import_installed_namesakes() -> None:
    """The repository root is on sys.path under pytest (``python -m pytest`` puts the working directory there,
    and the ``tests`` package's root is inserted), so its folders ``kernels/``, ``engine/``, ``app/`` ... would
    shadow installed packages of those names for any library that imports them: transformers >= 5.25 depends
    on the PyPI ``kernels`` package and imports it (``from kernels import CUDAProperties`` failed on ours).
    Hearth itself only ever imports them as ``hearth.*``. Import each installed namesake once, with the
    repository's entries out of sys.path, so later imports find it in sys.modules."""
    folders = {d.name for d in REPO.iterdir() if (d / "__init__.py").is_file() and d.name != "tests"}
    installed = importlib.metadata.packages_distributions()
    wanted = sorted(name for name in folders if name not in sys.modules
                    and any(dist.lower() != "hearth" for dist in installed.get(name, [])))
    if not wanted:
        return
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if Path(p or ".").resolve() != REPO]
    try:
        for name in wanted:
            with contextlib.suppress(ImportError):  # a broken install: the tests that need it will say so
                importlib.import_module(name)
    finally:
        sys.path[:] = saved


_import_installed_namesakes()
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_CUDA = _has_cuda()
if not HAS_CUDA:
    # Triton kernels run on the CPU through the interpreter (set before triton is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the H200 benchmark machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
