"""ExpertStore filled from a small safetensors checkpoint equals the checkpoint's tensors."""

import pytest
import torch

from hearth.offload.expert_store import ExpertLayout, ExpertStore
from tests.offload.ckpt_util import make_expert_tensors, write_checkpoint

LAYERS = [3, 5]


def _check_equal(store: ExpertStore, tensors: dict, num_experts: int, dtype: torch.dtype) -> None:
    inter = store.layout.inter
    for layer in LAYERS:
        w = store.weights(layer)
        for e in range(num_experts):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            pairs = [(w.w13[e, :inter], f"{p}.gate_proj.weight"), (w.w13[e, inter:], f"{p}.up_proj.weight"),
                     (w.w2[e], f"{p}.down_proj.weight")]
            if store.layout.is_fp8:
                rows = w.s13.shape[1] // 2
                pairs += [(w.s13[e, :rows], f"{p}.gate_proj.weight_scale_inv"),
                          (w.s13[e, rows:], f"{p}.up_proj.weight_scale_inv"),
                          (w.s2[e], f"{p}.down_proj.weight_scale_inv")]
            for got, name in pairs:
                want = tensors[name].to(dtype) if not name.endswith("scale_inv") else tensors[name]
                assert got.dtype == want.dtype
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_store_equals_checkpoint(tmp_path, dtype):
    hidden, inter, num_experts = 200, 136, 5  # partial 128-blocks on both dims
    tensors = make_expert_tensors(LAYERS, num_experts, hidden, inter, dtype)
    root = write_checkpoint(tmp_path / "ckpt", tensors)
    store = ExpertStore.from_safetensors(root, LAYERS, num_experts)
    assert store.layout == ExpertLayout(hidden, inter, dtype)
    if dtype == torch.float8_e4m3fn:
        assert store.weights(3).s13.shape == (num_experts, 4, 2)
        assert store.weights(3).s2.shape == (num_experts, 2, 2)
    _check_equal(store, tensors, num_experts, dtype)
    assert store.layer_buffer(3).shape == (num_experts, store.layout.record_bytes)
    assert store.expert(5, 2).is_contiguous()
    assert torch.equal(store.to_device(5, "cpu"), store.layer_buffer(5))


def test_store_from_file_list_and_dtype_conversion(tmp_path):
    tensors = make_expert_tensors(LAYERS, 3, 64, 40, torch.float32, seed=1)
    root = write_checkpoint(tmp_path / "ckpt", tensors, num_files=3)
    files = sorted(root.glob("*.safetensors"))
    store = ExpertStore.from_safetensors(files, LAYERS, 3, dtype=torch.bfloat16)
    assert store.layout.dtype == torch.bfloat16
    _check_equal(store, tensors, 3, torch.bfloat16)


def test_missing_tensor_is_named(tmp_path):
    tensors = make_expert_tensors(LAYERS, 3, 64, 40, torch.bfloat16)
    del tensors["model.layers.5.mlp.experts.2.down_proj.weight"]
    root = write_checkpoint(tmp_path / "ckpt", tensors)
    with pytest.raises(KeyError, match=r"model\.layers\.5\.mlp\.experts\.2\.down_proj\.weight"):
        ExpertStore.from_safetensors(root, LAYERS, 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback when pinning is impossible")
def test_pin_falls_back_to_pageable():
    store = ExpertStore(ExpertLayout(64, 40, torch.bfloat16), LAYERS, 4, pin=True)
    assert store.pinned_bytes == 0 and not store.is_pinned
    assert store.total_bytes == 2 * 4 * store.layout.record_bytes
