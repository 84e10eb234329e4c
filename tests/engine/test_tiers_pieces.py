"""Tiered decode steps with offloaded experts (and MLI) run as pieces (hearth.engine.piecewise), the
attention pieces per set of requests and tier layout.

On the CPU nothing can be captured: ``PiecewiseDecode.record`` is replaced by an emulation whose first
run is the step's real work and whose "replays" run the same piece again into its outputs, with every
piece's expert-cache backend in the fused kernel as on CUDA (so every piece, the experts piece
included, is "captured"). Inside every run of a piece the host-sync guard is active
(tests/engine/no_host_sync.py): a piece that passed has no host synchronisation for a real capture to
bake in. Greedy tokens equal tiers off: the 8 candidate pages cover every cold page of these short
runs (6 pages of 16 at most, one hot), so the coarse-to-fine selection is the exact one.
"""

from __future__ import annotations

import pytest
import torch

from hearth.engine import Engine, EngineConfig, SamplingParams
from hearth.engine.offload_setup import CacheResidency
from hearth.engine.piecewise import PiecewiseDecode
from hearth.engine.testing.tiny import KERNEL_SHAPES, write_tiny_model
from hearth.offload.experts import OffloadedExperts
from tests.engine.conftest import TEST_DEVICE, run_to_completion
from tests.engine.no_host_sync import NoHostSync

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
# index_topk 64 at block 16: 100-token prompts reach past the 1-page key ring and the 96-row latent window
PROMPT = [(13 * j + 7) % 460 + 20 for j in range(100)]
TIERS = dict(index_key_hot_pages=1, index_key_candidate_pages=8, index_key_cache_pages=8, latent_hot_rows=96)


@pytest.fixture(scope="module")
def kernel_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiers_p") / "deepseek_v32", "deepseek_v32", seed=3,
                            overrides=KERNEL_SHAPES)


def _engine(path, slots: int = 4, **options) -> Engine:
    """Experts offloaded behind a ``slots``-slot cache per layer (of 8 experts), the kernel path (the fixture),
    the offloaded experts in the fused kernel as on CUDA (the CPU default, one expert at a time, reads
    expert counts back: a host sync by design)."""
    config = EngineConfig(device=TEST_DEVICE, dtype="bfloat16", block_size=16, max_num_batched_tokens=64,
                          cuda_graphs=False, offload="always", expert_cache_slots=slots, host_experts="off", **options)
    engine = Engine.load(str(path), config)
    engine.runahead_gate = None  # "runahead" runs the decoder (auto's gate: tests/engine/test_link_gate.py)
    pieces = engine.runner.pieces
    assert pieces is not None and pieces.offloaded
    for backend in pieces.offloaded.values():
        backend.use_kernel = True
    return engine


class _EmulatedGraph:
    """A piece's capture on the CPU: replay runs the piece again into the outputs the capture returned."""

    def __init__(self, fn, out: dict[str, torch.Tensor], guard: NoHostSync) -> None:
        self.fn, self.out, self.guard = fn, out, guard

    def replay(self) -> None:
        with self.guard:
            for name, value in self.fn().items():
                self.out[name].copy_(value)


def _emulate_captures(pieces: PiecewiseDecode, monkeypatch) -> list[int]:
    """Every piece "captured" (``record`` emulated, the guard active in every run of a piece); returns
    the list the number of pieces recorded so far is kept in (one entry)."""
    guard = NoHostSync(monkeypatch)
    recorded = [0]

    def record(fn):
        recorded[0] += 1
        with guard:
            out = fn()  # the step's real work, as the side-stream run before the real capture
        captured = {name: value.clone() for name, value in out.items()}
        return out, _EmulatedGraph(fn, captured, guard), captured

    monkeypatch.setattr(OffloadedExperts, "capturable", property(lambda self: self.use_kernel))
    monkeypatch.setattr(pieces, "record", record)
    pieces.capture = True
    return recorded


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="emulates capture on the CPU (CUDA captures for real)")
@pytest.mark.parametrize("mli", [False, True])
def test_tiered_decode_with_offloaded_experts_runs_in_pieces(kernel_model, kernel_path, monkeypatch, mli):
    expected = run_to_completion(_engine(kernel_model, mli=mli), [PROMPT], GREEDY)
    tiered = _engine(kernel_model, mli=mli, **TIERS)
    runner, pieces = tiered.runner, tiered.runner.pieces
    assert runner.decode_tiers is not None and runner.graphs is None and runner.features.attention.mli == mli
    recorded = _emulate_captures(pieces, monkeypatch)
    keys = []
    enter = pieces.enter

    def entering(n, tiers, pad):
        keys.append(None if tiers is None else (tuple(tiers[0]), tiers[1]))
        return enter(n, tiers, pad)

    pieces.enter = entering
    assert run_to_completion(tiered, [PROMPT], GREEDY) == expected
    # every decode step went through the pieces as one tiered request (the first token is the prefill's)
    assert len(keys) == GREEDY.max_tokens - 1 and None not in keys
    layers = runner.model_config.num_hidden_layers
    assert pieces.replays > 0 and recorded[0] >= layers + 2  # embed, every attention, logits at least
    assert all(piece.graph is not None for piece in pieces._all_pieces())  # none ran outside a "graph"
    assert pieces.fallbacks == 0  # a 4-slot pool holds a token's two experts: the experts piece ran
    assert not runner.key_tiers.tiers and not runner.latent_tiers.tiers  # released with the request


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="emulates capture on the CPU (CUDA captures for real)")
def test_runahead_runs_tiered_attention_pieces_per_group(kernel_model, kernel_path, monkeypatch):
    """Two requests under the runahead decoder: each attention micro-step stages its group of tiered
    requests into the pieces of that group's tier key (no padding rows), tokens equal tiers off. (3 slots:
    with room for both requests' experts at once they would decode as sync, ``api.auto_scheduler``.)"""
    prompts, sampling = [PROMPT, PROMPT[:90]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    plain = _engine(kernel_model, slots=3, scheduler="runahead")
    plain.runner.residency.use_kernel = True  # the expert micro-steps in the fused kernel, as captured below
    expected = run_to_completion(plain, prompts, sampling)
    tiered = _engine(kernel_model, slots=3, scheduler="runahead", **TIERS)
    pieces = tiered.runner.pieces
    assert tiered.decoder is not None and tiered.decoder.pieces is pieces
    _emulate_captures(pieces, monkeypatch)
    tiered.runner.residency.use_kernel = True
    monkeypatch.setattr(CacheResidency, "capturable", property(lambda self: self.use_kernel))
    groups = []
    attend_rows = pieces.attend_rows

    def recording(layer, rows, hidden, selections, tiers=None):
        groups.append((len(rows), tiers))
        return attend_rows(layer, rows, hidden, selections, tiers)

    pieces.attend_rows = recording
    assert run_to_completion(tiered, prompts, sampling) == expected
    assert tiered.decoder.micro_steps > 0 and groups and all(t is not None and len(t[0]) == n for n, t in groups)
    assert max(n for n, _ in groups) == 2  # both requests in one attention piece
    assert all(piece.graph is not None for piece in pieces._all_pieces())
    # the expert micro-steps: one captured launch sequence per pair bucket, replayed
    slab = tiered.decoder.slab
    assert slab.graphs and all(piece.graph is not None for piece in slab.graphs.values()) and slab.replays > 0
    assert tiered.decoder.num_held == 0


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="emulates capture on the CPU (CUDA captures for real)")
def test_the_runahead_expert_step_is_captured_at_every_pair_bucket_before_use(kernel_model, kernel_path, monkeypatch):
    """``RunaheadDecoder.warm_up`` (the engine's warm-up calls it after its rounds, which run sync steps)
    captures the expert micro-step at every pair bucket that max_num_seqs requests can reach, on padding
    rows that leave every flight row as it was; two requests running ahead through a 3-slot pool then
    replay those graphs and capture none, with the tokens of a decoder that never warmed up."""
    prompts, sampling = [PROMPT[:40], PROMPT[:30]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    options = dict(slots=3, scheduler="runahead", max_num_seqs=4)
    plain = _engine(kernel_model, **options)
    plain.runner.residency.use_kernel = True  # the expert micro-steps in the fused kernel, as captured below
    expected = run_to_completion(plain, prompts, sampling)
    assert plain.decoder.expert_steps > 0
    warmed = _engine(kernel_model, **options)
    warmed.runner.residency.use_kernel = True
    pieces, slab = warmed.runner.pieces, warmed.decoder.slab
    _emulate_captures(pieces, monkeypatch)
    assert warmed.decoder.warm_up(4) == 0  # nothing to capture while the residency's compute is not capturable
    monkeypatch.setattr(CacheResidency, "capturable", property(lambda self: self.use_kernel))
    torch.manual_seed(0)
    slab.hidden.normal_()
    rows = slab.hidden[:slab.scratch].clone()
    k = warmed.runner.model_config.num_experts_per_tok
    buckets = {slab.pair_bucket(n, pieces) for n in range(1, 4 * k + 1)}
    assert pieces.max_batch == 4 and max(buckets) == 4 * k > pieces.max_batch  # past the decode buckets too
    assert warmed.decoder.warm_up(4) == len(buckets)
    assert {key[0] for key in slab.graphs} == buckets and all(p.graph is not None for p in slab.graphs.values())
    assert torch.equal(slab.hidden[:slab.scratch], rows)  # only the scratch row was written
    captured = dict(slab.graphs)
    assert run_to_completion(warmed, prompts, sampling) == expected
    assert warmed.decoder.expert_steps > 0 and slab.replays > 0
    assert slab.graphs == captured  # every micro-step replayed a warm-up graph


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA graphs need a GPU (the CPU tests above emulate them)")
@pytest.mark.parametrize("mli", [False, True])
def test_tiered_pieces_in_cuda_graphs_equal_tiers_off(kernel_model, kernel_path, mli):
    """Real captures: long enough that the tiers' host pools grow while decoding, so the step's tier
    layout changes and its attention pieces are captured again, with tokens equal to tiers off. The 12
    candidate pages cover every cold page of the 148-token run (10 pages of 16, one hot)."""
    sampling = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    config = dict(device=TEST_DEVICE, dtype="bfloat16", block_size=16, max_num_batched_tokens=64, mli=mli,
                  offload="always", expert_cache_slots=4, host_experts="off")
    expected = run_to_completion(Engine.load(str(kernel_model), EngineConfig(**config)), [PROMPT], sampling)
    tiered = Engine.load(str(kernel_model), EngineConfig(**config, index_key_hot_pages=1, index_key_candidate_pages=12,
                                                         index_key_cache_pages=12, latent_hot_rows=96))
    pieces = tiered.runner.pieces
    assert pieces is not None and pieces.capture and tiered.runner.decode_tiers is not None
    layouts = set()
    enter = pieces.enter

    def entering(n, tiers, pad):
        layouts.add(None if tiers is None else tiers[1])
        return enter(n, tiers, pad)

    pieces.enter = entering
    assert run_to_completion(tiered, [PROMPT], sampling) == expected
    assert None not in layouts and len(layouts) >= 2, layouts  # the layout changed: attention recaptured
    assert pieces.replays > 0 and all(piece.graph is not None for piece in pieces._all_pieces())


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA graphs need a GPU (the CPU tests above emulate them)")
def test_runahead_expert_micro_steps_in_cuda_graphs_equal_eager(kernel_model, kernel_path):
    """Real captures of the runahead decoder's expert micro-steps (one graph per pair bucket over its
    flight rows): three requests through a 3-slot pool (their experts never fit at once, so the decoder
    runs ahead), tokens equal the same decoder with graphs off."""
    prompts = [PROMPT, PROMPT[:90], PROMPT[:70]]
    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    config = dict(device=TEST_DEVICE, dtype="bfloat16", block_size=16, max_num_batched_tokens=64,
                  offload="always", expert_cache_slots=3, host_experts="off", scheduler="runahead")
    eager = Engine.load(str(kernel_model), EngineConfig(**config, cuda_graphs=False))
    graphs = Engine.load(str(kernel_model), EngineConfig(**config))
    eager.runahead_gate = graphs.runahead_gate = None  # the decoder itself, whatever auto's gate would pick
    expected = run_to_completion(eager, prompts, sampling)
    assert eager.decoder.expert_steps > 0 and eager.decoder.slab.replays == 0
    graphs.warm_up()  # its last act captures the decoder's expert micro-step at every pair bucket
    slab = graphs.decoder.slab
    captured = dict(slab.graphs)
    assert len(captured) >= len(graphs.runner.pieces.sizes)
    assert run_to_completion(graphs, prompts, sampling) == expected
    assert graphs.decoder.expert_steps > 0 and slab.replays > 0
    assert all(piece.graph is not None for piece in slab.graphs.values())
    assert slab.graphs == captured  # the user's rounds captured nothing
    assert graphs.decoder.num_held == 0
