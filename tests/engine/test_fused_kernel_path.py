"""The DSA kernel path's fused small kernels (RMSNorm + residual, rotary from tables, the MLA latent
write) inside the model (on the CPU under Triton's interpreter; on the GPU machine with
HEARTH_TEST_DEVICE=cuda, on CUDA): the same cache rows and close logits
as the plain-PyTorch path, for prefill, graph-style decode (``DecodeMeta``) and eager decode.
Contexts stay below index_topk, so both paths attend over every key (the FP8 indexer cannot flip a
selection)."""

from __future__ import annotations

import pytest
import torch

from hearth.engine.config import ModelConfig
from hearth.engine.kv_cache import DecodeMeta, ForwardContext, PagedCache, SeqSlice, build_context
from hearth.engine.loader import load_checkpoint
from hearth.engine.models.dsa_kernels import stacked_selections
from hearth.engine.models.mla import AttentionPaths
from hearth.engine.testing.tiny import KERNEL_SHAPES, write_tiny_model
from tests.engine.conftest import TEST_DEVICE

BLOCK = 16
TABLE = [5, 2, 7, 0, 3]  # shuffled pages: 80 positions


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def folder(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("fused") / request.param, request.param, seed=7,
                            overrides=KERNEL_SHAPES)


def _run(folder, use_kernels: bool) -> tuple[list[torch.Tensor], PagedCache, object]:
    config = ModelConfig.from_file(folder)
    dev = torch.device(TEST_DEVICE)
    model = load_checkpoint(folder, dev, torch.bfloat16,
                            attention=AttentionPaths(use_kernels=use_kernels)).eval()
    cache = PagedCache(config, 8, BLOCK, torch.bfloat16, dev, index_fp8=use_kernels)
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(1)).to(dev)
    out = []
    with torch.inference_mode():
        out.append(model(ids[:38], build_context(cache, [(TABLE, 0, 38)], dev)))
        # a decode at position 38 (the kernel path as a CUDA graph runs it: device tensors only; the
        # plain path needs the per-request context), then an eager decode at 39
        pos = torch.tensor([38], device=dev)
        slots = torch.tensor([TABLE[38 // BLOCK] * BLOCK + 38 % BLOCK], device=dev)
        meta = DecodeMeta(torch.tensor([TABLE], dtype=torch.int32, device=dev), (pos + 1).to(torch.int32), 80)
        ctx = ForwardContext(positions=pos, slot_mapping=slots, cache=cache, decode=meta,
                             seqs=[SeqSlice(start=0, q_len=1, context_len=1, slots=slots)])
        if not use_kernels:
            ctx = build_context(cache, [(TABLE, 38, 1)], dev)
        out.append(model(ids[38:39], ctx))
        out.append(model(ids[39:40], build_context(cache, [(TABLE, 39, 1)], dev)))
    return out, cache, model


def test_kernel_path_matches_plain_path(folder):
    got, cache, model = _run(folder, use_kernels=True)
    assert model.layers[0].self_attn.rope_table is not None and model.model.norm.use_kernel
    want, ref_cache, _ = _run(folder, use_kernels=False)
    # Layer 0's latent rows (both paths see the same input): equal up to one bf16 ulp (the norm's sum
    # order); later layers' inputs already differ by the attention kernels' bf16 rounding.
    a, b = cache.latent[0].float(), ref_cache.latent[0].float()
    assert bool(((a - b).abs() <= b.abs() * 2.0**-7 + 1e-6).all()), float((a - b).abs().max())
    assert (a == b).float().mean() >= 0.98
    for layer, (a, b) in enumerate(zip(cache.latent[1:], ref_cache.latent[1:]), start=1):
        rel = float((a.float() - b.float()).norm() / b.float().norm())
        assert rel < 0.1, f"layer {layer}: {rel}"  # (measured up to 0.053: GLM-5 layer 3)
    for step, (g, w) in enumerate(zip(got, want)):
        err = (g.float() - w.float()).abs().max(-1).values
        scale = w.float().abs().max(-1).values
        assert float((err / scale).median()) < 0.05, f"step {step}"
        assert (g.argmax(-1) == w.argmax(-1)).float().mean() >= 0.9, f"step {step}"


def test_eager_decode_tables_padded_to_the_graphs_width(folder):
    """An eager decode step's block tables padded to a fixed width (``PagedCache.table_width``, the CUDA
    graphs' width, so the decode kernels compile once whatever the context) read the same pages: the
    same logits as tables exactly as long as the context, and the tables are that wide."""
    config = ModelConfig.from_file(folder)
    dev = torch.device(TEST_DEVICE)
    model = load_checkpoint(folder, dev, torch.bfloat16, attention=AttentionPaths(use_kernels=True)).eval()
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(2)).to(dev)
    out = []
    for width in (None, 12):
        cache = PagedCache(config, 8, BLOCK, torch.bfloat16, dev, index_fp8=True, table_width=width)
        with torch.inference_mode():
            model(ids[:39], build_context(cache, [(TABLE, 0, 39)], dev))
            ctx = build_context(cache, [(TABLE, 39, 1)], dev)
            assert ctx.decode.block_tables.shape == (1, width or len(TABLE))
            out.append(model(ids[39:40], ctx).float())
    err = float((out[0] - out[1]).abs().max() / out[0].abs().max())
    assert err < 0.02 and bool((out[0].argmax(-1) == out[1].argmax(-1)).all()), err


def test_kernel_router_chooses_the_plain_routers_experts(folder):
    """The router kernel against the plain router of the same layer (DeepSeek-V3.2: 4 groups, keep 2;
    GLM-5: one group), at 7 tokens: the same experts in the same order, weights within fp32 rounding."""
    config = ModelConfig.from_file(folder)
    model = load_checkpoint(folder, torch.device(TEST_DEVICE), torch.bfloat16,
                            attention=AttentionPaths(use_kernels=True)).eval()
    gates = [layer.mlp.gate for layer in model.layers if layer.is_moe]
    assert gates and all(gate.use_kernel for gate in gates)
    x = torch.randn(7, config.hidden_size, generator=torch.Generator().manual_seed(2))
    x = x.to(TEST_DEVICE, torch.bfloat16)
    with torch.inference_mode():
        for gate in gates:
            gate.e_score_correction_bias.normal_(0, 0.05)  # (zero in the tiny checkpoint)
            ids, weights = gate(x)
            gate.use_kernel = False
            want_ids, want_weights = gate(x)
            assert torch.equal(ids, want_ids)
            torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=0)


def test_decode_selections_are_stacked_without_a_copy():
    picked = torch.arange(4 * 6, dtype=torch.int32).view(4, 1, 6)  # as the decode indexer returns them
    rows = stacked_selections(list(picked.unbind(0)))
    assert rows.shape == (4, 6) and rows.data_ptr() == picked.data_ptr()
    torch.testing.assert_close(rows, picked.view(4, 6), rtol=0, atol=0)
    shuffled = [picked[2], picked[0], picked[3]]  # not evenly spaced rows: a copy, in the given order
    torch.testing.assert_close(stacked_selections(shuffled), torch.stack([s.view(-1) for s in shuffled]),
                               rtol=0, atol=0)
