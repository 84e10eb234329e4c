"""Expert offload benchmark on DeepSeek-V3.2-shaped MoE layers with FP8 experts in pinned
host memory (hidden 7168, 256 experts of 2048, top-8), uniform random routing. Parts (``--parts``):

- ``decode``: ms per MoE layer call at batch 1 and 8: (a) all experts resident on the GPU, (b) naive
  on-demand fetch (no cache, copy then compute), (c) Hearth's cache at 25% / 50% of the experts (LRU
  without overlap, LRU and LFU with per-expert overlap), each against (d) its link floor = bytes it
  fetched / 55 GB/s, with hit rate and copy-stream busy share. Warm-up and timed steps use different
  routings. Also the measured link and host-expert speeds and what ``host_experts='auto'`` decides.
- ``prefill``: tok/s per MoE layer for 4K and 16K-token prompts: all experts on the GPU, streamed
  through a 25% cache, and the streaming floor max(layer expert bytes / 55 GB/s, resident compute).
  ``--prefill-variants halves ring`` times each streaming plan of :class:`OffloadedExperts` in one
  run, each with its error against the resident output and the host's issue time (the call's return:
  well below the streamed time means the host was not what paced the copies; near it, it may have,
  or the host waited on a full launch queue).
- ``model``: Hearth's decode ms/token on a DeepSeek-V3-shaped model of 1 dense + 2 MoE layers (MLA
  128 heads, bf16 dense weights, FP8 experts offloaded behind a 25% cache) at ``--context`` tokens.
- ``hf``: the same shapes in Hugging Face transformers (DeepseekV3ForCausalLM, bf16, random weights)
  with each MoE layer's experts offloaded by ``accelerate.cpu_offload``, decode ms/token over
  ``--hf-tokens`` tokens at the same context; with ``--hearth-json`` the ``model`` part's result is
  read to print the ratio. transformers and accelerate are imported only here.

Correctness is checked first (fused kernel vs reference; offloaded vs resident, bit for bit).
``--small`` runs tiny shapes (on the CPU when there is no GPU) to smoke-test the script.

    python bench/bench_offload.py [--parts decode,prefill] [--layers 4] [--steps 12] [--json F] [--small]
        [--prefill-variants halves ring]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hearth.kernels.moe import fused_moe, moe_reference
from hearth.offload.cpu_experts import choose_host_experts, measure_host_speeds
from hearth.offload.expert_cache import ExpertCache
from hearth.offload.expert_store import ExpertLayout, ExpertStore
from hearth.offload.experts import OffloadedExperts, ResidentExperts
from hearth.offload.fetch_plan import RING, RING_DEPTH, STREAMING

LINK_GBPS = 55.0  # pinned host -> GPU, measured (docs/benchmarks.md, Ceilings)


@dataclass(frozen=True)
class Shapes:
    hidden: int
    inter: int
    num_experts: int
    top_k: int


REAL = Shapes(7168, 2048, 256, 8)
SMALL = Shapes(256, 128, 32, 4)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn, device: torch.device) -> float:
    """Wall ms of ``fn()`` between two device syncs (each call here is milliseconds or more)."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3


def build_store(shapes: Shapes, layers: list[int], device: torch.device) -> ExpertStore:
    """Random FP8 experts with power-of-two block scales, generated on ``device``, copied to the store."""
    layout = ExpertLayout(shapes.hidden, shapes.inter, torch.float8_e4m3fn)
    store = ExpertStore(layout, layers, shapes.num_experts)
    g = torch.Generator(device=device).manual_seed(0)
    chunk = 16
    for layer in store.layers:
        w = store.weights(layer)
        for e0 in range(0, shapes.num_experts, chunk):
            n = min(chunk, shapes.num_experts - e0)
            for dst in (w.w13, w.w2):
                src = torch.randn((n, *dst.shape[1:]), device=device, generator=g) * 8  # (c, N, K)
                dst[e0:e0 + n].copy_(src.to(dst.dtype))
            for dst in (w.s13, w.s2):
                exp = torch.randint(-10, -7, (n, *dst.shape[1:]), device=device, generator=g)
                dst[e0:e0 + n].copy_(torch.exp2(exp.float()))
    sync(device)
    return store


def routing(shapes: Shapes, steps: int, layers: int, tokens: int, seed: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [steps, L, T, K] uniform distinct experts per token, weights [steps, L, T, K] fp32."""
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand((steps, layers, tokens, shapes.num_experts), device=device, generator=g)
    ids = scores.topk(shapes.top_k, dim=-1).indices
    w = torch.rand(ids.shape, device=device, generator=g)
    return ids, w / w.sum(-1, keepdim=True) * 2.5


class NaiveFetch:
    """Baseline (b): no cache, no overlap: copy the needed experts to staging slots, then compute."""

    def __init__(self, store: ExpertStore, max_experts: int, device: torch.device, use_kernel: bool):
        self.store = store
        self.buffer = torch.empty((max_experts, store.layout.record_bytes), dtype=torch.uint8, device=device)
        self.weights = store.layout.views(self.buffer)
        self.use_kernel = use_kernel
        self.bytes_fetched = 0

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        needed = list(dict.fromkeys(ids.flatten().tolist()))
        lut = torch.full((self.store.num_experts,), -1, dtype=torch.int32)
        for slot, expert in enumerate(needed):
            self.buffer[slot].copy_(self.store.expert(layer, expert), non_blocking=True)
            lut[expert] = slot
        self.bytes_fetched += len(needed) * self.buffer.shape[1]
        ww = self.weights
        moe = fused_moe if self.use_kernel else moe_reference
        return moe(x, lut.to(x.device)[ids], w, ww.w13, ww.w2, ww.s13, ww.s2).to(x.dtype)


def time_backend(backend, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> float:
    """Mean ms per MoE layer call over steps x layers (a decode-like sequence: each call's host-side
    routing waits for the previous call)."""
    steps, layers = ids.shape[:2]

    def sweep() -> None:
        for s in range(steps):
            for l in range(layers):
                backend(l, x, ids[s, l], w[s, l])

    return timed_ms(sweep, x.device) / (steps * layers)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def check_correctness(store: ExpertStore, resident: ResidentExperts, shapes: Shapes, device: torch.device) -> dict:
    x = torch.randn(8, shapes.hidden, device=device).bfloat16()
    ids, w = routing(shapes, 1, 1, 8, seed=99, device=device)
    ww = resident._weights[0]
    out = {}
    if resident.use_kernel:
        for t in (1, 8):
            got = fused_moe(x[:t], ids[0, 0, :t], w[0, 0, :t], ww.w13, ww.w2, ww.s13, ww.s2)
            want = moe_reference(x[:t], ids[0, 0, :t], w[0, 0, :t], ww.w13, ww.w2, ww.s13, ww.s2)
            out[f"kernel_rel_err_T{t}"] = err = rel_err(got, want)
            print(f"check fused_moe vs reference T={t}: rel err {err:.2e}")
            assert err < 2e-2 and not got.isnan().any()
    cache = ExpertCache(store, device, slots_per_layer=max(shapes.top_k * 8, shapes.num_experts // 4))
    off = OffloadedExperts(cache, host_experts="off")
    for t in (1, 8):
        for attempt in ("cold", "warm"):
            got, want = off(0, x[:t], ids[0, 0, :t], w[0, 0, :t]), resident(0, x[:t], ids[0, 0, :t], w[0, 0, :t])
            same = torch.equal(got, want)
            err = rel_err(got, want)
            out[f"offloaded_bitwise_T{t}_{attempt}"] = same
            print(f"check OffloadedExperts vs ResidentExperts T={t} ({attempt} cache): bitwise equal {same}, "
                  f"rel err {err:.2e}, max abs diff {(got.float() - want.float()).abs().max().item():.2e}")
            assert err < 1e-2
    return out


def link_bandwidth(store: ExpertStore, device: torch.device) -> float:
    """GB/s of up to 32 one-expert pinned copies host -> GPU, back to back."""
    n = min(32, store.num_experts)
    dst = torch.empty((n, store.layout.record_bytes), dtype=torch.uint8, device=device)
    dst[0].copy_(store.expert(0, 0))  # warm-up

    def copies() -> None:
        for i in range(n):
            dst[i].copy_(store.expert(0, i), non_blocking=True)

    return dst.numel() / timed_ms(copies, device) / 1e6


def run_cache(store, x, ids, w, slots: int, policy: str, overlap: bool, speeds) -> dict:
    cache = ExpertCache(store, x.device, slots_per_layer=slots, policy=policy)
    backend = OffloadedExperts(cache, overlap=overlap, host_experts="auto" if speeds else "off", host_speeds=speeds)
    half = ids.shape[0] // 2
    # NOTE: warm on the first half of the steps, time the second: timed routings were never seen.
    time_backend(backend, x, ids[:half], w[:half])
    cache.reset_stats()
    ids, w = ids[half:], w[half:]
    ms = time_backend(backend, x, ids, w)
    st = cache.stats()["total"]
    calls = ids.shape[0] * ids.shape[1]
    result = {"ms": ms, "hit_rate": st["hit_rate"], "bytes_per_call": st["bytes_fetched"] / calls,
              "copy_busy": st["copy_ms"] / (ms * calls),
              "copy_gbps": st["bytes_fetched"] / st["copy_ms"] / 1e6 if st["copy_ms"] else 0.0,
              "host_experts_per_call": st["cpu_computed"] / calls}
    result["floor_ms"] = result["bytes_per_call"] / (LINK_GBPS * 1e6)
    result["x_floor"] = ms / result["floor_ms"] if result["floor_ms"] else float("nan")
    del backend, cache
    if x.is_cuda:
        torch.cuda.empty_cache()
    return result


def part_decode(store: ExpertStore, resident: ResidentExperts, shapes: Shapes, layers: int, steps: int,
                device: torch.device) -> dict:
    speeds = measure_host_speeds(store, device) if device.type == "cuda" else None
    results: dict = {}
    if speeds is not None:
        results["host_speeds"] = speeds.__dict__
        print(f"host-expert probe: {speeds.describe()}")
        for tokens in (1, 8):
            missing = [1] * 6 if tokens == 1 else [1] * 45
            chosen = sum(choose_host_experts(missing, speeds))
            print(f"  auto decision for {len(missing)} misses of 1 token each (T={tokens}, 25% cache): "
                  f"{chosen} on the host, {len(missing) - chosen} fetched")
    for tokens in (1, 8):
        ids, w = routing(shapes, 2 * steps, layers, tokens, seed=tokens, device=device)
        x = torch.randn(tokens, shapes.hidden, device=device).bfloat16()
        timed = ids[steps:], w[steps:]
        time_backend(resident, x, ids[:2], w[:2])
        row = {"resident": {"ms": time_backend(resident, x, *timed)}}
        naive = NaiveFetch(store, min(shapes.num_experts, tokens * shapes.top_k), device, resident.use_kernel)
        time_backend(naive, x, ids[:2], w[:2])
        naive.bytes_fetched = 0
        ms = time_backend(naive, x, *timed)
        floor = naive.bytes_fetched / (steps * layers) / (LINK_GBPS * 1e6)
        row["naive"] = {"ms": ms, "floor_ms": floor, "x_floor": ms / floor}
        del naive
        for frac in (0.25, 0.5):
            for policy, overlap in (("lru", False), ("lru", True), ("lfu", True)):
                name = f"cache{int(frac * 100)}_{policy}{'' if overlap else '_no_overlap'}"
                row[name] = run_cache(store, x, ids, w, int(shapes.num_experts * frac), policy, overlap, speeds)
        results[f"batch{tokens}"] = row
        base = row["resident"]["ms"]
        for name, r in row.items():
            line = f"T={tokens} {name:22s} {r['ms']:8.3f} ms/layer  x{r['ms'] / base:5.1f} vs resident"
            if "floor_ms" in r:
                line += f"  link floor {r['floor_ms']:7.3f} ms (x{r['x_floor']:.2f})"
            if "hit_rate" in r:
                line += (f"  hit {r['hit_rate']:.3f}  copy busy {100 * r['copy_busy']:.0f}%  copies at "
                         f"{r['copy_gbps']:.1f} GB/s  host experts/call {r['host_experts_per_call']:.2f}")
            print(line, flush=True)
    return results


def prefill_variant(name: str) -> dict:
    """OffloadedExperts streaming arguments of a ``--prefill-variants`` name: ``halves`` (two halves
    of the pool, one launch per fetched expert), ``ring`` (the default) or ``ringN`` (N rounds, default
    RING_DEPTH, one launch each)."""
    for streaming in STREAMING:
        depth = name.removeprefix(streaming)
        if name.startswith(streaming) and (depth == "" or (streaming == RING and depth.isdigit() and int(depth) > 0)):
            return {"streaming": streaming, "ring_depth": int(depth) if depth else RING_DEPTH}
    raise ValueError(f"unknown prefill variant {name!r}: halves, ring or ringN (N rounds in the pool)")


def timed_layers_ms(backend, layers: list[int], x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                    device: torch.device) -> tuple[float, float, dict[int, torch.Tensor]]:
    """Each of ``layers`` called once between two device syncs: (mean wall ms, mean ms until the call
    returned = the host's issue time, the outputs by layer). ids / w: [L, T, K]."""
    wall = issue = 0.0
    outs = {}
    for layer in layers:
        sync(device)
        start = time.perf_counter()
        outs[layer] = backend(layer, x, ids[layer], w[layer])
        issued = time.perf_counter()
        sync(device)
        wall, issue = wall + time.perf_counter() - start, issue + issued - start
    return wall * 1e3 / len(layers), issue * 1e3 / len(layers), outs


def part_prefill(store: ExpertStore, resident: ResidentExperts, shapes: Shapes, layers: int,
                 prompt_lens: list[int], variants: list[str], device: torch.device) -> dict:
    """Per MoE layer: resident vs streamed through a 25% cache (fresh pools: every needed expert is
    copied) with each streaming variant, against the streaming floor; with the host's issue time
    (when it is near the streamed time, the host, not the link, paces the copies)."""
    results = {}
    slots = max(2, shapes.num_experts // 4)
    timed_layers = list(range(1, layers)) or [0]
    n = len(timed_layers)
    for tokens in prompt_lens:
        ids, w = routing(shapes, 1, layers, tokens, seed=1000 + tokens, device=device)
        x = torch.randn(tokens, shapes.hidden, device=device).bfloat16()
        resident(0, x, ids[0, 0], w[0, 0])
        res_ms, _, want = timed_layers_ms(resident, timed_layers, x, ids[0], w[0], device)
        needed = sum(len(set(ids[0, l].flatten().tolist())) for l in timed_layers) / n
        link_ms = needed * store.layout.record_bytes / (LINK_GBPS * 1e6)
        floor_ms = max(link_ms, res_ms)
        row = {"resident_ms": res_ms, "resident_tok_s": tokens / res_ms * 1e3, "link_floor_ms": link_ms,
               "floor_ms": floor_ms, "floor_tok_s": tokens / floor_ms * 1e3, "experts_needed": needed, "streamed": {}}
        print(f"prefill {tokens:6d} tokens/layer: resident {row['resident_tok_s']:9.0f} tok/s ({res_ms:.1f} ms)  "
              f"floor {row['floor_tok_s']:9.0f} tok/s (link {link_ms:.1f} ms for {needed:.0f} experts)", flush=True)
        for name in variants:
            cache = ExpertCache(store, device, slots_per_layer=slots)
            backend = OffloadedExperts(cache, host_experts="off", **prefill_variant(name))
            backend(0, x, ids[0, 0], w[0, 0])  # warm-up on layer 0; the timed layers' pools are still empty
            cache.reset_stats()
            str_ms, issue_ms, outs = timed_layers_ms(backend, timed_layers, x, ids[0], w[0], device)
            err = max(((outs[l].float() - want[l].float()).norm() / want[l].float().norm()).item() for l in outs)
            st = cache.stats()["total"]
            r = {"streamed_ms": str_ms, "streamed_tok_s": tokens / str_ms * 1e3, "issue_ms": issue_ms,
                 "share_of_floor": floor_ms / str_ms, "fetched_per_layer": st["misses"] / n,
                 "copy_busy": st["copy_ms"] / (str_ms * n),
                 "copy_gbps": st["bytes_fetched"] / st["copy_ms"] / 1e6 if st["copy_ms"] else 0.0,
                 "rel_err_vs_resident": err}
            row["streamed"][name] = r
            print(f"  {name:8s} streamed {r['streamed_tok_s']:9.0f} tok/s ({str_ms:.1f} ms, host issue "
                  f"{issue_ms:.1f} ms) = {100 * r['share_of_floor']:.0f}% of floor  copy busy "
                  f"{100 * r['copy_busy']:.0f}% at {r['copy_gbps']:.1f} GB/s  rel err vs resident {err:.1e}",
                  flush=True)
            del backend, cache, outs
            if device.type == "cuda":
                torch.cuda.empty_cache()
        results[f"prompt{tokens}"] = row
    return results


def deepseek_v3_dict(small: bool, vocab: int, max_positions: int) -> dict:
    """config.json of a DeepSeek-V3-shaped model with 1 dense + 2 MoE layers (HF and Hearth read it)."""
    real = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
                num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
                topk_group=4)
    tiny = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                v_head_dim=16, n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2)
    return dict(model_type="deepseek_v3", vocab_size=vocab, num_hidden_layers=3, first_k_dense_replace=1,
                n_shared_experts=1, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True,
                routed_scaling_factor=2.5, rope_theta=10000.0, max_position_embeddings=max_positions,
                rms_norm_eps=1e-6, hidden_act="silu", eos_token_id=1, bos_token_id=0, tie_word_embeddings=False,
                **(tiny if small else real))


_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")
_WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaMemcpy")


def launch_profile(step, steps: int, device: torch.device) -> dict:
    """Per call of ``step``: launches the host issued (kernels + CUDA-graph replays, from the
    profiler's runtime-API events), graph replays among them, and host time (the call's wall time
    less the time the host sat blocked in synchronising calls, e.g. reading the router's ids back)."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - t0
        sync(device)
    events = prof.events()
    launches = sum(e.name in _LAUNCHES for e in events)
    graphs = sum(e.name == "cudaGraphLaunch" for e in events)
    blocked_us = sum(e.cpu_time_total for e in events if e.name in _WAITS)
    return {"launches_per_step": launches / steps, "graph_replays_per_step": graphs / steps,
            "host_ms_per_step": (wall * 1e6 - blocked_us) / steps / 1e3}


def part_model(args, device: torch.device) -> dict:
    """Hearth: prefill ``--context`` tokens, then time greedy decode steps through the model runner."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_runahead import build_model, synthetic_runner  # noqa: PLC0415 - the runahead bench's runner

    from hearth.engine.api import EngineConfig  # noqa: PLC0415
    from hearth.engine.config import ModelConfig  # noqa: PLC0415
    from hearth.engine.runner import StepInput  # noqa: PLC0415

    raw = deepseek_v3_dict(args.small, args.vocab, max(4096, 2 * args.context))
    config = ModelConfig.from_dict(raw)
    shapes = Shapes(config.hidden_size, config.moe_intermediate_size, config.n_routed_experts,
                    config.num_experts_per_tok)
    t0 = time.perf_counter()
    store = build_store(shapes, [1, 2], device)  # the model's MoE layers
    slots = max(shapes.top_k, shapes.num_experts // 4)
    block = 64
    total = args.context + args.model_tokens + 4
    engine_config = EngineConfig(block_size=block, num_cache_blocks=-(-total // block) + 1)
    model = build_model(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    runner = synthetic_runner(config, engine_config, store, slots, model)
    print(f"hearth model: {config.num_hidden_layers} layers (1 dense + 2 MoE), store {store.total_bytes / 1e9:.1f} "
          f"GB FP8, cache {slots}/{shapes.num_experts} experts per layer, built in {time.perf_counter() - t0:.1f} s",
          flush=True)
    table = list(range(engine_config.num_cache_blocks))
    prompt = torch.randint(5, args.vocab, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = None

    def prefill() -> None:
        nonlocal logits
        logits = runner.run([StepInput(table, 0, prompt)])

    prefill_ms = timed_ms(prefill, device)
    tokens, step_ms = [int(logits[0].argmax())], []
    runner.expert_cache.reset_stats()
    for i in range(args.model_tokens + 1):  # the first step is a warm-up
        pos = args.context + i

        def step(pos: int = pos) -> None:
            nonlocal logits
            logits = runner.run([StepInput(table, pos, [tokens[-1]])])

        step_ms.append(timed_ms(step, device))
        tokens.append(int(logits[0].argmax()))
        if i == 0:
            runner.expert_cache.reset_stats()
    st = runner.expert_cache.stats()["total"]
    timed = step_ms[1:]
    ms = sum(timed) / len(timed)
    floor = st["bytes_fetched"] / len(timed) / (LINK_GBPS * 1e6)
    result = {"context": args.context, "decode_ms_per_token": ms, "prefill_ms": prefill_ms,
              "prefill_tok_s": args.context / prefill_ms * 1e3, "hit_rate": st["hit_rate"],
              "link_floor_ms_per_token": floor, "copy_busy": st["copy_ms"] / sum(timed),
              "steps_ms": step_ms, "experts_dtype": "float8_e4m3fn", "cache_fraction": slots / shapes.num_experts}
    pos = args.context + args.model_tokens + 1
    for name, graphs in (("pieces", True), ("whole-model eager", False)):
        probe = launch_profile(lambda graphs=graphs: runner.run([StepInput(table, pos, [tokens[-1]])],
                                                                use_graphs=graphs), 3, device)
        result[f"launches_{name}"] = probe
        if probe:
            print(f"hearth model, {name} decode step: {probe['launches_per_step']:.0f} launches "
                  f"({probe['graph_replays_per_step']:.0f} graph replays), host {probe['host_ms_per_step']:.2f} ms "
                  f"per step", flush=True)
    print(f"hearth model: prefill {args.context} tokens {prefill_ms:.0f} ms ({result['prefill_tok_s']:.0f} tok/s); "
          f"decode {ms:.2f} ms/token over {len(timed)} tokens (link floor {floor:.2f} ms, hit {st['hit_rate']:.3f}, "
          f"copy busy {100 * result['copy_busy']:.0f}%)", flush=True)
    return result


def part_hf(args, device: torch.device) -> dict:
    """transformers + accelerate: experts of each MoE layer offloaded with ``accelerate.cpu_offload``."""
    try:
        import accelerate  # noqa: PLC0415 - baseline only
        import transformers  # noqa: PLC0415
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: PLC0415
    except ImportError as exc:
        print(f"hf baseline skipped: {exc}")
        return {"skipped": str(exc)}
    print(f"hf baseline: transformers {transformers.__version__}, accelerate {accelerate.__version__}", flush=True)
    t0 = time.perf_counter()
    raw = deepseek_v3_dict(args.small, args.vocab, max(4096, 2 * args.context))
    for key in ("model_type", "scoring_func", "topk_method"):
        raw.pop(key)
    config = DeepseekV3Config(**raw)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # initialised on the GPU (fast); the experts then move to the host
            model = DeepseekV3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.eval()
    offloaded = 0
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        experts.to("cpu")
        offloaded += sum(p.numel() * p.element_size() for p in experts.parameters())
        accelerate.cpu_offload(experts, execution_device=device)
        assert all(p.device.type == "meta" for p in experts.parameters()), "cpu_offload left experts in place"
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"hf baseline: model built, {offloaded / 1e9:.1f} GB of experts offloaded to the host in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    prompt = torch.randint(5, args.vocab, (1, args.context), generator=torch.Generator().manual_seed(0)).to(device)
    out = None

    @torch.inference_mode()
    def forward(ids: torch.Tensor, past) -> None:
        nonlocal out
        out = model(input_ids=ids, past_key_values=past, use_cache=True)

    prefill_ms = timed_ms(lambda: forward(prompt, None), device)
    step_ms = []
    for _ in range(args.hf_tokens + 1):  # the first step is a warm-up
        nxt = out.logits[:, -1:].argmax(-1)
        step_ms.append(timed_ms(lambda nxt=nxt: forward(nxt, out.past_key_values), device))
    timed = step_ms[1:]
    ms = sum(timed) / len(timed)
    result = {"context": args.context, "decode_ms_per_token": ms, "prefill_ms": prefill_ms, "steps_ms": step_ms,
              "experts_bytes_offloaded": offloaded, "experts_dtype": str(dtype),
              "transformers": transformers.__version__, "accelerate": accelerate.__version__}
    print(f"hf baseline: prefill {args.context} tokens {prefill_ms:.0f} ms; decode {ms:.0f} ms/token over "
          f"{len(timed)} tokens (moves {offloaded / 1e9:.1f} GB of experts per token: "
          f"{offloaded / ms / 1e6:.1f} GB/s)", flush=True)
    if args.hearth_json and Path(args.hearth_json).exists():
        hearth = json.loads(Path(args.hearth_json).read_text()).get("model", {})
        if "decode_ms_per_token" in hearth:
            ratio = ms / hearth["decode_ms_per_token"]
            result["hearth_speedup"] = ratio
            print(f"hearth vs hf+accelerate decode at {args.context} tokens: {hearth['decode_ms_per_token']:.2f} vs "
                  f"{ms:.0f} ms/token = {ratio:.0f}x (target >= 100x; Hearth FP8 experts + 25% cache, "
                  f"HF bf16 experts moved whole)", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="decode,prefill", help="comma list of decode, prefill, model, hf")
    ap.add_argument("--layers", type=int, default=4, help="MoE layers in the decode/prefill store")
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps (as many warm-up steps)")
    ap.add_argument("--prefill-tokens", type=int, nargs="+", default=None, help="prompt lengths (4096 16384)")
    ap.add_argument("--prefill-variants", nargs="+", default=["ring"],
                    help="streaming variants timed one after the other: halves, ring (the default), ringN")
    ap.add_argument("--context", type=int, default=None, help="model/hf context tokens (4096)")
    ap.add_argument("--model-tokens", type=int, default=8, help="timed Hearth decode tokens")
    ap.add_argument("--hf-tokens", type=int, default=2, help="timed transformers decode tokens")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary of the model parts (129280)")
    ap.add_argument("--hearth-json", default=None, help="a JSON written by --parts model, for the hf ratio")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU when there is no GPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {"decode", "prefill", "model", "hf"}
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}")
    for name in args.prefill_variants:
        try:
            prefill_variant(name)
        except ValueError as exc:
            ap.error(str(exc))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.small:
        ap.error("no GPU: use --small for a CPU dry run")
    shapes = SMALL if args.small else REAL
    args.prefill_tokens = args.prefill_tokens or ([256, 1024] if args.small else [4096, 16384])
    args.context = args.context or (256 if args.small else 4096)
    args.vocab = args.vocab or (512 if args.small else 129280)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}, parts {parts}, expert "
          f"{ExpertLayout(shapes.hidden, shapes.inter, torch.float8_e4m3fn).record_bytes / 1e6:.2f} MB", flush=True)
    results: dict = {"args": vars(args)}

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))

    if "decode" in parts or "prefill" in parts:
        t0 = time.perf_counter()
        store = build_store(shapes, list(range(args.layers)), device)
        print(f"store: {store.total_bytes / 2**30:.1f} GiB, pinned {store.pinned_bytes / 2**30:.1f} GiB, built in "
              f"{time.perf_counter() - t0:.1f} s; link {link_bandwidth(store, device):.1f} GB/s (one-expert copies)",
              flush=True)
        resident = ResidentExperts(store, device)
        results["checks"] = check_correctness(store, resident, shapes, device)
        if "decode" in parts:
            results["decode"] = part_decode(store, resident, shapes, args.layers, args.steps, device)
            save()
        if "prefill" in parts:
            results["prefill"] = part_prefill(store, resident, shapes, args.layers, args.prefill_tokens,
                                              args.prefill_variants, device)
            save()
        del resident, store
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "model" in parts:
        results["model"] = part_model(args, device)
        save()
    if "hf" in parts:
        results["hf"] = part_hf(args, device)
        save()
    save()


if __name__ == "__main__":
    main()
