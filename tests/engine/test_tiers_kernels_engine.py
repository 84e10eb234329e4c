"""Tiered indexer keys and latents on the DSA kernel path (hearth.offload.planned_tiers): greedy
tokens with tiers on equal tiers off, both through the Triton kernels, at contexts far longer than
the device windows (hot key pages, latent ring and cache).

On the CPU the kernels run under Triton's interpreter: ``kernels_apply`` is told the model sits on a
GPU (the one check the CPU fails), so the runner builds exactly the kernel path it builds on CUDA;
host pools are then ordinary CPU tensors. On the GPU machine (HEARTH_TEST_DEVICE=cuda) the same test
runs the real kernels with pinned, mapped host pools."""

from __future__ import annotations

import pytest

from hearth.engine import Engine, EngineConfig, SamplingParams
from hearth.engine.testing.tiny import KERNEL_SHAPES, write_tiny_model
from hearth.offload.planned_tiers import PlannedKeys, PlannedLatents
from tests.engine.conftest import TEST_DEVICE, run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# index_topk 64 at block 16 = 4 pages: prompts of 150..170 tokens decode far past the 1-page key ring
PROMPTS = [[(13 * i + 7 * j) % 460 + 20 for j in range(150 + 20 * i)] for i in range(2)]


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def kernel_model(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiers_k") / request.param, request.param, seed=3,
                            overrides=KERNEL_SHAPES)


def _engine(path, **tiers) -> Engine:
    # CUDA graphs need a GPU (the tiers-off engine captures them there; tiered steps run eagerly)
    return Engine.load(str(path), EngineConfig(device=TEST_DEVICE, dtype="bfloat16", block_size=16,
                                               max_num_batched_tokens=64, cuda_graphs=TEST_DEVICE == "cuda",
                                               **tiers))


@pytest.mark.slow  # about 4 minutes per model under the CPU interpreter
def test_tiers_on_the_kernel_path_equal_tiers_off(kernel_model, kernel_path, monkeypatch):
    """Every cold page is a candidate (candidate budget >= the context's pages): the selection is the
    full-cache one, so tokens must be equal. The device holds 1 hot key page, 12 cached pages and
    112 latent rows (16-row ring + 96 cached) while contexts reach 182 tokens, so fetches from host
    memory, cache hits and evictions all happen. The prompts prefill in chunks of up to 64 tokens
    (both requests in some steps), their histories streamed through the runner's two buffers."""
    expected = run_to_completion(_engine(kernel_model), PROMPTS, GREEDY)
    tiered = _engine(kernel_model, index_key_hot_pages=1, index_key_candidate_pages=12, index_key_cache_pages=12,
                     latent_hot_rows=112)
    runner = tiered.runner
    assert runner.use_kernels and runner.key_tiers.planned and runner.latent_tiers.planned
    assert runner.cache.index_keys[0] is None and runner.cache.latent[0] is None
    made = []
    for tiers in (runner.key_tiers, runner.latent_tiers):
        new = tiers._new
        tiers._new = lambda tokens, new=new: made.append(new(tokens)) or made[-1]
    temporary = []  # prefill histories read into temporary buffers (none: both prompts fit the two buffers)
    for cls in (PlannedKeys, PlannedLatents):
        monkeypatch.setattr(cls, "history", lambda self, *args, real=cls.history: temporary.append(self) or
                            real(self, *args))
    buffers, staged = runner.histories.buffers, []
    begin = buffers.begin
    buffers.begin = lambda requests, layers: staged.append(begin(requests, layers)) or staged[-1]
    assert run_to_completion(tiered, PROMPTS, GREEDY) == expected
    assert not temporary and len({seq_id for ids in staged for seq_id in ids}) == len(PROMPTS)
    keys = [t for t in made if isinstance(t, PlannedKeys)]
    latents = [t for t in made if isinstance(t, PlannedLatents)]
    assert keys and latents
    # the device windows were far smaller than the history, and rows came back from host memory
    assert max(t.num_tokens for t in keys) > 10 * 16 and max(t.num_tokens for t in latents) > 112
    assert all(int((t.plan.owner >= 0).sum()) > 0 for t in keys + latents)
