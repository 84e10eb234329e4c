"""Shared test setup: Qt offscreen, Triton's interpreter when there is no GPU, the ``gpu`` marker."""

import os

import pytest

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
