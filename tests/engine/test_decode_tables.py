"""Decode steps' block tables: padded to the cache's ``table_width`` when it has one (the kernel path: the
CUDA graphs' width, so an eager decode launches the kernels the graphs compiled, at any context), else as
wide as the step's longest table; both for all-decode steps (``DecodeMeta``) and for the decode rows of a
mixed step (``decode_tables``)."""

from __future__ import annotations

import pytest
import torch

from hearth.engine.config import ModelConfig
from hearth.engine.kv_cache import PagedCache, build_context, decode_tables
from hearth.engine.testing.tiny import write_tiny_model

BS = 4


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> ModelConfig:
    return ModelConfig.from_file(write_tiny_model(tmp_path_factory.mktemp("tables") / "m", "deepseek_v32"))


@pytest.mark.parametrize("width", [None, 9])
def test_all_decode_step_tables(config, width):
    cache = PagedCache(config, 10, BS, torch.float32, torch.device("cpu"), table_width=width)
    ctx = build_context(cache, [([3, 1], 6, 1), ([4, 0, 2, 5, 6], 17, 1)], torch.device("cpu"))
    tables = ctx.decode.block_tables
    assert tables.dtype == torch.int32 and tables.shape == (2, width or 5)
    assert tables[0, :2].tolist() == [3, 1] and tables[1, :5].tolist() == [4, 0, 2, 5, 6]
    assert not tables[0, 2:].any() and not tables[1, 5:].any()
    assert ctx.decode.context_lens.tolist() == [7, 18] and ctx.decode.max_context == 18


@pytest.mark.parametrize("width", [None, 9])
def test_mixed_step_decode_rows(config, width):
    cache = PagedCache(config, 10, BS, torch.float32, torch.device("cpu"), table_width=width)
    # a prefill chunk between two decodes: no DecodeMeta; the decode rows' tables come from decode_tables
    ctx = build_context(cache, [([3, 1], 6, 1), ([7, 8], 0, 5), ([4, 0, 2], 9, 1)], torch.device("cpu"))
    assert ctx.decode is None
    tables = decode_tables(ctx, [0, 2])
    assert tables.shape == (2, width or 3)
    assert tables[0].tolist()[:3] == [3, 1, 0] and tables[1].tolist()[:3] == [4, 0, 2] and not tables[:, 3:].any()


def test_a_table_wider_than_the_width_keeps_its_pages(config):
    """The width is a floor: a longer table (which the engine never builds) is not cut."""
    cache = PagedCache(config, 10, BS, torch.float32, torch.device("cpu"), table_width=2)
    ctx = build_context(cache, [([4, 0, 2], 9, 1)], torch.device("cpu"))
    assert ctx.decode.block_tables.tolist() == [[4, 0, 2]]
