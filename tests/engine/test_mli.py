"""Multi-layer Indexer and IndexCache retention overrides (engine options).

MLI, as specified: an indexer layer attends the selection computed by the previous indexer layer
(the first indexer layer uses its own); its own indexer feeds the layers after it. With retention
1 (every layer has an indexer) that is the reference selection shifted by one layer.
"""

from __future__ import annotations

import pytest
import torch

from hearth.engine import load_model
from hearth.engine.models.mla import MLAttention
from tests.engine.conftest import TEST_DEVICE


def _capture(monkeypatch):
    """Record, per layer, the selection each layer attended and the one its indexer computed."""
    used, computed = {}, {}
    original = MLAttention._selections

    def spy(self, x, q_resid, cos, sin, ctx):
        result = original(self, x, q_resid, cos, sin, ctx)
        if x.is_cuda:  # MLI computes ctx.selections on a side stream, joined only after the attention
            torch.cuda.synchronize(x.device)
        used[self.layer] = [t.clone() for t in result]
        if self.indexer is not None:
            computed[self.layer] = [ctx.selections[i].clone() for i in range(len(ctx.seqs))]
        return result

    monkeypatch.setattr(MLAttention, "_selections", spy)
    return used, computed


def _prompt(n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(9)).tolist()


def test_mli_attends_the_previous_indexer_layers_selection(tiny_models, monkeypatch):
    path = str(tiny_models["deepseek_v32"])
    plain = load_model(path, device=TEST_DEVICE, dtype="float32")
    mli = load_model(path, device=TEST_DEVICE, dtype="float32", mli=True)
    used, computed = _capture(monkeypatch)
    ids = _prompt(48)
    got = mli.logits(ids)
    layers = mli.config.num_hidden_layers
    assert torch.equal(used[0][0], computed[0][0])
    for layer in range(1, layers):
        assert torch.equal(used[layer][0], computed[layer - 1][0])
    # The shift changes the math once sparsity is active. (How much it costs in quality depends on
    # adjacent layers selecting alike, which trained models do and random tiny ones do not.)
    ref = plain.logits(ids)
    assert not torch.allclose(got, ref, atol=1e-4)
    # Up to index_topk tokens every selection is "all causal keys": MLI changes nothing there.
    assert torch.allclose(got[:16], ref[:16], atol=1e-4)


def test_mli_first_layer_equals_plain_model(tiny_models, monkeypatch):
    """Layer 0 and layer 1 see the same inputs in both modes; layer 1's indexer output must match
    what the plain model computes at layer 1 (MLI only changes which selection is attended)."""
    path = str(tiny_models["deepseek_v32"])
    used_plain, computed_plain = _capture(monkeypatch)
    load_model(path, device=TEST_DEVICE, dtype="float32").logits(_prompt(40))
    plain_sel = {k: v[0] for k, v in computed_plain.items()}
    used_plain.clear()
    computed_plain.clear()
    load_model(path, device=TEST_DEVICE, dtype="float32", mli=True).logits(_prompt(40))
    assert torch.equal(computed_plain[0][0], plain_sel[0])
    assert torch.equal(computed_plain[1][0], plain_sel[1])


@pytest.mark.parametrize("freq,offset,expected", [(2, 1, ("full", "shared", "full")),
                                                  (2, 2, ("full", "full", "shared"))])
def test_index_retention_override(tiny_models, monkeypatch, freq, offset, expected):
    path = str(tiny_models["deepseek_v32"])
    model = load_model(path, device=TEST_DEVICE, dtype="float32", index_topk_freq=freq,
                       index_skip_topk_offset=offset)
    assert model.config.indexer_types == expected
    used, computed = _capture(monkeypatch)
    model.logits(_prompt(40))
    for layer, kind in enumerate(expected):
        if kind == "shared":
            assert layer not in computed
            assert torch.equal(used[layer][0], used[layer - 1][0])
    shared = expected.index("shared")
    assert model.runner.model.layers[shared].self_attn.indexer is None
