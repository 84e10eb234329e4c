"""Decode steps replayed from CUDA graphs (hearth.engine.cuda_graphs) give the tokens of the eager
kernel path: greedy, for one request and for a batch padded up to a bucket. GPU only."""

from __future__ import annotations

import threading

import pytest
import torch

from hearth.engine import Engine, EngineConfig, SamplingParams
from hearth.engine.cuda_graphs import batch_buckets, capturing
from hearth.engine.testing.tiny import KERNEL_SHAPES, write_tiny_model
from tests.engine.conftest import run_to_completion

pytestmark = pytest.mark.gpu


def test_buckets_cover_every_batch_size():
    for top in (1, 3, 8, 33, 256):
        sizes = batch_buckets(top)
        assert sizes[-1] == top and sizes == sorted(set(sizes))
        assert all(any(b >= n for b in sizes) for n in range(1, top + 1))


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def kernel_model(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("graphs") / request.param, request.param, seed=7,
                            overrides=KERNEL_SHAPES)


def _generate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return run_to_completion(engine, prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def test_graph_decode_equals_eager(kernel_model):
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 500, (40 + 23 * i,), generator=gen).tolist() for i in range(3)]
    eager = Engine.load(str(kernel_model), EngineConfig(device="cuda", dtype="bfloat16", cuda_graphs=False))
    assert eager.runner.graphs is None and eager.runner.use_kernels
    graphed = Engine.load(str(kernel_model), EngineConfig(device="cuda", dtype="bfloat16"))
    graphs = graphed.runner.graphs
    assert graphs is not None
    # past index_topk (64) so the decode indexer's top-k is really sparse
    want = _generate(eager, prompts, 40)
    got = _generate(graphed, prompts, 40)
    assert graphs.replays > 0 and 4 in graphs.graphs  # three requests ran in the bucket of four
    assert got == want
    alone = _generate(graphed, prompts[1:2], 40)
    assert 1 in graphs.graphs
    assert alone[0] == want[1]


def _offloaded(path, **options) -> Engine:
    # host_experts="off": whether a missed expert is computed on the host is decided from speeds measured at load,
    # so under a loaded GPU one engine of a pair could take the host path (fp32 on the CPU) and the other not, and
    # a bf16 greedy token flip between them would not be the graphs' doing (seen once on the H200 with 8 workers)
    engine = Engine.load(str(path), EngineConfig(device="cuda", dtype="bfloat16", offload="always",
                                                 expert_cache_slots=4, host_experts="off", **options))
    engine.runahead_gate = None  # "runahead" runs the decoder (auto's gate: tests/engine/test_link_gate.py)
    return engine


@pytest.mark.parametrize("scheduler", ["sync", "runahead", "prefetch"])
def test_piecewise_graphs_with_offloaded_experts_equal_eager_pieces(kernel_model, scheduler):
    """Offloaded experts: every piece captured per bucket and replayed gives the tokens of the same
    pieces run eagerly (the eager pieces equal the resident run: tests/engine/test_piecewise.py)."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 500, (40 + 23 * i,), generator=gen).tolist() for i in range(3)]
    eager = _offloaded(kernel_model, cuda_graphs=False, scheduler=scheduler)
    assert eager.runner.pieces is not None and not eager.runner.pieces.capture
    graphed = _offloaded(kernel_model, scheduler=scheduler)
    pieces = graphed.runner.pieces
    assert pieces is not None and pieces.capture and graphed.runner.graphs is None
    assert _generate(graphed, prompts, 40) == _generate(eager, prompts, 40)
    assert pieces.replays > 0
    graphed_kinds = {kind for (kind, _, _), piece in pieces._pieces.items() if piece.graph is not None}
    assert "attn" in graphed_kinds
    # the sync and prefetch steps replay the experts pieces; the runahead decoder's expert micro-steps
    # replay its own graphs (tests/engine/test_tiers_pieces.py)
    assert ("experts" in graphed_kinds) == (scheduler != "runahead")


def test_piecewise_graphs_with_mli_equal_eager(kernel_model):
    """MLI on the kernel path (selections cross layers through the static selection buffer)."""
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 500, (40 + 23 * i,), generator=gen).tolist() for i in range(3)]
    config = dict(device="cuda", dtype="bfloat16", mli=True)
    eager = Engine.load(str(kernel_model), EngineConfig(cuda_graphs=False, **config))
    graphed = Engine.load(str(kernel_model), EngineConfig(**config))
    assert graphed.runner.pieces is not None and graphed.runner.pieces.capture
    assert _generate(graphed, prompts, 40) == _generate(eager, prompts, 40)
    assert graphed.runner.pieces.replays > 0


def test_a_capture_survives_another_thread_pinning_host_memory():
    """A warm-start thread reading files into pinned memory while the engine captures a decode graph
    (seen on the H200: the global capture mode failed the capture and the thread's allocation)."""
    x = torch.arange(1024, dtype=torch.float32, device="cuda")
    pinned: list[torch.Tensor] = []
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with capturing(graph, None):
        y = x * 2
        # a size the caching host allocator has not seen, so that it asks CUDA for new memory
        thread = threading.Thread(target=lambda: pinned.append(torch.empty(3 << 20, pin_memory=True)))
        thread.start()
        thread.join()
        y += 1
    assert len(pinned) == 1 and pinned[0].is_pinned()
    x.fill_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(y, 3.0))
