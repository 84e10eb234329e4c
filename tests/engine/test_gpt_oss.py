"""gpt-oss: config parsing, the MXFP4 codec, the release's MXFP4 checkpoint layout against
transformers (which dequantises it itself), that the sliding window and the sinks really act on the
test prompts, and the experts through the offload path. (fp32 conformance on the float checkpoint and
40 greedy tokens run with the other families in test_conformance.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hearth.engine import CheckpointError, Engine, EngineConfig, SamplingParams, load_model
from hearth.engine.api import UnsupportedModelError
from hearth.engine.config import ModelConfig
from hearth.engine.testing.conformance import ConformanceModel
from hearth.engine.testing.tiny import tiny_config, write_tiny_model
from hearth.kernels.moe.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from tests.engine.conftest import TEST_DEVICE, hf_greedy, hf_model, run_to_completion

FP32_ATOL = 1e-4
PROMPT = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("gpt_oss_mxfp4") / "gpt_oss", "gpt_oss", seed=4, mxfp4=True)


def _hf_mxfp4(path):
    transformers = pytest.importorskip("transformers")
    # transformers 5.17 dequantises MXFP4 experts to bf16 whatever the model's dtype (5.24 to it); every
    # MXFP4 value is exact in bf16, so casting back to fp32 gives the fp32 reference in both releases.
    return hf_model(path, quantization_config=transformers.Mxfp4Config(dequantize=True)).float()


def _reference_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_config_reads_the_release_keys():
    raw = tiny_config("gpt_oss")
    config = ModelConfig.from_dict(raw)
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert [config.window(i) for i in range(4)] == [8, None, 8, None]
    assert config.attention_sinks and config.attention_bias and config.swiglu_limit == 1.5
    assert config.rope.rope_type == "yarn" and not config.rope.truncate
    assert config.n_routed_experts == 8 and config.num_experts_per_tok == 2
    defaults = ModelConfig.from_dict({k: v for k, v in raw.items()
                                      if k not in ("layer_types", "rope_scaling", "rope_theta", "swiglu_limit")})
    assert defaults.layer_types[:2] == ("sliding_attention", "full_attention")  # transformers' default pattern
    assert (defaults.rope.theta, defaults.rope.factor, defaults.swiglu_limit) == (150000.0, 32.0, 7.0)


@pytest.mark.parametrize("change,field", [({"layer_types": ["sliding_attention"]}, "layer_types"),
                                          ({"quantization_config": {"quant_method": "fp8"}}, "quant_method"),
                                          ({"sliding_window": None}, "sliding_window")])
def test_bad_configs_name_the_field(change, field):
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_dict({**tiny_config("gpt_oss"), **change})


def test_mxfp4_decodes_every_code_and_scale():
    codes = torch.arange(256, dtype=torch.uint8).view(8, 2, 16)  # every byte once
    scales = torch.tensor([[127, 128], [120, 130], [0, 140], [127, 127], [126, 1], [127, 135], [100, 127], [3, 9]],
                          dtype=torch.uint8)
    got = dequantize_mxfp4(codes, scales, torch.float32)
    for row in range(8):
        for group in range(2):
            for j in range(32):
                byte = int(codes[row, group, j // 2])
                code = byte & 0xF if j % 2 == 0 else byte >> 4
                sign = -1.0 if code & 8 else 1.0
                exp, mant = (code >> 1) & 3, code & 1
                value = sign * (mant * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + mant / 2))
                want = value * 2.0 ** (int(scales[row, group]) - 127)
                assert got[row, group * 32 + j].item() == want


def test_mxfp4_round_trip_keeps_representable_values():
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, 6.0] * 4)
    weight = torch.stack((grid * 0.25, grid * 8.0))  # (2, 64): two rows, two groups each
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (2, 2, 16) and scales.shape == (2, 2)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), weight)
    noisy = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    err = (dequantize_mxfp4(*quantize_mxfp4(noisy), torch.float32) - noisy).abs()
    assert err.max() <= noisy.abs().max() / 6 + 1e-6  # at most half a step of the coarsest code


def test_mxfp4_checkpoint_matches_transformers(mxfp4_model):
    names = json.loads((mxfp4_model / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    reference = _hf_mxfp4(mxfp4_model)
    ref = _reference_logits(reference, PROMPT)
    ours = load_model(str(mxfp4_model), device=TEST_DEVICE, dtype="float32")
    assert (ours.logits(PROMPT) - ref).abs().max() < FP32_ATOL
    assert (ours.logits(PROMPT, chunk_size=7) - ref).abs().max() < FP32_ATOL
    expected = hf_greedy(reference, PROMPT[:20], 40)
    engine = Engine.load(str(mxfp4_model), EngineConfig(device=TEST_DEVICE, dtype="float32", block_size=16))
    sampling = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    got = [t for e in engine.generate(prompt_token_ids=PROMPT[:20], sampling=sampling)
           if hasattr(e, "token_ids") for t in e.token_ids]
    assert got == expected


def test_resident_mxfp4_experts_stay_packed_through_the_fused_kernel(mxfp4_model, fused_experts_path):
    """With the fused kernel path (CUDA; on the CPU the fixture forces it, the kernel interpreted) the
    release's MXFP4 experts stay MXFP4 on the device, 4.25 bits a weight, and the kernel reads them:
    the logits and greedy tokens of the experts dequantised at load (the plain path)."""
    plain = Engine.load(str(mxfp4_model), EngineConfig(device=TEST_DEVICE, dtype="float32", use_kernels="never"))
    engine = Engine.load(str(mxfp4_model), EngineConfig(device=TEST_DEVICE, dtype="float32"))
    assert engine.runner.features.fused_experts and not plain.runner.features.fused_experts
    moe = engine.runner.model.layers[0].mlp
    blocks, scales = moe.experts.mxfp4("gate_up_proj")
    assert blocks.dtype == scales.dtype == torch.uint8 and "gate_up_proj" not in dict(moe.experts.named_parameters())
    assert moe.backend.format == "mxfp4" and moe.backend.w13.data_ptr() == blocks.data_ptr()  # no copy
    assert plain.runner.model.layers[0].mlp.experts.mxfp4("gate_up_proj") is None  # dequantised at load
    prompts = [PROMPT[:20], PROMPT[5:31]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert run_to_completion(engine, prompts, greedy) == run_to_completion(plain, prompts, greedy)
    want, got = ConformanceModel(plain.runner).logits(PROMPT), ConformanceModel(engine.runner).logits(PROMPT)
    assert (got - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())
    for layer in engine.runner.model.layers:  # the per-expert loop dequantises the packed experts it runs
        layer.mlp.backend = None
    loop = ConformanceModel(engine.runner).logits(PROMPT)
    assert (loop - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())


def _edited(src, dst, edit_config=None, edit_tensors=None):
    shutil.copytree(src, dst)
    if edit_config:
        raw = json.loads((dst / "config.json").read_text())
        edit_config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    if edit_tensors:
        for file in sorted(dst.glob("*.safetensors")):
            tensors = load_file(str(file))
            edit_tensors(tensors)
            save_file(tensors, str(file), metadata={"format": "pt"})
    return dst


def test_window_and_sinks_change_the_answer(tiny_models, tmp_path):
    """The tiny config's window (8) is shorter than the prompt and its sinks are large: removing
    either changes the logits, so the conformance tests exercise both."""
    base = load_model(str(tiny_models["gpt_oss"]), device=TEST_DEVICE, dtype="float32").logits(PROMPT)
    wide = _edited(tiny_models["gpt_oss"], tmp_path / "wide", edit_config=lambda raw: raw.update(sliding_window=4096))

    def zero_sinks(tensors):
        for name in tensors:
            if name.endswith(".sinks"):
                tensors[name] = torch.full_like(tensors[name], -1e4)

    no_sinks = _edited(tiny_models["gpt_oss"], tmp_path / "no_sinks", edit_tensors=zero_sinks)
    unwindowed = load_model(str(wide), device=TEST_DEVICE, dtype="float32").logits(PROMPT)
    assert (unwindowed[:8] - base[:8]).abs().max() < 1e-4  # the first 8 tokens see their whole past anyway
    assert (unwindowed[8:] - base[8:]).abs().max() > 1e-2
    sinkless = load_model(str(no_sinks), device=TEST_DEVICE, dtype="float32").logits(PROMPT)
    assert (sinkless - base).abs().max() > 1e-2


def test_mxfp4_blocks_without_scales_are_a_clear_error(mxfp4_model, tmp_path):
    def drop(tensors):
        tensors.pop("model.layers.1.mlp.experts.down_proj_scales", None)

    broken = _edited(mxfp4_model, tmp_path / "broken", edit_tensors=drop)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"].pop("model.layers.1.mlp.experts.down_proj_scales")
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="down_proj_blocks' has no '.*down_proj_scales'"):
        load_model(str(broken), device=TEST_DEVICE, dtype="float32")


@pytest.mark.parametrize("offload,packed", [(False, False), (False, True), (True, False)])
def test_mxfp4_nan_scale_is_refused(mxfp4_model, tmp_path, offload, packed, request):
    """A scale byte of 255 (e8m0's NaN) turns its whole group of 32 values non-finite: refused at load,
    whether the experts load into the model (dequantised, or kept MXFP4 for the fused kernel) or into
    the offload store."""
    if packed:
        request.getfixturevalue("fused_experts_path")
    name = "model.layers.1.mlp.experts.down_proj_scales"

    def poison(tensors):
        if name in tensors:
            tensors[name][0, 0, 0] = 255

    broken = _edited(mxfp4_model, tmp_path / "broken", edit_tensors=poison)
    placement = {"offload": "always", "expert_cache_slots": 3} if offload else {}
    with pytest.raises(CheckpointError, match="down_proj.* 32 NaN/inf value"):
        Engine.load(str(broken), EngineConfig(device=TEST_DEVICE, dtype="float32", **placement))


@pytest.mark.parametrize("scheduler", ["sync", "runahead"])
@pytest.mark.parametrize("mxfp4", [False, True])
def test_offloaded_experts_give_the_same_tokens(tiny_models, mxfp4_model, scheduler, mxfp4):
    path = str(mxfp4_model if mxfp4 else tiny_models["gpt_oss"])
    prompts = [PROMPT[:20], PROMPT[5:31]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = run_to_completion(Engine.load(path, EngineConfig(device=TEST_DEVICE, dtype="float32")), prompts,
                                 greedy)
    engine = Engine.load(path, EngineConfig(device=TEST_DEVICE, dtype="float32", offload="always",
                                            expert_cache_slots=3, scheduler=scheduler))
    assert engine.runner.placement.offload
    store = engine.runner.expert_cache.store
    assert store.layout.bias  # biases travel with each expert
    assert (store.packing is not None) == mxfp4  # the release's MXFP4 stays MXFP4 in RAM and on the link
    assert run_to_completion(engine, prompts, greedy) == expected
    stats = engine.stats().extra
    assert stats["expert_cache_misses"] > 0 and stats["expert_cache_evictions"] > 0
    total = engine.runner.expert_cache.stats()["total"]
    assert total["bytes_fetched"] == total["misses"] * store.record_bytes
    if mxfp4:
        assert store.record_bytes == store.packing.record_bytes < store.layout.record_bytes / 3
