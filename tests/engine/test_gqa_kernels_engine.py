"""The GQA families with the Triton decode kernel (models/gqa_kernels.py) and resident experts
through the fused MoE kernel (forced on the CPU under Triton's interpreter; on a GPU machine the real
kernels, with CUDA graphs): the same greedy tokens as the plain-PyTorch path for several requests
decoding together (GLM-4.5, gpt-oss with a sliding window shorter than the context and sinks,
Mixtral's window), and a decode step described only by device tensors (``ForwardContext.decode``,
what a CUDA graph replays) gives the plain path's logits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hearth.engine import Engine, EngineConfig, SamplingParams
from hearth.engine.config import ModelConfig
from hearth.engine.kv_cache import DecodeMeta, ForwardContext, SeqSlice
from hearth.engine.loader import load_checkpoint
from hearth.engine.models import fused_experts
from hearth.engine.models.mla import AttentionPaths
from hearth.engine.offload_setup import Placement
from hearth.engine.runner import CachePlan, ModelRunner, RunnerFeatures, StepInput
from hearth.engine.text.tokenizer import Tokenizer
from tests.engine.conftest import run_to_completion

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONFIG = EngineConfig(device=DEVICE.type, dtype="float32", block_size=16, max_num_seqs=4)
PLAIN = dataclasses.replace(CONFIG, use_kernels="never")


def _kernel_runner(path: Path, config: EngineConfig = CONFIG) -> ModelRunner:
    """What ModelRunner.load builds on a GPU (kernel attention, fused resident experts), on any device:
    the features decided for CUDA (the decision reads only the device's type), graphs only on a GPU."""
    model_config = ModelConfig.from_file(path)
    features = RunnerFeatures.decide(config, model_config, config.block_size, torch.device("cuda"), torch.float32,
                                     offload=False)
    assert features.attention == AttentionPaths(use_kernels=True) and features.cuda_graphs
    features = dataclasses.replace(features, cuda_graphs=DEVICE.type == "cuda")
    model = load_checkpoint(path, DEVICE, torch.float32, attention=features.attention)
    assert fused_experts.enable(model, require_cuda=False) == sum(layer.is_moe for layer in model.layers)
    return ModelRunner(model, config, features, CachePlan.of(model_config, config, torch.float32, DEVICE),
                       Placement(False, None, "resident"), dtype=torch.float32, checkpoint=str(path))


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(8)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (21, 35, 12)]


@pytest.mark.parametrize("arch", ["glm4_moe", "gpt_oss", "mixtral"])
def test_kernel_path_gives_the_plain_paths_greedy_tokens(arch, tiny_models):
    path = tiny_models[arch]
    window = ModelConfig.from_file(path).sliding_window
    assert window is None or window < 35  # shorter than the longest prompt (gpt-oss 8, Mixtral 24)
    sampling = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    plain = Engine.load(str(path), PLAIN)
    assert not plain.runner.use_kernels
    want = run_to_completion(plain, _prompts(), sampling)
    runner = _kernel_runner(path)
    assert all(layer.self_attn._kernels is not None for layer in runner.model.layers)
    fast = Engine(runner, Tokenizer.from_pretrained(path, runner.model_config.model_type), CONFIG)
    # all three at once: prefill steps, mixed steps and batched decode steps
    assert run_to_completion(fast, _prompts(), sampling) == want
    assert runner.graphs is None if DEVICE.type == "cpu" else runner.graphs.replays > 0


@pytest.mark.parametrize("arch", ["glm4_moe", "gpt_oss"])
def test_decode_from_device_tensors_only(arch, tiny_models):
    """A batch decoded the way DecodeGraphs._forward runs it: per-request slices that say nothing
    (one slot, context 1), block tables padded with a scratch page, a padding row that writes only
    the scratch page. Same logits as the plain path for the real rows."""
    path = tiny_models[arch]
    config = dataclasses.replace(CONFIG, max_model_len=96)
    runner = _kernel_runner(path, config)
    plain = ModelRunner.load(str(path), dataclasses.replace(config, use_kernels="never"))
    bs, scratch = runner.block_size, runner.num_blocks
    prompts = _prompts()
    tables = [list(range(6 * i, 6 * i + 6)) for i in range(len(prompts))]
    for r in (runner, plain):
        for table, prompt in zip(tables, prompts):
            r.run([StepInput(table, 0, prompt[:-1])])
    want = plain.run([StepInput(t, len(p) - 1, [p[-1]]) for t, p in zip(tables, prompts)])

    b, width = len(prompts) + 1, 96 // bs
    positions = torch.tensor([len(p) - 1 for p in prompts] + [0], device=DEVICE)
    table = torch.full((b, width), scratch, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    table = table.to(DEVICE)
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, positions.tolist())] + [scratch * bs],
                         device=DEVICE)
    seqs = [SeqSlice(start=i, q_len=1, context_len=1, slots=slots[i:i + 1]) for i in range(b)]
    ctx = ForwardContext(positions=positions, slot_mapping=slots, seqs=seqs, cache=runner.cache,
                         decode=DecodeMeta(table, (positions + 1).int(), 96))
    ids = torch.tensor([p[-1] for p in prompts] + [0], device=DEVICE)
    with torch.inference_mode():
        got = runner.model(ids, ctx)
    assert got.shape == (b, runner.model_config.vocab_size)
    assert (got[:-1] - want).abs().max() < 1e-4
    assert torch.equal(got[:-1].argmax(-1), want.argmax(-1))
