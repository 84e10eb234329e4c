"""Runahead scheduler benchmark (issue R1): aggregate decode tok/s and inter-token latency of
concurrent requests on a synthetic DeepSeek-V3.2-shaped model with offloaded FP8 experts.

Model: hidden 7168, MLA 128 heads (q_lora 1536, kv_lora 512 + 64 rope), indexer 64 x 128 (top-k
2048), 1 dense + N MoE layers of 256 FP8 experts (2048 wide, top-8) + 1 shared expert, random weights
(vocab cut to 512: the head is not what is measured). Experts live in pinned host memory behind a
GPU cache of --cache-fraction of each layer's experts. For each concurrency and scheduler
(sync = layer-synchronous with on-demand fetch and overlap; prefetch = sync + next-layer router
prediction; runahead) it runs the same greedy requests and prints tok/s, p50/p99 inter-token latency,
hit rate, bytes fetched and the link floor (bytes / 55 GB/s). Greedy outputs of the three schedulers
are compared first (same tokens required).

    python bench/bench_runahead.py [--moe-layers 3] [--concurrency 1 8 32] [--tokens 8] [--small]

--small uses tiny widths so the script can be smoke-tested on a CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from hearth.engine.api import EngineConfig, SamplingParams, TokenDelta
from hearth.engine.config import ModelConfig
from hearth.engine.engine import Engine
from hearth.engine.kv_cache import PagedCache
from hearth.engine.loader import _materialize_buffers
from hearth.engine.models.deepseek import DeepseekForCausalLM
from hearth.engine.offload_setup import Placement, attach_offload
from hearth.engine.runner import ModelRunner
from hearth.engine.tiny_tokenizer import write_tiny_tokenizer
from hearth.engine.tokenizer import Tokenizer
from hearth.offload.expert_store import ExpertLayout, ExpertStore

LINK_GBPS = 55.0
VOCAB = 512


def model_config(moe_layers: int, small: bool) -> ModelConfig:
    real = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
                q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, index_n_heads=64,
                index_head_dim=128, index_topk=2048)
    tiny = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
                q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2, index_n_heads=4,
                index_head_dim=32, index_topk=64)
    raw = dict(model_type="deepseek_v32", vocab_size=VOCAB, num_hidden_layers=1 + moe_layers, n_shared_experts=1,
               first_k_dense_replace=1, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True,
               routed_scaling_factor=2.5, rope_theta=10000.0, max_position_embeddings=4096,
               rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
               eos_token_id=1, bos_token_id=0, **(tiny if small else real))
    return ModelConfig.from_dict(raw)


def build_store(config: ModelConfig, device: torch.device) -> ExpertStore:
    """Random FP8 experts (power-of-two block scales), generated on the device, copied to the store."""
    layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    layout = ExpertLayout(config.hidden_size, config.moe_intermediate_size, torch.float8_e4m3fn)
    store = ExpertStore(layout, layers, config.n_routed_experts)
    gen = torch.Generator(device=device).manual_seed(0)
    for layer in layers:
        w = store.weights(layer)
        for e0 in range(0, config.n_routed_experts, 16):
            for dst in (w.w13, w.w2):
                n = min(16, config.n_routed_experts - e0)
                src = torch.randn((n, *dst.shape[1:]), device=device, generator=gen) * 8
                dst[e0:e0 + n].copy_(src.to(dst.dtype))
            for dst in (w.s13, w.s2):
                dst[e0:e0 + 16].fill_(2.0**-8 / config.hidden_size**0.5 * 16)
    return store


def build_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> DeepseekForCausalLM:
    """Random dense weights on the device; routed experts stay on the meta device (served by the cache)."""
    with torch.device("meta"):
        model = DeepseekForCausalLM(config)
    gen = torch.Generator(device=device).manual_seed(1)
    for name, param in list(model.named_parameters()):
        if ".mlp.experts." in name:
            continue
        module_name, _, attr = name.rpartition(".")
        if "norm" in name:
            value = torch.ones(param.shape, device=device)
        elif name.endswith("bias"):
            value = torch.zeros(param.shape, device=device)
        else:
            value = torch.randn(param.shape, device=device, generator=gen) * param.shape[-1] ** -0.5
        keep_fp32 = name.endswith("mlp.gate.weight") or "e_score_correction_bias" in name \
            or "weights_proj" in name or "k_norm" in name
        value = value.to(torch.float32 if keep_fp32 else dtype)
        setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(value, requires_grad=False))
    _materialize_buffers(model, device)
    return model.eval()


class SyntheticRunner(ModelRunner):
    """A ModelRunner over an in-memory synthetic model (nothing read from disk)."""

    def __init__(self, config: ModelConfig, engine_config: EngineConfig, store: ExpertStore, slots: int) -> None:
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model_config = config
        self.max_model_len = 1024
        self.block_size = engine_config.block_size
        self.num_blocks = engine_config.num_cache_blocks or 64 * 32
        self.model = build_model(config, self.device, self.dtype)
        self.cache = PagedCache(config, self.num_blocks, self.block_size, self.dtype, self.device)
        self.placement = Placement(True, slots, f"synthetic, {slots} slots/layer")
        self.expert_cache, self.residency = attach_offload(
            self.model, None, self.placement, self.device, self.dtype, engine_config.expert_cache_policy,
            prefetch=engine_config.scheduler == "prefetch", store=store)


def run_case(engine: Engine, concurrency: int, tokens: int, prompt_len: int) -> dict:
    prompts = [[(31 * r + 7 * j) % (VOCAB - 10) + 5 for j in range(prompt_len)] for r in range(concurrency)]
    sampling = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=p, sampling=sampling) for p in prompts]
    stamps = {i: [] for i in ids}
    out = {i: [] for i in ids}
    engine.runner.expert_cache.reset_stats()
    start = time.perf_counter()
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, TokenDelta):
                stamps[event.request_id].append(time.perf_counter())
                out[event.request_id].extend(event.token_ids)
    gaps = [b - a for s in stamps.values() for a, b in zip(s, s[1:])]
    first = min(s[0] for s in stamps.values())
    decode_tokens = sum(len(s) - 1 for s in stamps.values())
    stats = engine.runner.expert_cache.stats()["total"]
    elapsed = time.perf_counter() - start
    return {
        "tokens": [out[i] for i in ids],
        "tok_s": decode_tokens / max(time.perf_counter() - first, 1e-9),
        "itl_p50_ms": 1e3 * statistics.median(gaps) if gaps else 0.0,
        "itl_p99_ms": 1e3 * sorted(gaps)[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0,
        "hit_rate": stats.get("hit_rate", 0.0),
        "gb_fetched": stats.get("bytes_fetched", 0) / 1e9,
        "link_floor_s": stats.get("bytes_fetched", 0) / (LINK_GBPS * 1e9),
        "elapsed_s": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--moe-layers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--cache-fraction", type=float, default=0.25)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    config = model_config(args.moe_layers, args.small)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    store = build_store(config, device)
    print(f"store: {store.total_bytes / 1e9:.1f} GB, pinned {store.pinned_bytes / 1e9:.1f} GB, "
          f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    slots = max(config.num_experts_per_tok, int(args.cache_fraction * config.n_routed_experts))
    tok_dir = tempfile.mkdtemp()
    write_tiny_tokenizer(tok_dir, "deepseek_v32", VOCAB)
    tokenizer = Tokenizer.from_pretrained(tok_dir, "deepseek_v32")
    results = []
    for concurrency in args.concurrency:
        row = {}
        for scheduler in ("sync", "prefetch", "runahead"):
            config_e = EngineConfig(block_size=64, max_num_seqs=max(args.concurrency), scheduler=scheduler,
                                    max_num_batched_tokens=4096)
            runner = SyntheticRunner(config, config_e, store, slots)
            engine = Engine(runner, tokenizer, config_e)
            run_case(engine, min(concurrency, 2), 2, args.prompt_len)  # warm-up (kernels, allocator)
            row[scheduler] = run_case(engine, concurrency, args.tokens, args.prompt_len)
            del engine, runner
            if device.type == "cuda":
                torch.cuda.empty_cache()
        same = row["sync"]["tokens"] == row["runahead"]["tokens"] == row["prefetch"]["tokens"]
        for scheduler, r in row.items():
            print(f"c={concurrency:3d} {scheduler:9s} {r['tok_s']:8.1f} tok/s  ITL p50 {r['itl_p50_ms']:7.1f} ms "
                  f"p99 {r['itl_p99_ms']:7.1f} ms  hit {r['hit_rate']:.2f}  fetched {r['gb_fetched']:6.1f} GB "
                  f"(link floor {r['link_floor_s']:.2f} s of {r['elapsed_s']:.2f} s)", flush=True)
        print(f"c={concurrency:3d} runahead/sync {row['runahead']['tok_s'] / row['sync']['tok_s']:.2f}x, "
              f"runahead/prefetch {row['runahead']['tok_s'] / row['prefetch']['tok_s']:.2f}x, "
              f"same greedy tokens: {same}", flush=True)
        results.append({"concurrency": concurrency, **{k: {m: v for m, v in r.items() if m != "tokens"}
                                                        for k, r in row.items()}, "same_tokens": same})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
