"""Whole decode step, all weights on the GPU: ms per step against the
weight-bytes roofline, eager vs CUDA graphs.

Model: DeepSeek-V3.2 shapes (hidden 7168, MLA 128 heads with q_lora 1536 / kv_lora 512 + 64 rope,
indexer 64 x 128 with top-k 2048, vocabulary 129,280), 1 dense layer (18432 wide) + 2 MoE layers of
256 routed experts (2048 wide, top-8, FP8 e4m3 with 128x128 block scales as the checkpoint ships
them) + 1 shared expert, everything else bf16, random weights built on the GPU (no checkpoint).
Each request first prefills --context tokens; then --steps decode steps are timed end to end on the
host (runner.run + greedy argmax read back, as the engine does), median per step.

Roofline: bytes a decode step must read at least once / 4.28 TB/s — every bf16 weight except the
embedding table (one row per token), the shared expert, the router, the distinct routed experts the
batch's tokens chose (measured from the router each step; 8 per MoE layer at batch 1), the indexer
keys of the context (132 B per token per layer) and the 2048 selected latents per request and
layer (1152 B each).

    python bench/bench_decode_step.py [--context 4096] [--batch 1 8] [--steps 30] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hearth.engine.api import EngineConfig
from hearth.engine.config import ModelConfig
from hearth.engine.loader import materialize_buffers
from hearth.engine.models.deepseek import DeepseekForCausalLM
from hearth.engine.models.layers import Fp8Linear
from hearth.engine.models.mla import AttentionPaths
from hearth.engine.runner import ModelRunner, StepInput

HBM = 4.28e12
LATENT_ROW = 1152  # 576 bf16
INDEX_ROW = 132


def model_config(max_len: int) -> ModelConfig:
    return ModelConfig.from_dict(dict(
        model_type="deepseek_v32", vocab_size=129280, num_hidden_layers=3, first_k_dense_replace=1,
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
        index_n_heads=64, index_head_dim=128, index_topk=2048, scoring_func="sigmoid", topk_method="noaux_tc",
        norm_topk_prob=True, routed_scaling_factor=2.5, rope_theta=10000.0, max_position_embeddings=max_len,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        eos_token_id=1, bos_token_id=0))


def build_model(config: ModelConfig, device: torch.device, attention: AttentionPaths) -> DeepseekForCausalLM:
    """Random weights on the device: routed experts as FP8 block-scaled Fp8Linear, the rest bf16
    (router, indexer head weights and k-norm in fp32 as the checkpoints keep them)."""
    with torch.device("meta"):
        model = DeepseekForCausalLM(config, attention=attention)
    gen = torch.Generator(device=device).manual_seed(0)
    for name, param in list(model.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if ".mlp.experts." in name:
            rows, cols = param.shape
            w8 = (torch.randn(param.shape, device=device, generator=gen) * 8).to(torch.float8_e4m3fn)
            scale = torch.full((-(-rows // 128), -(-cols // 128)), 2.0**-3 / cols**0.5, device=device)
            parent_name, _, child = module_name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, Fp8Linear(w8, scale, (128, 128), torch.bfloat16))
            continue
        if "norm" in name:
            value = torch.ones(param.shape, device=device)
        elif name.endswith("bias"):
            value = torch.zeros(param.shape, device=device)
        else:
            value = torch.randn(param.shape, device=device, generator=gen) * param.shape[-1] ** -0.5
        fp32 = name.endswith("mlp.gate.weight") or "e_score_correction_bias" in name or "weights_proj" in name \
            or "k_norm" in name
        setattr(module, attr, torch.nn.Parameter(value.to(torch.float32 if fp32 else torch.bfloat16),
                                                 requires_grad=False))
    materialize_buffers(model, device)
    return model.eval()


def fixed_bytes(model: DeepseekForCausalLM) -> int:
    """Weights every step reads in full: all but the embedding table and the routed experts."""
    total = 0
    for name, tensor in list(model.named_parameters()):
        if ".mlp.experts." in name or name.startswith("model.embed_tokens"):
            continue
        total += tensor.numel() * tensor.element_size()
    return total


def expert_bytes(model: DeepseekForCausalLM) -> int:
    moe = next(layer.mlp for layer in model.layers if layer.is_moe)
    return sum(t.numel() * t.element_size() for t in moe.experts[0].parameters())


class RoutingProbe:
    """Counts the distinct routed experts each MoE layer's router picks (from the routing tensors)."""

    def __init__(self, model: DeepseekForCausalLM) -> None:
        self.ids: list[torch.Tensor] = []
        self.enabled = False
        for layer in model.layers:
            if layer.is_moe:
                layer.mlp.gate.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        if self.enabled:  # keep the tensor; counting it here would synchronise inside the timed step
            self.ids.append(output[0])

    def mean_distinct(self) -> float | None:
        return statistics.mean(int(ids.unique().numel()) for ids in self.ids) if self.ids else None


def run_batch(runner: ModelRunner, batch: int, context: int, steps: int, graphs: bool, probe: RoutingProbe) -> dict:
    cfg = runner.model_config
    width = -(-runner.max_model_len // runner.block_size)
    tables = [list(range(r * width, (r + 1) * width)) for r in range(batch)]
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, cfg.vocab_size, (context,), generator=gen).tolist() for _ in range(batch)]
    chunk = 2048
    last = []
    for table, ids in zip(tables, prompts):
        for start in range(0, context, chunk):
            logits = runner.run([StepInput(table, start, ids[start:start + chunk])])
        last.append(int(logits[-1].argmax()))
    try:
        times = []
        tokens = list(last)
        probe.ids.clear()
        for step in range(steps + 3):
            probe.enabled = step >= 3 and not graphs  # (hooks do not fire on graph replays)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = runner.run([StepInput(t, context + step, [tok]) for t, tok in zip(tables, tokens)],
                                use_graphs=graphs)
            tokens = logits.argmax(-1).tolist()
            t1 = time.perf_counter()
            if step >= 3:  # the first steps capture graphs / compile
                times.append(t1 - t0)
    finally:
        probe.enabled = False
    return {"median_s": statistics.median(times), "p10_s": sorted(times)[len(times) // 10],
            "distinct_per_layer": probe.mean_distinct(), "tokens": tokens}


def check_graph_equals_eager(runner: ModelRunner, context: int) -> float:
    """Same decode step eagerly and from a graph (same inputs, same cache writes): max |diff|."""
    width = -(-runner.max_model_len // runner.block_size)
    table = list(range(width))
    ids = torch.randint(3, 1000, (context,), generator=torch.Generator().manual_seed(5)).tolist()
    for start in range(0, context, 2048):
        runner.run([StepInput(table, start, ids[start:start + 2048])])
    eager = runner.run([StepInput(table, context, [7])], use_graphs=False).clone()
    graph = runner.run([StepInput(table, context, [7])]).clone()
    return float((eager - graph).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    max_len = 1 << (args.context + args.steps + 64).bit_length()
    config = model_config(max_len)
    t0 = time.time()
    engine_config = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=max_len,
                                 max_num_seqs=max(args.batch), block_size=64)
    model = build_model(config, device, ModelRunner.features_for(config, engine_config, device).attention)
    runner = ModelRunner.from_model(model, engine_config)
    print(f"built in {time.time() - t0:.1f} s; kernels {runner.use_kernels}; graphs {runner.graphs is not None}; "
          f"fused expert layers {sum(layer.mlp.backend is not None for layer in model.layers if layer.is_moe)}",
          flush=True)
    diff = check_graph_equals_eager(runner, 300)
    print(f"graph vs eager logits, same step: max |diff| {diff:.3g}", flush=True)
    probe = RoutingProbe(model)
    fixed, per_expert = fixed_bytes(model), expert_bytes(model)
    moe_layers = sum(layer.is_moe for layer in model.layers)
    rows = []
    print("| batch | context | path | ms / step | tok/s | roofline ms | % of roofline |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch:
        eager = run_batch(runner, batch, args.context, args.steps, graphs=False, probe=probe)
        graph = run_batch(runner, batch, args.context, args.steps, graphs=True, probe=probe)
        distinct = eager["distinct_per_layer"] or 8
        kv = config.num_hidden_layers * batch * (args.context * INDEX_ROW + min(args.context, 2048) * LATENT_ROW)
        floor_bytes = fixed + moe_layers * distinct * per_expert + kv
        floor = floor_bytes / HBM
        for path, res in (("eager", eager), ("CUDA graph", graph)):
            ms = res["median_s"] * 1e3
            row = {"batch": batch, "context": args.context, "path": path, "ms": ms, "tok_s": batch / res["median_s"],
                   "roofline_ms": floor * 1e3, "pct": 100 * floor / res["median_s"], "floor_bytes": floor_bytes,
                   "distinct_experts_per_layer": distinct}
            rows.append(row)
            print(f"| {batch} | {args.context} | {path} | {ms:.2f} | {row['tok_s']:.1f} | {floor * 1e3:.2f} | "
                  f"{row['pct']:.0f}% |", flush=True)
        same = eager["tokens"] == graph["tokens"]
        print(f"  batch {batch}: {distinct:.1f} distinct experts per MoE layer per step; "
              f"{floor_bytes / 1e9:.2f} GB per step at least; eager and graph runs end on the same tokens: {same}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "graph_vs_eager_max_diff": diff, "fixed_bytes": fixed,
                       "expert_bytes": per_expert}, f, indent=1)


if __name__ == "__main__":
    main()
