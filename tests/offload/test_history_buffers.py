"""Prefill history buffers (hearth.offload.history_buffers): two buffers allocated once hold each
layer's history in turn (layer j in buffer j % 2, layer j + 1 loaded before layer j is used), equal
to the keys and latents written so far, across chunks and requests; several requests share them."""

from __future__ import annotations

import os

import pytest
import torch

from hearth.kernels.indexer.reference import act_quant_ue8m0
from hearth.offload.coarse_index import PagePool
from hearth.offload.history_buffers import HistoryBuffers, LayerSources
from hearth.offload.planned_tiers import PlannedKeyConfig, PlannedKeys, PlannedLatentConfig, PlannedLatents

DEVICE = torch.device(os.environ.get("HEARTH_TEST_DEVICE", "cpu"))
PS, WIDTH, LAYERS = 16, 64, 4
KEY_CONFIG = PlannedKeyConfig(page_size=PS, hot_pages=2, candidate_pages=4, cache_pages=4, topk=32)
LATENT_CONFIG = PlannedLatentConfig(width=WIDTH, dtype=torch.bfloat16, ring_rows=16, cache_rows=32, topk=32, block=PS)


class Layer:
    """One layer's tiers of one request and the keys / latents it will be given."""

    def __init__(self, tokens: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        k8, ks = act_quant_ue8m0(torch.randn(tokens, 128, generator=g))
        self.k8, self.ks = k8.to(DEVICE), ks.to(DEVICE)
        self.rows = torch.randn(tokens, WIDTH, generator=g).to(torch.bfloat16).to(DEVICE)
        self.keys = PlannedKeys(KEY_CONFIG, DEVICE, initial_pages=1)
        self.latents = PlannedLatents(LATENT_CONFIG, DEVICE, initial_rows=1)


def _pool(buf: torch.Tensor) -> PagePool:
    pool = PagePool(buf.shape[0], PS, 128, "fp8", DEVICE)
    pool.buf = buf
    return pool


def _run_layer(buffers: HistoryBuffers, seq_id: str, index: int, layer: Layer, first: int, n: int) -> None:
    """What a layer of the model does with a prefill chunk: latents appended (staged into the
    buffer), keys written into the key history and committed, latents read; checks both histories."""
    layer.latents.append(layer.rows[first:first + n])
    keys = buffers.keys(index, seq_id)
    pool = _pool(keys)
    new = torch.arange(first, first + n, device=DEVICE)
    pool.write(new // PS, new % PS, layer.k8[new], layer.ks[new])
    k8, ks = pool.tokens(torch.arange(keys.shape[0], device=DEVICE))
    assert torch.equal(k8[:first + n].view(torch.uint8), layer.k8[:first + n].view(torch.uint8))
    assert torch.equal(ks[:first + n], layer.ks[:first + n])
    layer.keys.commit_chunk(keys, n)
    latents = buffers.latents(index, seq_id)
    assert torch.equal(latents.reshape(-1, WIDTH)[:first + n], layer.rows[:first + n])


def test_three_chunks_through_four_layers_alternate_two_buffers():
    chunks = [37, 50, 29]  # chunks 2 and 3 start inside a page (the partial page comes from the ring)
    layers = [Layer(sum(chunks), seed=layer) for layer in range(LAYERS)]
    buffers = HistoryBuffers(128, PS, DEVICE, keys=True, latent_width=WIDTH)
    held = [t.data_ptr() for t in buffers.key_buffers + buffers.latent_buffers]
    assert buffers.nbytes == HistoryBuffers.bytes_for(128, PS, True, WIDTH * 2) == 2 * 128 * (132 + 2 * WIDTH)
    first = 0
    for n in chunks:
        sources = [LayerSources(i, {"r": layer.keys}, {"r": layer.latents}) for i, layer in enumerate(layers)]
        assert buffers.begin([("r", first, n)], sources) == ["r"]
        for i, layer in enumerate(layers):
            _run_layer(buffers, "r", i, layer, first, n)
            # the views are the two buffers' memory, layer i in buffer i % 2: nothing allocated per chunk
            assert buffers.keys(i, "r").data_ptr() == buffers.key_buffers[i % 2].data_ptr()
            assert buffers.latents(i, "r").data_ptr() == buffers.latent_buffers[i % 2].data_ptr()
        # the next layer's copy is issued before a layer reads its buffer (LeanSparse's overlap)
        assert buffers.schedule == [("load", 0, 0), ("load", 1, 1), ("use", 0, 0), ("load", 2, 0), ("use", 1, 1),
                                    ("load", 3, 1), ("use", 2, 0), ("use", 3, 1)]
        first += n
    assert [t.data_ptr() for t in buffers.key_buffers + buffers.latent_buffers] == held
    for layer in layers:  # the tiers hold every token, as with the temporary buffers
        k8, ks = layer.keys.read()
        assert torch.equal(k8.view(torch.uint8), layer.k8.view(torch.uint8)) and torch.equal(ks, layer.ks)
        assert torch.equal(layer.latents.history().view(-1, WIDTH)[:first], layer.rows)


def test_requests_share_the_buffers_as_far_as_they_fit():
    buffers = HistoryBuffers(64, PS, DEVICE, keys=True, latent_width=WIDTH)  # 4 pages
    a, b, c = (Layer(60, seed=s) for s in (1, 2, 3))
    for layer, n in ((a, 20), (b, 10)):  # earlier chunks
        layer.latents.append(layer.rows[:n])
        pool = PagePool(2, PS, 128, "fp8", DEVICE)
        idx = torch.arange(n, device=DEVICE)
        pool.write(idx // PS, idx % PS, layer.k8[:n], layer.ks[:n])
        layer.keys.commit_chunk(pool.buf, n)
    sources = [LayerSources(0, {"a": a.keys, "b": b.keys, "c": c.keys},
                            {"a": a.latents, "b": b.latents, "c": c.latents})]
    # a: 2 pages, b: 2 pages; c (1 page) no longer fits: it takes the temporary path
    assert buffers.begin([("a", 20, 12), ("b", 10, 20), ("c", 0, 9)], sources) == ["a", "b"]
    _run_layer(buffers, "a", 0, a, 20, 12)
    _run_layer(buffers, "b", 0, b, 10, 20)
    assert buffers.keys(0, "b").data_ptr() == buffers.key_buffers[0][2].data_ptr()
    assert buffers.keys(0, "c") is None and buffers.latents(0, "c") is None
    c.latents.append(c.rows[:9])  # not staged: only its tiers get the rows
    assert torch.equal(c.latents.history().view(-1, WIDTH)[:9], c.rows[:9])
    assert buffers.schedule == [("load", 0, 0), ("use", 0, 0)]


def test_layers_are_entered_in_order_and_a_stopped_step_leaves_no_stage():
    layers = [Layer(40, seed=s) for s in range(3)]
    buffers = HistoryBuffers(64, PS, DEVICE, keys=False, latent_width=WIDTH)  # latents only
    assert buffers.key_buffers is None
    sources = [LayerSources(i, latents={"r": layer.latents}) for i, layer in enumerate(layers)]
    buffers.begin([("r", 0, 20)], sources)
    assert buffers.keys(0, "r") is None  # no key buffers
    for layer in layers:
        layer.latents.append(layer.rows[:20])
    assert buffers.latents(2, "r") is not None  # layers 0 and 1 start first
    assert buffers.schedule == [("load", 0, 0), ("load", 1, 1), ("use", 0, 0), ("load", 2, 0), ("use", 1, 1),
                                ("use", 2, 0)]
    with pytest.raises(RuntimeError, match="after a later layer"):
        buffers.latents(1, "r")
    buffers.begin([("r", 20, 20)], sources)
    layers[0].latents.append(layers[0].rows[20:40])  # the step stops after layer 0
    staged = buffers.latents(1, "r").reshape(-1, WIDTH)[20:40].clone()
    buffers.begin([], [])  # e.g. a decode step: the stages of layers 1 and 2 are dropped
    layers[1].latents.append(layers[1].rows[20:21])
    assert torch.equal(buffers.latent_buffers[1][20:40], staged)  # nothing written into the buffer


def test_history_buffers_need_something_to_hold():
    with pytest.raises(ValueError, match="keys, latents or both"):
        HistoryBuffers(64, PS, DEVICE, keys=False, latent_width=None)
