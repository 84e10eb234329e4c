"""Shared fixtures for the kernel tests. Without CUDA the Triton kernels run in Triton's CPU
interpreter: TRITON_INTERPRET must be set before `triton` is first imported (`@triton.jit` picks the
interpreter at decoration time), so it is set here, at collection, and never when CUDA is present."""

import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402  (after the environment is set)

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.fixture
def device() -> torch.device:
    """The device the small-shape tests run on: the GPU when there is one, else the CPU interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True)
def _fresh_seed(request) -> None:
    """A distinct seed per test id so that every case draws its own random inputs, reproducibly."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64; fails on NaN/inf in either."""
    got, ref = got.double().cpu(), ref.double().cpu()
    assert torch.isfinite(got).all(), "kernel output has NaN/inf"
    assert torch.isfinite(ref).all(), "reference has NaN/inf"
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def paged_table(n_req: int, max_blocks: int, num_blocks: int, device) -> torch.Tensor:
    """A block table [n_req, max_blocks] int32 of distinct, shuffled physical pages."""
    assert num_blocks >= n_req * max_blocks
    return torch.randperm(num_blocks)[: n_req * max_blocks].view(n_req, max_blocks).int().to(device)


def logical_slots(table_row: torch.Tensor, n_tokens: int, block_size: int) -> torch.Tensor:
    """Physical slots [n_tokens] int64 of logical positions 0..n_tokens-1 under one block-table row."""
    t = torch.arange(n_tokens, device=table_row.device)
    return table_row.long()[t // block_size] * block_size + t % block_size
