"""ModelRunner's explicit composition: which execution paths a config and a machine give
(RunnerFeatures), and building a runner around a model made in memory (the benchmarks' way in)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hearth.engine.api import EngineConfig, HearthError
from hearth.engine.config import ModelConfig
from hearth.engine.kv_cache import PagedCache
from hearth.engine.models.deepseek import DeepseekForCausalLM
from hearth.engine.models.mla import AttentionPaths
from hearth.engine.runner import CachePlan, ModelRunner, RunnerFeatures, StepInput
from hearth.engine.testing.tiny import tiny_config
from hearth.kernels.indexer import PREFILL_LOGITS_BUDGET

CUDA = torch.device("cuda")  # only its type is read: the decision needs no GPU


def _kernel_shaped() -> ModelConfig:
    """A DSA config with the Triton kernels' shapes (64 indexer heads x 128, 576-wide latents)."""
    raw = tiny_config("deepseek_v32")
    raw.update(index_n_heads=64, index_head_dim=128, kv_lora_rank=512, qk_rope_head_dim=64)
    return ModelConfig.from_dict(raw)


def _decide(offload: bool = False, **changes: object) -> RunnerFeatures:
    config = dataclasses.replace(EngineConfig(), **changes)
    return RunnerFeatures.decide(config, _kernel_shaped(), config.block_size, CUDA, torch.bfloat16, offload)


def test_kernels_and_graphs_by_default_on_a_gpu():
    features = _decide()
    assert features.attention == AttentionPaths(use_kernels=True, mli=False)
    assert features.cuda_graphs and features.fused_experts and not features.offload


@pytest.mark.parametrize(("offload", "changes", "kernels", "graphs", "pieces"), [
    # tiered keys / latents keep the kernels (decode planned on the device) and whole-step graphs, no pieces;
    # with MLI or offloaded experts, graphs per piece (the attention pieces per set of requests)
    (False, {"index_key_hot_pages": 4}, True, True, False),
    (False, {"latent_hot_rows": 4096}, True, True, False),
    (False, {"index_key_hot_pages": 4, "latent_hot_rows": 4096, "cuda_graphs": False}, True, False, False),
    (False, {"index_key_hot_pages": 4, "latent_hot_rows": 4096, "mli": True}, True, True, True),
    (True, {"index_key_hot_pages": 4, "latent_hot_rows": 4096}, True, True, True),
    (True, {"latent_hot_rows": 4096, "mli": True, "scheduler": "runahead"}, True, True, True),
    # the plain path's exact or lagged key selection has no kernel version: plain PyTorch, whole eager
    # steps (its tiers read their selection back), offloaded experts included
    (False, {"index_key_hot_pages": 4, "index_key_exact": True}, False, False, False),
    (False, {"index_key_hot_pages": 4, "index_key_lagged_fetch": True}, False, False, False),
    (True, {"index_key_hot_pages": 4, "index_key_exact": True}, False, False, False),
    (False, {"use_kernels": "never"}, False, False, False),
    (False, {"cuda_graphs": False}, True, False, False),
    (False, {"mli": True}, True, True, True),  # MLI: graphs per piece
    (False, {"scheduler": "runahead"}, True, True, False),
    (True, {}, True, True, True),  # offloaded experts: graphs per piece, no fused resident experts
    (True, {"cuda_graphs": False}, True, False, True),  # the same pieces, eager
])
def test_each_switch_turns_off_what_it_must(offload, changes, kernels, graphs, pieces):
    features = _decide(offload, **changes)
    assert (features.attention.use_kernels, features.cuda_graphs, features.piecewise) == (kernels, graphs, pieces)
    assert features.fused_experts == (not offload and changes.get("use_kernels") != "never")
    assert features.attention.mli == bool(changes.get("mli"))


@pytest.mark.parametrize("arch", ["glm4_moe", "gpt_oss", "qwen3_moe", "mixtral"])
def test_gqa_families_decode_through_the_kernel_in_cuda_graphs(arch):
    model_config = ModelConfig.from_dict(tiny_config(arch))
    config = EngineConfig()
    features = RunnerFeatures.decide(config, model_config, config.block_size, CUDA, torch.bfloat16, False)
    assert features.attention.use_kernels and features.cuda_graphs and features.fused_experts
    offloaded = RunnerFeatures.decide(config, model_config, config.block_size, CUDA, torch.bfloat16, True)
    assert offloaded.attention.use_kernels and not offloaded.fused_experts
    on_cpu = RunnerFeatures.decide(config, model_config, config.block_size, torch.device("cpu"), torch.float32, False)
    assert not on_cpu.attention.use_kernels and not on_cpu.cuda_graphs


def test_dense_mla_has_no_decode_kernels():
    model_config = ModelConfig.from_dict(tiny_config("deepseek_v3"))
    features = RunnerFeatures.decide(EngineConfig(), model_config, 64, CUDA, torch.bfloat16, False)
    assert not features.attention.use_kernels and not features.cuda_graphs


def test_the_cpu_never_runs_the_kernels():
    config = EngineConfig()
    features = RunnerFeatures.decide(config, _kernel_shaped(), 64, torch.device("cpu"), torch.float32, False)
    assert features == RunnerFeatures(AttentionPaths(), False, False, False, False, False, False)


def test_latent_tiers_need_a_dsa_model():
    dense = ModelConfig.from_dict(tiny_config("deepseek_v3"))
    with pytest.raises(HearthError, match="latent_hot_rows needs a sparse-attention"):
        RunnerFeatures.decide(EngineConfig(latent_hot_rows=64), dense, 64, torch.device("cpu"), torch.float32, False)


def test_the_cache_plan_counts_the_prefill_indexer_scratch():
    """The planner's KV bytes include what a prefill chunk's indexer selection holds at once: the kernel
    path's fp32 logits (chunk x context, 16-column rows) up to the 256 MiB budget it runs in row blocks
    under, the plain path's 17 bytes a pair up to the same; nothing without an indexer."""
    raw = tiny_config("deepseek_v32")
    raw.update(index_n_heads=64, index_head_dim=128, kv_lora_rank=512, qk_rope_head_dim=64,
               max_position_embeddings=163840)
    dsa = ModelConfig.from_dict(raw)

    def plan(model_config, device=CUDA, **changes):
        config = dataclasses.replace(EngineConfig(max_num_seqs=1), **changes)
        got = CachePlan.of(model_config, config, torch.bfloat16, device)
        paged = PagedCache.bytes_per_block(model_config, config.block_size, torch.bfloat16) * got.num_blocks
        assert got.kv_bytes == paged + got.history_bytes + got.scratch_bytes
        return got.scratch_bytes

    assert PREFILL_LOGITS_BUDGET == 256 << 20
    assert plan(dsa, max_model_len=131072) == PREFILL_LOGITS_BUDGET  # unbounded: 2,048 x 128K x 4 = 1 GiB
    assert plan(dsa, max_model_len=4001) == 2048 * 4016 * 4  # under the budget: the whole chunk's logits
    assert plan(dsa, max_model_len=4001, max_num_batched_tokens=512) == 512 * 4016 * 4
    assert plan(dsa, max_model_len=1000) == 1000 * 1008 * 4  # a chunk is at most max_model_len tokens
    assert plan(dsa, torch.device("cpu"), max_model_len=4001) == 2048 * 4016 * 17  # the plain path
    assert plan(dsa, torch.device("cpu"), max_model_len=131072) == PREFILL_LOGITS_BUDGET
    assert plan(ModelConfig.from_dict(tiny_config("deepseek_v3")), max_model_len=2048) == 0


def test_from_model_runs_a_model_built_in_memory_and_checks_how_it_was_built():
    model_config = ModelConfig.from_dict(tiny_config("deepseek_v32"))
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=2, block_size=16)
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    model = DeepseekForCausalLM(model_config, attention=ModelRunner.features_for(model_config, config, cpu).attention)
    for module in model.modules():  # nn.Linear's default init is fine; norms start at one
        for name, param in module.named_parameters(recurse=False):
            if "norm" in name or param.dim() == 1:
                torch.nn.init.ones_(param)
    runner = ModelRunner.from_model(model.eval(), config)
    assert runner.graphs is None and runner.max_model_len == 64 and runner.num_blocks == 8
    logits = runner.run([StepInput(list(range(4)), 0, [5, 6, 7])])
    assert logits.shape == (1, model_config.vocab_size) and torch.isfinite(logits).all()
    with pytest.raises(HearthError, match="built with"):
        ModelRunner.from_model(model, dataclasses.replace(config, mli=True))
