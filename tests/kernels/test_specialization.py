"""Kernel arguments that change with every request or step are not specialised by Triton.

Triton compiles a kernel variant per specialisation of each integer argument (divisible by 16, equal
to 1, other); a prompt length or row count that first hits a new one compiles hundreds of
milliseconds in the middle of that request (a follow-up turn's time to first token). These
arguments only mask rows or bound loops, so they are marked ``do_not_specialize``; strides and model
sizes (constant per model, and what vectorisation needs) stay specialised.
"""

from __future__ import annotations

import inspect

import pytest

from hearth.kernels.fp8_linear import kernel as fp8_linear
from hearth.kernels.indexer import cache_write, decode_persistent, lightning
from hearth.kernels.moe import gemv, mma
from hearth.kernels.sparse_mla import kernel as sparse_mla

PER_REQUEST = [
    (lightning._indexer_prefill_kernel, {"T", "n_ctx"}),  # a prefill chunk's queries and context
    (cache_write._indexer_k_write_kernel, {"N"}),  # the step's tokens
    (decode_persistent._indexer_decode_persistent_kernel, {"n_req", "n_progs"}),  # the batch, the grid
    (fp8_linear.gemv_kernel, {"M"}),  # the step's rows
    (fp8_linear.gemm_kernel, {"M"}),
    (sparse_mla._sparse_mla_combine_kernel, {"S"}),  # splits, chosen from the step's rows
    (gemv.gate_up_gemv_kernel, {"num_pairs"}),  # routed (token, expert) pairs
    (gemv.down_gemv_kernel, {"num_pairs"}),
    (mma.gate_up_mma_kernel, {"num_pairs"}),
    (mma.down_mma_kernel, {"num_pairs"}),
]


def _unspecialised(kernel) -> set[str]:
    """The names marked do_not_specialize, on a JITFunction (GPU) or an InterpretedFunction (CPU)."""
    names = getattr(kernel, "do_not_specialize", None)
    if names is None:
        names = kernel.kwargs.get("do_not_specialize") or []
    params = list(inspect.signature(kernel.fn).parameters)
    return {params[n] if isinstance(n, int) else n for n in names}


@pytest.mark.parametrize(("kernel", "names"), PER_REQUEST, ids=lambda v: getattr(v, "__name__", ""))
def test_per_request_integers_are_not_specialised(kernel, names):
    params = set(inspect.signature(kernel.fn).parameters)
    assert names <= params, f"{kernel.__name__} has no {names - params}: update this list"
    assert _unspecialised(kernel) == names
