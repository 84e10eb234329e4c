"""plan_memory: fits on the GPU, needs offload, does not fit (error text with numbers), overrides, CPU."""

import pytest

from hearth.offload.planner import (
    DeviceMemory,
    GiB,
    MemoryPlanError,
    ModelFootprint,
    footprint_from_tensor_bytes,
    plan_memory,
)

# A DeepSeek-V3-like model: 58 MoE layers x 256 experts of 44 MB, 16 GiB of everything else.
DSV3 = ModelFootprint(dense_bytes=16 * GiB, expert_bytes=44 * 10**6, num_moe_layers=58, num_experts=256, top_k=8)
SMALL = ModelFootprint(dense_bytes=2 * GiB, expert_bytes=10**6, num_moe_layers=4, num_experts=64, top_k=4)


def test_fits_on_gpu():
    plan = plan_memory(SMALL, kv_cache_bytes=GiB, memory=DeviceMemory(80 * GiB, 64 * GiB))
    assert plan.device == "cuda" and plan.experts == "gpu"
    assert plan.slots_per_layer == 64 and plan.host_bytes == 0
    assert plan.gpu_bytes == 3 * GiB + SMALL.routed_bytes


def test_needs_offload():
    plan = plan_memory(DSV3, kv_cache_bytes=8 * GiB, memory=DeviceMemory(140 * GiB, 900 * GiB))
    assert plan.experts == "offload"
    budget = 138 * GiB - 24 * GiB
    assert plan.slots_per_layer == budget // (58 * 44 * 10**6)
    assert plan.host_bytes == DSV3.routed_bytes
    assert plan.gpu_bytes <= plan.gpu_budget_bytes


def test_dense_does_not_fit_gives_numbers():
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(DSV3, kv_cache_bytes=8 * GiB, memory=DeviceMemory(20 * GiB, 900 * GiB))
    msg = str(err.value)
    assert "16.00 GiB" in msg and "8.00 GiB" in msg and "18.00 GiB" in msg


def test_host_too_small_for_experts():
    with pytest.raises(MemoryPlanError, match=r"routed experts do not fit in host memory: 608.44 GiB > 252.00 GiB"):
        plan_memory(DSV3, kv_cache_bytes=8 * GiB, memory=DeviceMemory(140 * GiB, 256 * GiB))


def test_cache_smaller_than_top_k():
    with pytest.raises(MemoryPlanError, match="at least top_k=8"):
        plan_memory(DSV3, kv_cache_bytes=8 * GiB, memory=DeviceMemory(140 * GiB, 900 * GiB),
                    expert_cache_gib=10)


def test_overrides():
    mem = DeviceMemory(80 * GiB, 64 * GiB)
    capped = plan_memory(SMALL, kv_cache_bytes=GiB, memory=mem, gpu_memory_gib=3.1)
    assert capped.experts == "offload" and capped.gpu_budget_bytes == int(3.1 * GiB)
    forced = plan_memory(SMALL, kv_cache_bytes=GiB, memory=mem, expert_cache_gib=0.05)
    assert forced.experts == "offload"
    assert forced.slots_per_layer == int(0.05 * GiB) // (4 * 10**6)
    assert forced.cache_bytes == forced.slots_per_layer * 4 * 10**6
    with pytest.raises(MemoryPlanError, match="host_memory_gib=0.1"):
        plan_memory(SMALL, kv_cache_bytes=GiB, memory=mem, expert_cache_gib=0.05, host_memory_gib=0.1)
    with pytest.raises(MemoryPlanError, match="expert_cache_gib=100 does not fit"):
        plan_memory(SMALL, kv_cache_bytes=GiB, memory=mem, expert_cache_gib=100)


def test_cpu_only():
    plan = plan_memory(SMALL, kv_cache_bytes=GiB, memory=DeviceMemory(None, 64 * GiB))
    assert plan.device == "cpu" and plan.experts == "cpu" and plan.gpu_bytes == 0
    assert plan.host_bytes == 3 * GiB + SMALL.routed_bytes
    with pytest.raises(MemoryPlanError, match="no GPU"):
        plan_memory(DSV3, kv_cache_bytes=GiB, memory=DeviceMemory(None, 64 * GiB))


def test_footprint_from_tensor_bytes():
    sizes = {"model.embed_tokens.weight": 1000, "model.layers.0.mlp.gate_proj.weight": 500}
    for layer in (1, 2):
        sizes[f"model.layers.{layer}.mlp.shared_experts.up_proj.weight"] = 7
        for e in range(4):
            for p in ("gate_proj", "up_proj", "down_proj"):
                sizes[f"model.layers.{layer}.mlp.experts.{e}.{p}.weight"] = 10
                sizes[f"model.layers.{layer}.mlp.experts.{e}.{p}.weight_scale_inv"] = 1
    fp = footprint_from_tensor_bytes(sizes, top_k=2)
    assert (fp.dense_bytes, fp.expert_bytes, fp.num_moe_layers, fp.num_experts) == (1514, 33, 2, 4)
    assert fp.routed_bytes == 2 * 4 * 33
    # An MTP layer after the last layer (GLM-4.5, DeepSeek-V3): counted only when not told the layers
    mtp = {**sizes, "model.layers.3.eh_proj.weight": 50}
    mtp.update({f"model.layers.3.mlp.experts.{e}.gate_proj.weight": 10 for e in range(4)})
    with_mtp = footprint_from_tensor_bytes(mtp, top_k=2)
    assert (with_mtp.num_moe_layers, with_mtp.dense_bytes) == (3, 1564)
    assert footprint_from_tensor_bytes(mtp, top_k=2, num_layers=3) == fp


def test_stacked_gpt_oss_experts_count_mxfp4_in_ram_and_in_the_gpu_slots():
    """gpt-oss's MXFP4 experts stay MXFP4 in the host store, on the link and in the GPU's cache slots
    (the fused kernel reads them): both plans count the packed records, 3.76x smaller than bf16 ones."""
    import torch

    from hearth.offload.expert_store import ExpertLayout, Mxfp4Packing
    from hearth.offload.planner import footprint_from_stacked_experts

    hidden, inter, experts = 2880, 2880, 128
    layout = ExpertLayout(hidden, inter, torch.bfloat16, bias=True)
    packed = Mxfp4Packing(layout).record_bytes
    assert layout.record_bytes >= (3 * hidden * inter + 2 * inter + hidden) * 2
    assert 3.7 < layout.record_bytes / packed < 3.8  # 16 bits against 4.25 a weight
    mxfp4 = int(experts * 2 * inter * hidden * 4.25 / 8)
    sizes = {"model.embed_tokens.weight": 1000, "model.layers.0.self_attn.q_proj.weight": 500,
             "model.layers.0.mlp.experts.gate_up_proj_blocks": mxfp4, "model.layers.0.mlp.experts.down_proj_blocks": 1,
             "model.layers.1.mlp.experts.gate_up_proj_blocks": mxfp4, "model.layers.1.mlp.router.weight": 7}
    fp = footprint_from_stacked_experts(sizes, 4, experts, packed)
    assert fp.dense_bytes == 1507 and fp.num_moe_layers == 2 and fp.num_experts == experts
    assert fp.routed_bytes == fp.resident_routed_bytes == 2 * experts * packed
    gpu = 2 * GiB + 32 * 2 * packed + 1507 + 10 * GiB // 1000  # room for 32 slots a layer
    plan = plan_memory(fp, 0, DeviceMemory(gpu, 64 * GiB), host_reserve_bytes=0)
    assert plan.experts == "offload" and plan.slots_per_layer == 32
    assert plan.host_bytes == fp.routed_bytes
    assert plan.cache_bytes == 32 * 2 * packed
    # RAM for the MXFP4 store but not for a bf16 one is enough
    plan_memory(fp, 0, DeviceMemory(gpu, fp.routed_bytes + 1), host_reserve_bytes=0)
    with pytest.raises(MemoryPlanError, match="host memory"):
        plan_memory(fp, 0, DeviceMemory(gpu, fp.routed_bytes - 1), host_reserve_bytes=0)


def test_resident_mxfp4_experts_count_at_their_packed_bytes():
    """With the fused MoE kernel gpt-oss's resident experts stay MXFP4 on the GPU: the plan keeps them
    all resident where their packed records fit, though bf16 ones would not (they would be offloaded)."""
    import torch

    from hearth.offload.expert_store import ExpertLayout, Mxfp4Packing
    from hearth.offload.planner import footprint_from_stacked_experts

    hidden, inter, experts = 2880, 2880, 128
    layout = ExpertLayout(hidden, inter, torch.bfloat16, bias=True)
    packed = Mxfp4Packing(layout).record_bytes
    sizes = {"model.embed_tokens.weight": 1000, "model.layers.0.mlp.experts.gate_up_proj_blocks": 1,
             "model.layers.1.mlp.experts.gate_up_proj_blocks": 1}
    resident = footprint_from_stacked_experts(sizes, 4, experts, packed)
    dequantised = footprint_from_stacked_experts(sizes, 4, experts, packed, resident_expert_bytes=layout.record_bytes)
    assert resident.resident_routed_bytes == 2 * experts * packed < dequantised.resident_routed_bytes / 3.7
    gpu = 2 * GiB + 1000 + resident.resident_routed_bytes + 10 * GiB // 1000  # packed experts fit, bf16 do not
    plan = plan_memory(resident, 0, DeviceMemory(gpu, 64 * GiB))
    assert plan.experts == "gpu" and plan.cache_bytes == resident.resident_routed_bytes
    assert plan.gpu_bytes == 1000 + resident.resident_routed_bytes
    assert plan_memory(dequantised, 0, DeviceMemory(gpu, 64 * GiB)).experts == "offload"
