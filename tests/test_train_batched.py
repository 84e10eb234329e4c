"""train.batched against the engine's ForwardContext path (fp32, CPU).

A small random DeepSeek-V3.2 config with DSA active (index_topk < T), n_group > 1 routing and
non-zero ``e_score_correction_bias``: the batched forward must give the same logits and the same
gradients as ``model(ids, ctx, all_logits=True)`` over a fresh paged cache, the same indexer KL as
the per-sequence definition, and it must train.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hearth.engine.config import ModelConfig
from hearth.engine.kv_cache import PagedCache, build_context
from hearth.engine.models.deepseek import DeepseekForCausalLM
from hearth.engine.models.layers import apply_rotary
from hearth.engine.testing.tiny import tiny_config
from train.batched import batched_forward
from train.indexer_loss import ExpertLoad, lm_loss

B, T, TOPK, VOCAB = 3, 48, 12, 96


def _model(pattern: str | None = None, seed: int = 0) -> DeepseekForCausalLM:
    raw = tiny_config("deepseek_v32")
    raw.update(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=64,
               moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
               n_group=4, topk_group=2, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=24,
               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, index_n_heads=2,
               index_head_dim=16, index_topk=TOPK, num_nextn_predict_layers=0, max_position_embeddings=4 * T)
    if pattern:
        raw["index_topk_pattern"] = pattern
    model = DeepseekForCausalLM(ModelConfig.from_dict(raw))
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.endswith("e_score_correction_bias"))
        if "norm" in name:
            p.data.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if name.endswith("weight") else
                         0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith("e_score_correction_bias"):
            p.data.copy_(0.2 * torch.randn(p.shape, generator=gen))
        else:  # large enough for peaked attention and distinct indexer scores
            p.data.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return model


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(6, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _reference_logits(model: DeepseekForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    cache = PagedCache(model.config, B * 3, 16, torch.float32, torch.device("cpu"))
    ctx = build_context(cache, [(list(range(3 * b, 3 * b + 3)), 0, T) for b in range(B)], torch.device("cpu"))
    return model(ids.flatten(), ctx, all_logits=True).view(B, T, -1)


def _set_topk(model: DeepseekForCausalLM, topk: int) -> None:
    for layer in model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.topk = topk


@pytest.mark.parametrize(("pattern", "experts"), [(None, "stacked"), (None, "module"), ("FSF", "stacked")])
def test_batched_logits_and_gradients_match_the_forward_context_path(pattern: str | None, experts: str) -> None:
    model = _model(pattern)
    ids = _ids()
    assert model.config.index_topk < T and model.layers[1].is_moe and not model.layers[0].is_moe
    ref = _reference_logits(model, ids)
    out = batched_forward(model, ids, experts=experts)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (B, T, VOCAB)
    torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=1e-4)
    _set_topk(model, T)  # DSA must matter at this size, else the comparison proves little
    assert (batched_forward(model, ids).logits - ref).abs().max() > 1e-2
    _set_topk(model, TOPK)

    targets = torch.roll(ids, -1, 1).flatten()
    lm_loss(ref.flatten(0, 1), targets).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    lm_loss(batched_forward(model, ids, experts=experts).logits.flatten(0, 1), targets).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    # experts no token chose: no gradient in the per-expert path, a zero one in the batched path
    assert grads.keys() >= ref_grads.keys()
    assert all(g.abs().max() == 0 for n, g in grads.items() if n not in ref_grads)
    ref_grads = {n: ref_grads.get(n, torch.zeros_like(g)) for n, g in grads.items()}
    assert not any(".indexer." in n for n in grads)  # top-k selection has no gradient
    assert "model.layers.1.mlp.gate.weight" in grads  # the router learns via the chosen weights
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_dense_warm_up_is_causal_attention() -> None:
    model = _model()
    ids = _ids()
    _set_topk(model, T)
    torch.testing.assert_close(batched_forward(model, ids).logits, _reference_logits(model, ids),
                               atol=1e-4, rtol=1e-4)


def _reference_kl(model: DeepseekForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """KL(main attention summed over heads || indexer) per sequence and indexer layer, one at a time."""
    inputs = {}
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, a: inputs.__setitem__(m.layer, a[0]))
             for layer in model.layers if layer.self_attn.indexer is not None]
    _reference_logits(model, ids)
    for h in hooks:
        h.remove()
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    losses = []
    for layer, x in sorted(inputs.items()):
        attn = model.layers[layer].self_attn
        idx = attn.indexer
        cos, sin = attn.rotary.cos_sin(torch.arange(T))
        for b in range(B):
            xs = x[b * T:(b + 1) * T].detach()
            with torch.no_grad():
                q_resid = attn.q_a_layernorm(attn.q_a_proj(xs))
                q = attn.q_b_proj(q_resid).view(T, attn.n_heads, -1)
                q_nope, q_pe = q.split([attn.nope, attn.rope_dim], -1)
                q_pe = apply_rotary(q_pe, cos, sin, attn.rope_interleave)
                kv, k_pe = attn.kv_a_proj_with_mqa(xs).split([attn.kv_lora, attn.rope_dim], -1)
                k_pe = apply_rotary(k_pe, cos, sin, attn.rope_interleave)
                w = attn.kv_b_proj.weight.view(attn.n_heads, attn.nope + attn.v_dim, attn.kv_lora)
                k_nope = torch.einsum("tc,hdc->thd", attn.kv_a_layernorm(kv), w[:, :attn.nope])
                scores = torch.einsum("qhd,thd->hqt", q_nope, k_nope) + torch.einsum("qhr,tr->hqt", q_pe, k_pe)
                p = (scores * attn.scale).masked_fill(~causal, float("-inf")).softmax(-1).sum(0)
                p = p / p.sum(-1, keepdim=True)
            qi = idx._rope(idx.wq_b(q_resid).view(T, idx.n_heads, idx.head_dim), cos, sin)
            ki = idx._rope(idx.k_norm(idx.wk(xs)), cos, sin)
            wi = idx.weights_proj(xs) * idx.scale
            s = (torch.einsum("qhd,td->qht", qi, ki).relu() * wi[:, :, None]).sum(1)
            log_q = s.masked_fill(~causal, float("-inf")).log_softmax(-1).masked_fill(~causal, 0.0)
            losses.append((p * (p.clamp_min(1e-12).log() - log_q)).sum(-1).mean())
    return torch.stack(losses).mean()


def test_batched_indexer_kl_matches_the_per_sequence_definition_and_trains_only_the_indexer() -> None:
    model = _model()
    ids = _ids()
    ref = _reference_kl(model, ids)
    out = batched_forward(model, ids, kl_seqs=B, experts="stacked")
    torch.testing.assert_close(out.indexer_kl, ref, atol=1e-5, rtol=1e-5)
    assert out.indexer_kl > 0
    model.zero_grad(set_to_none=True)
    out.indexer_kl.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    indexer = model.layers[0].self_attn.indexer
    assert grads and all(".indexer." in n for n in grads)  # the indexer's inputs are detached
    assert indexer.wk.weight.grad.abs().sum() > 0 and indexer.weights_proj.weight.grad.abs().sum() > 0
    assert indexer.wq_b.weight.grad.abs().sum() > 0


@pytest.mark.slow
@pytest.mark.parametrize("experts", ["stacked", "module"])
def test_batched_training_steps_lower_the_loss_and_balance_experts(experts: str) -> None:
    model = _model(seed=3)
    model.train()
    ids = _ids(seed=4)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3)
    load = ExpertLoad(model)
    losses = []
    bias_before = model.layers[1].mlp.gate.e_score_correction_bias.clone()
    for _ in range(8):
        out = batched_forward(model, ids[:, :-1], kl_seqs=1, dropout=0.1, experts=experts)
        loss = lm_loss(out.logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        (loss + out.indexer_kl).backward()
        expert_grads = [e.down_proj.weight.grad for e in model.layers[1].mlp.experts]
        assert sum(g is not None and bool(g.abs().sum() > 0) for g in expert_grads) >= 2  # >= K experts learn
        assert model.layers[0].self_attn.indexer.wk.weight.grad.abs().sum() > 0
        opt.step()
        load.add(out.expert_counts)
        assert sum(float(c.sum()) for c in out.expert_counts.values()) == 2 * 2 * B * (T - 1)  # 2 MoE layers
        load.update(1e-2)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3
    assert not torch.equal(model.layers[1].mlp.gate.e_score_correction_bias, bias_before)
    assert load.worst_ratio is not None and float(load.worst_ratio) >= 1.0


def test_batched_forward_under_bf16_autocast() -> None:
    """The GPU run's precision (bf16 autocast; here on the CPU): runs, backpropagates, stays close."""
    model = _model()
    ids = _ids()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = batched_forward(model, ids, kl_seqs=1, experts="stacked")
        loss = lm_loss(out.logits.flatten(0, 1), torch.roll(ids, -1, 1).flatten())
    (loss + out.indexer_kl).backward()
    assert torch.isfinite(loss) and torch.isfinite(out.indexer_kl)
    # bf16 flips DSA key choices of this random model (the engine's path alike), so compare dense
    _set_topk(model, T)
    ref = batched_forward(model, ids, experts="stacked").logits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dense = batched_forward(model, ids, experts="stacked").logits
    assert F.cosine_similarity(dense.float().flatten(), ref.flatten(), dim=0) > 0.99
    assert model.layers[1].mlp.experts[0].gate_proj.weight.grad is not None
