"""count_nonfinite: the NaN / inf check every checkpoint weight passes at load, against the plain count
(isfinite; e4m3fn's NaN bytes S.1111.111), for every float dtype a checkpoint holds, at odd sizes, with and
without non-finite elements, at the largest finite values and on strided views."""

from __future__ import annotations

import pytest
import torch

from hearth.kernels._utils import count_nonfinite

DTYPES = [torch.float8_e4m3fn, torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _plain(t: torch.Tensor) -> int:
    if t.dtype == torch.float8_e4m3fn:
        return int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum())
    return int((~torch.isfinite(t)).sum())


def _values(dtype: torch.dtype, n: int, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.float8_e4m3fn:  # every finite byte
        u8 = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
        u8[(u8 & 0x7F) == 0x7F] = 0x7E
        return u8.view(dtype)
    return (torch.randn(n, generator=g, dtype=torch.float64) * 1e4).to(dtype)


def _spoil(t: torch.Tensor, where: list[int]) -> None:
    for j, i in enumerate(where):
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8)[i] = (0x7F, 0xFF)[j % 2]
        else:
            t[i] = (float("nan"), float("inf"), float("-inf"))[j % 3]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 7, 4099])
@pytest.mark.parametrize("bad", [0, 1, 5])
def test_count_nonfinite_counts_what_isfinite_counts(dtype, n, bad):
    g = torch.Generator().manual_seed(n * 31 + bad)
    t = _values(dtype, n, g)
    _spoil(t, torch.randperm(n, generator=g)[:bad].tolist() if n else [])
    assert count_nonfinite(t) == _plain(t) == min(n, bad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_largest_finite_values_and_strided_views(dtype):
    info = torch.finfo(dtype)
    extremes = torch.tensor([info.max, -info.max, info.tiny, -info.tiny, 0.0], dtype=torch.float64).to(dtype)
    assert count_nonfinite(extremes) == 0
    m = _values(dtype, 64, torch.Generator().manual_seed(1)).view(8, 8)
    _spoil(m.view(-1), [19])
    assert count_nonfinite(m.t()) == count_nonfinite(m[:, 3]) == 1 and count_nonfinite(m[:, :3]) == 0


def test_integers_have_no_nonfinite():
    assert count_nonfinite(torch.arange(10)) == 0
