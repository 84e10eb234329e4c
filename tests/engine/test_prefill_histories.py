"""Prefill of tiered requests on the DSA kernel path streams each layer's history through the
runner's two history buffers (hearth.engine.tiers.PrefillHistories): a prompt prefilled in chunks
with tiers on gives the logits of tiers off, no temporary history buffer is made, the buffers are the
same across chunks and requests, and the memory plan counts them (2 x one layer's history at
max_model_len).

On the CPU the kernels run under Triton's interpreter (``kernels_apply`` is told the model sits on a
GPU, as in test_tiers_kernels_engine.py)."""

from __future__ import annotations

import math

import pytest
import torch

from hearth.engine import EngineConfig
from hearth.engine.config import ModelConfig
from hearth.engine.runner import CachePlan, ModelRunner, StepInput
from hearth.engine.testing.tiny import KERNEL_SHAPES, write_tiny_model
from hearth.offload.planned_tiers import PlannedKeys, PlannedLatents
from tests.engine.conftest import TEST_DEVICE

TIERS = dict(index_key_hot_pages=1, index_key_candidate_pages=12, index_key_cache_pages=12, latent_hot_rows=112)
PROMPT = [(13 * j) % 460 + 20 for j in range(70)]  # past the 16-token hot key page, the 16-row latent ring
CHUNKS = [(0, 24), (24, 21), (45, 25)]  # chunks 2 and 3 start inside a 16-token page


@pytest.fixture(scope="module")
def kernel_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("prefill_k") / "glm_moe_dsa", "glm_moe_dsa", seed=3,
                            overrides=KERNEL_SHAPES)  # IndexCache layers: keys stream on the indexer layers only


def _runner(path, **tiers) -> ModelRunner:
    return ModelRunner.load(str(path), EngineConfig(device=TEST_DEVICE, dtype="bfloat16", block_size=16,
                                                    max_model_len=256, max_num_seqs=2, cuda_graphs=False, **tiers))


def _prefill(runner: ModelRunner, seq_id: str, table: list[int]) -> torch.Tensor:
    """The prompt in CHUNKS; every token's logits."""
    return torch.cat([runner.run([StepInput(table, first, PROMPT[first:first + n], seq_id)], all_logits=True)
                      for first, n in CHUNKS])


@pytest.mark.slow  # minutes under the CPU interpreter
def test_chunked_prefill_streams_histories_through_two_buffers(kernel_model, kernel_path, monkeypatch):
    expected = _prefill(_runner(kernel_model), "a", list(range(10)))
    runner = _runner(kernel_model, **TIERS)
    histories = runner.histories
    assert runner.use_kernels and histories is not None and runner.cache.histories is histories
    buffers = histories.buffers
    held = [t.data_ptr() for t in buffers.key_buffers + buffers.latent_buffers]

    def no_temporary(*args):
        raise AssertionError("a streamed request read its history into a temporary buffer")

    monkeypatch.setattr(PlannedKeys, "history", no_temporary)
    monkeypatch.setattr(PlannedLatents, "history", no_temporary)
    for seq_id, table in (("a", list(range(10))), ("b", list(range(10, 20)))):  # two requests, one after the other
        assert torch.allclose(_prefill(runner, seq_id, table), expected, atol=1e-4, rtol=0)
    assert [t.data_ptr() for t in buffers.key_buffers + buffers.latent_buffers] == held
    # the last chunk's schedule: every layer streams latents; layer j + 1 loads before layer j is used
    layers = runner.model_config.num_hidden_layers
    expected_schedule = [("load", 0, 0)]
    for j in range(layers):
        expected_schedule += ([("load", j + 1, (j + 1) % 2)] if j + 1 < layers else []) + [("use", j, j % 2)]
    assert buffers.schedule == expected_schedule
    key_layers = {layer for (seq_id, layer) in runner.key_tiers.tiers if seq_id == "b"}
    assert key_layers == histories.key_layers != set(range(layers))  # IndexCache layers hold no keys


def test_the_memory_plan_counts_two_layer_histories_at_max_model_len(kernel_model, kernel_path):
    config = EngineConfig(device=TEST_DEVICE, dtype="bfloat16", block_size=16, max_model_len=200, **TIERS)
    model_config = ModelConfig.from_file(str(kernel_model))
    plain = CachePlan.of(model_config, EngineConfig(device=TEST_DEVICE, dtype="bfloat16", block_size=16,
                                                    max_model_len=200), torch.bfloat16, torch.device(TEST_DEVICE))
    plan = CachePlan.of(model_config, config, torch.bfloat16, torch.device(TEST_DEVICE))
    tokens = math.ceil(200 / 16) * 16  # whole pages
    assert plan.history_bytes == 2 * tokens * (132 + model_config.latent_dim * 2) and plain.history_bytes == 0
    assert plan.kv_bytes == plain.kv_bytes + plan.history_bytes
    keys_only = CachePlan.of(model_config, EngineConfig(device=TEST_DEVICE, dtype="bfloat16", block_size=16,
                                                        max_model_len=200, index_key_hot_pages=1),
                             torch.bfloat16, torch.device(TEST_DEVICE))
    assert keys_only.history_bytes == 2 * tokens * 132
