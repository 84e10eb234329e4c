"""Tiered decode steps through the decode-graph path (hearth.engine.cuda_graphs.DecodeGraphs with
per-request tiers) on the CPU, where nothing can be captured: the "capture" runs the graph's forward
(static inputs, the requests' ids) as the real capture's warm-up does, and each "replay" runs that
same forward again, so the code a CUDA graph would record is the code that runs here. Inside every
forward, anything that reads a device value on the host (or the tiers' host phase) raises: a step
that passed here has no host synchronisation to bake into a graph."""

from __future__ import annotations

import pytest
import torch

from hearth.engine import Engine, EngineConfig, SamplingParams
from hearth.engine.cuda_graphs import DecodeGraphs
from hearth.engine.models import fused_experts
from hearth.engine.testing.tiny import KERNEL_SHAPES, write_tiny_model
from tests.engine.conftest import TEST_DEVICE, run_to_completion
from tests.engine.no_host_sync import NoHostSync

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# index_topk 64 at block 16: 100-token prompts reach past the 1-page key ring and the 96-row latent window
PROMPTS = [[(13 * j + 7) % 460 + 20 for j in range(100)]]


@pytest.fixture(scope="module")
def kernel_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiers_g") / "deepseek_v32", "deepseek_v32", seed=3,
                            overrides=KERNEL_SHAPES)


def _engine(path, **tiers) -> Engine:
    """The runner CUDA builds: kernel path (the fixture), and resident experts in the fused kernel (the
    CPU runner's default one-expert-at-a-time loop reads expert counts back: a host sync by design)."""
    engine = Engine.load(str(path), EngineConfig(device=TEST_DEVICE, dtype="bfloat16", block_size=16,
                                                 max_num_batched_tokens=64, cuda_graphs=False, **tiers))
    assert fused_experts.enable(engine.runner.model, require_cuda=False) > 0
    return engine


class _EmulatedGraph:
    """A capture's stand-in on the CPU: replay runs the captured function again into its output."""

    def __init__(self, fn, out: torch.Tensor, guard: NoHostSync) -> None:
        self.fn, self.out, self.guard = fn, out, guard

    def replay(self) -> None:
        with self.guard:
            self.out.copy_(self.fn())


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="emulates capture on the CPU (CUDA captures for real)")
def test_tiered_decode_through_the_graph_path_has_no_host_sync(kernel_model, kernel_path, monkeypatch):
    expected = run_to_completion(_engine(kernel_model), PROMPTS, GREEDY)
    tiered = _engine(kernel_model, index_key_hot_pages=1, index_key_candidate_pages=8, index_key_cache_pages=8,
                     latent_hot_rows=96)
    runner = tiered.runner
    assert runner.use_kernels and runner.decode_tiers is not None and runner.graphs is None
    graphs = runner.graphs = DecodeGraphs(runner.model, runner.cache, tiered.config.max_num_seqs,
                                          runner.max_model_len, scratch_block=runner.num_blocks, device=runner.device)
    guard = NoHostSync(monkeypatch)

    def capture(b, seq_ids=()):  # as DecodeGraphs._capture: two warm-up runs, then the recorded one
        graphs.captures += 1
        with guard:
            for _ in range(2):
                out = graphs._forward(b, seq_ids)
        return _EmulatedGraph(lambda: graphs._forward(b, seq_ids), out, guard), out

    monkeypatch.setattr(graphs, "_capture", capture)
    assert run_to_completion(tiered, PROMPTS, GREEDY) == expected
    # every decode step went through a "graph" (the first token comes from the prefill step)
    assert graphs.replays == GREEDY.max_tokens - 1 and 1 <= graphs.captures < graphs.replays
    assert not runner.key_tiers.tiers and not runner.latent_tiers.tiers  # released with the request


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA graphs need a GPU (the CPU test above emulates them)")
def test_tiered_decode_in_cuda_graphs_equals_tiers_off(kernel_model, kernel_path):
    """Real captures: long enough that the tiers' host pools grow while decoding, so the step's tier
    layout changes and its graphs are dropped and captured again (into a new memory pool once none is
    left), with tokens equal to tiers off. The 12 candidate pages cover every cold page of the 148-token
    run (10 pages of 16, one hot), so the coarse-to-fine selection is the exact one throughout."""
    sampling = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    config = dict(device=TEST_DEVICE, dtype="bfloat16", block_size=16, max_num_batched_tokens=64)
    expected = run_to_completion(Engine.load(str(kernel_model), EngineConfig(**config)), PROMPTS, sampling)
    tiered = Engine.load(str(kernel_model), EngineConfig(**config, index_key_hot_pages=1, index_key_candidate_pages=12,
                                                         index_key_cache_pages=12, latent_hot_rows=96))
    graphs = tiered.runner.graphs
    assert graphs is not None and tiered.runner.decode_tiers is not None
    assert run_to_completion(tiered, PROMPTS, sampling) == expected
    assert graphs.replays == sampling.max_tokens - 1 and graphs.captures >= 2, (graphs.replays, graphs.captures)
