"""The user's path, measured end to end: a real-width checkpoint on disk, served by Hearth's server in its
own process, timed from the official OpenAI client.

1. Writes (once; reused while its config is unchanged) a checkpoint in the Hugging Face layout at a
   release's real widths, with the release's tensor names and weight formats, random weights made on the
   GPU, ~4 GB shards, a tokenizer of exactly the release's vocabulary size whose every id decodes to text,
   and generation_config.json (``--family``):
   - ``deepseek_v32`` (default) / ``glm_moe_dsa`` (GLM-5): 1 dense + N MoE layers of 256 routed experts,
     FP8 e4m3 with 128x128 power-of-two block scales on every linear the releases quantise;
   - ``glm4_moe`` (GLM-4.5-Air): 1 dense + N MoE layers of 128 routed experts + 1 shared, bf16 like the
     release (its FP8 variant uses another quantisation format);
   - ``gpt_oss`` (gpt-oss-120b): N MoE layers (no dense ones) alternating sliding-window and full
     attention, 128 experts stored as MXFP4 ``*_blocks`` / ``*_scales`` like the release, the rest bf16;
   - ``tiny``, ``tiny-glm4``, ``tiny-gpt-oss``: the same code paths at small widths, for a CPU smoke run
     (``--device cpu``).
2. For each configuration (``--configs``) starts ``hearth --cli serve`` (``python -m hearth.app.main``)
   with that configuration's flags and measures: load time (process start to
   listening, which includes the engine's warm-up, ``--warm-up``: the server answers once it ran; its
   own duration is printed beside it), the first request after start (what Triton compiles and graph
   captures the warm-up left to it), TTFT of 2K
   and 16K-token prompts (with offloaded experts also what each timed run did with them: misses, GB
   fetched, experts computed on the host, layer steps streamed; and once the server's host-experts probe,
   whose measured link and host costs decide which missed experts the host computes), decode tok/s per
   request and aggregate at 1 / 8 / 32 concurrent streams
   (``ignore_eos`` so every stream decodes ``--decode-tokens`` tokens), and the engine's own split of a
   decode step (``decode_step_ms``: the whole engine step; ``decode_run_gpu_ms``: the model's GPU time).
   Offloaded configurations keep a quarter of each layer's routed experts on the GPU.
   The ``chat-cache`` configuration measures a conversation's cache instead (``measure_chat_cache``): the
   TTFT of a follow-up turn in a ``--chat-context``-token chat (64K by default) with its cache pages on the
   device, after switching chats (restored from host RAM), after restarting the server (its warm start
   reads the saved pages back into RAM; the follow-up says whether it found them there or read the
   disk), once more sent the moment a restarted server is ready (no warm-up chat, only the engine's own
   warm-up at start), and of a full re-prefill
   of the same turn, with ``usage.prompt_tokens_details.cached_tokens`` and the server's
   ``prefix_cache_*`` counters. ``chat-cache-tiers`` takes the same rows for a tiered chat (tiers64k's
   ``--index-key-hot-pages 64 --latent-hot-rows 4096`` added to the servers' flags): its keys and latents
   are parked in host RAM when a turn ends and written to the cache folder's ``tiers`` files when the
   server stops; each row adds the changes of the server's ``tier_cache_*`` counters (tokens adopted,
   chats read back from disk, file bytes, files rejected) and says whether the follow-up adopted the
   parked tiers from RAM, from disk, or recomputed them.
3. Prints each row beside its floor: the bytes one decode step must read at 4.28 TB/s: the weights as the
   checkpoint stores them (FP8 one byte, bf16 two, MXFP4 4.25 bits), the distinct routed experts a batch
   of that size touches under uniform routing, and the attention cache: DSA's indexer keys and selected
   latents, or GQA's keys and values of the context (of the window on sliding layers); with offloaded
   experts also the link floor (expert bytes the server fetched per step / 55 GB/s pinned host-to-device).
4. With ``--runner``, times ``ModelRunner.run`` on the same checkpoint in-process (CUDA graphs on) and, for
   FP8 checkpoints, the bf16 runner of the same shapes (``bench_decode_step.build_model``): the
   engine-level ceilings the server rows are compared with.

gpt-oss answers in harmony channels and the server shows only message bodies, but a random-weights model
never writes the ``<|channel|>final<|message|>`` header, so its chat stream would carry no text at all.
Its requests therefore go to ``/v1/completions`` with the rendered chat prompt opened at the final
channel's message: the same prompt tokens, prefill and decode steps, and one text chunk per token.

    python bench/bench_e2e.py --dir /tmp/ckpt [--family deepseek_v32] [--moe-layers 2]
        [--configs resident offload-sync ...] [--concurrency 1 8 32] [--json FILE] [--runner]
    python bench/bench_e2e.py --configs chat-cache [--chat-context 65536] [--chat-cache-blocks N] [--reps 2]
    python bench/bench_e2e.py --configs chat-cache-tiers [--chat-context 65536] [--reps 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hearth.app.paths import HOME_ENV
from hearth.engine.stack_samples import ENV as STACK_SAMPLES_ENV
from hearth.engine.stack_samples import read_samples, top_stacks

if TYPE_CHECKING:
    from hearth.engine.config import ModelConfig

HBM = 4.28e12
LINK = 55e9
SHARD_BYTES = 4 << 30

DEEPSEEK_V32 = dict(
    model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"], vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128, num_key_value_heads=128,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
    index_n_heads=64, index_head_dim=128, index_topk=2048, scoring_func="sigmoid", topk_method="noaux_tc",
    norm_topk_prob=True, routed_scaling_factor=2.5, rope_theta=10000.0, max_position_embeddings=163840,
    rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
)
GLM5 = dict(
    model_type="glm_moe_dsa", architectures=["GlmMoeDsaForCausalLM"], vocab_size=154880, hidden_size=6144,
    intermediate_size=12288, moe_intermediate_size=2048, num_attention_heads=64, num_key_value_heads=64,
    q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
    n_routed_experts=256, num_experts_per_tok=8, n_group=1, topk_group=1, n_shared_experts=1,
    index_n_heads=32, index_head_dim=128, index_topk=2048, scoring_func="sigmoid", topk_method="noaux_tc",
    norm_topk_prob=True, routed_scaling_factor=2.5, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    rope_interleave=True, indexer_rope_interleave=True, max_position_embeddings=202752, rms_norm_eps=1e-5,
    hidden_act="silu", tie_word_embeddings=False,
)
# GLM-4.5-Air, from zai-org/GLM-4.5-Air's config.json (transformers' Glm4MoeConfig defaults are the same
# widths; INTELLECT-3, a GLM-4.5-Air fine-tune, publishes the identical config): 46 layers of which the first
# is dense, head_dim 128 given explicitly (not hidden / heads), rope on half of each head, q/k/v biases, no q/k
# norms, routed_scaling_factor 1.0 (GLM-4.5 itself has 2.5), one MTP layer (left out here, as in the others).
GLM45_AIR = dict(
    model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], vocab_size=151552, hidden_size=4096,
    intermediate_size=10944, moe_intermediate_size=1408, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
    partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False, n_routed_experts=128, n_shared_experts=1,
    num_experts_per_tok=8, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
    rope_theta=1000000.0, max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu",
    tie_word_embeddings=False,
)
# gpt-oss-120b, from openai/gpt-oss-120b's config.json (= transformers' GptOssConfig defaults): 36 layers
# alternating sliding (128 tokens) and full attention, each with 128 experts, top-4, learned sinks.
GPT_OSS_120B = dict(
    model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=201088, hidden_size=2880,
    intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128,
    num_experts_per_tok=4, experts_per_token=4, sliding_window=128, attention_bias=True, swiglu_limit=7.0,
    rope_theta=150000, rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 4096},
    initial_context_length=4096, max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu",
    tie_word_embeddings=False,
)
# Smoke-test models (the same code paths at small widths, run on the CPU): --family tiny... --device cpu.
TINY = {**DEEPSEEK_V32, "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 128, "n_routed_experts": 16,
        "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4, "index_n_heads": 4, "index_topk": 64}
TINY_GLM4 = {**GLM45_AIR, "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512,
             "moe_intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
             "n_routed_experts": 32, "num_experts_per_tok": 4}
TINY_GPT_OSS = {**GPT_OSS_120B, "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 128,
                "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "num_local_experts": 32,
                "sliding_window": 32}  # a window shorter than the smoke prompts, so it acts
FAMILIES = {"deepseek_v32": DEEPSEEK_V32, "glm_moe_dsa": GLM5, "glm4_moe": GLM45_AIR, "gpt_oss": GPT_OSS_120B,
            "tiny": TINY, "tiny-glm4": TINY_GLM4, "tiny-gpt-oss": TINY_GPT_OSS}

CONFIG_NAMES = ("resident", "resident-eager", "offload-sync", "offload-runahead", "offload-prefetch", "mli",
                "tiers64k", "chat-cache", "chat-cache-tiers")
# Tiered indexer keys and latents (recent pages / rows on the GPU, the rest in host RAM) for 64K-token chats
TIER_FLAGS = ["--index-key-hot-pages", "64", "--latent-hot-rows", "4096"]


def config_flags(name: str, n_experts: int) -> list[str]:
    """The server flags of one configuration. Offloaded rows keep a quarter of each layer's routed experts
    on the GPU (a 25% cache: 64 of DeepSeek-V3.2's 256, 32 of GLM-4.5-Air's or gpt-oss-120b's 128)."""
    offload = ["--offload", "always", "--expert-cache-slots", str(max(1, n_experts // 4))]
    return {
        "resident": ["--offload", "never"],
        "resident-eager": ["--offload", "never", "--cuda-graphs", "false"],
        "offload-sync": [*offload, "--scheduler", "sync"],
        "offload-runahead": [*offload, "--scheduler", "runahead"],
        "offload-prefetch": [*offload, "--scheduler", "prefetch"],
        "mli": ["--offload", "never", "--mli", "true"],
        "tiers64k": ["--offload", "never", *TIER_FLAGS],
    }[name]


# ---- the checkpoint --------------------------------------------------------------------------


FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
              "weight_block_size": [128, 128]}
MXFP4_EXPERTS = {"quant_method": "mxfp4", "modules_to_not_convert": [  # as gpt-oss's release lists them
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def checkpoint_config(family: str, moe_layers: int) -> dict:
    raw = FAMILIES[family]
    if raw["model_type"] == "gpt_oss":  # every layer MoE; sliding and full attention alternate, sliding first
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(moe_layers)]
        return {**raw, "num_hidden_layers": moe_layers, "layer_types": kinds, "quantization_config": MXFP4_EXPERTS}
    dense_first = {**raw, "num_hidden_layers": 1 + moe_layers, "first_k_dense_replace": 1,
                   "num_nextn_predict_layers": 0}
    if raw["model_type"] == "glm4_moe":  # bf16, as GLM-4.5-Air's main release
        return dense_first
    return {**dense_first, "quantization_config": FP8_BLOCKS}


def write_checkpoint(out: Path, family: str, moe_layers: int, device: torch.device) -> Path:
    """Write (or reuse) the benchmark checkpoint; returns its folder."""
    from safetensors.torch import save_file

    from hearth.engine.config import ModelConfig
    from hearth.engine.testing.tiny import param_shapes
    from hearth.engine.testing.tiny_tokenizer import write_tiny_tokenizer

    raw = checkpoint_config(family, moe_layers)
    stamp = json.dumps(raw, sort_keys=True)
    if (out / "bench-stamp.json").exists() and (out / "bench-stamp.json").read_text() == stamp:
        print(f"checkpoint: reusing {out}", flush=True)
        return out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    t0 = time.perf_counter()
    special = write_tiny_tokenizer(out, raw["model_type"], raw["vocab_size"], synthetic=True)
    special = {k: v for k, v in special.items() if v is not None}
    raw = {**raw, **special}
    config = ModelConfig.from_dict(raw)
    gen = torch.Generator(device=device).manual_seed(0)
    files: list[str] = []
    weight_map: dict[str, int] = {}
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        files.append(f"part-{len(files) + 1:05d}.safetensors")
        save_file(shard, str(out / files[-1]), metadata={"format": "pt"})
        weight_map.update({n: len(files) - 1 for n in shard})
        shard, size = {}, 0

    for name, shape in param_shapes(config).items():
        for n, t in stored_tensors(name, shape, config, gen, device).items():
            nbytes = t.numel() * t.element_size()
            if size + nbytes > SHARD_BYTES and shard:
                flush()
            shard[n] = t.cpu()
            size += nbytes
            total += nbytes
    flush()
    names = [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    for old, new in zip(files, names):
        (out / old).rename(out / new)
    weight_map = {n: names[i] for n, i in weight_map.items()}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    # The release's special ids; greedy (the requests send temperature 0 anyway).
    (out / "generation_config.json").write_text(json.dumps({**special, "temperature": 0.0}))
    (out / "bench-stamp.json").write_text(stamp)
    print(f"checkpoint: wrote {total / 1e9:.1f} GB in {len(names)} shards to {out} "
          f"in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def stored_tensors(name: str, shape: tuple[int, ...], config: ModelConfig, gen: torch.Generator,
                   device: torch.device) -> dict[str, torch.Tensor]:
    """One parameter as the release stores it: gpt-oss's stacked experts as MXFP4 blocks + scales
    ([E, out, in / 32, 16] and [E, out, in / 32]), FP8 + block scales where an FP8 release quantises,
    the rest bf16 (the router's correction bias fp32)."""
    from hearth.engine.testing.tiny import is_fp8_quantized, quantize_fp8_blocks

    if config.mxfp4_experts and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return mxfp4_experts(name, shape, gen, device)
    value = _init(name, shape, gen, device)
    if config.quantization is not None and is_fp8_quantized(name, shape):
        w8, scale = quantize_fp8_blocks(value)
        return {name: w8, name + "_scale_inv": scale}
    keep_fp32 = "e_score_correction_bias" in name
    return {name: value.to(torch.float32 if keep_fp32 else torch.bfloat16)}


def mxfp4_experts(name: str, shape: tuple[int, ...], gen: torch.Generator,
                  device: torch.device) -> dict[str, torch.Tensor]:
    """A stacked [E, in, out] expert tensor quantised one expert at a time (the whole of gpt-oss-120b's
    gate_up_proj would take 8.5 GB in fp32, its quantisation several times that)."""
    from hearth.kernels.moe.mxfp4 import quantize_mxfp4

    blocks, scales = [], []
    for _ in range(shape[0]):
        value = torch.randn(shape[1:], device=device, generator=gen) * shape[1] ** -0.5
        b, sc = quantize_mxfp4(value.T)  # stored [out, in] like the release
        blocks.append(b.cpu())
        scales.append(sc.cpu())
    return {name + "_blocks": torch.stack(blocks), name + "_scales": torch.stack(scales)}


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    if "norm" in name:
        return torch.ones(shape, device=device)
    if name.endswith("bias"):
        return torch.zeros(shape, device=device)
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, device=device, generator=gen)
    return torch.randn(shape, device=device, generator=gen) * shape[-1] ** -0.5


# ---- floors ----------------------------------------------------------------------------------


# Cache bytes per token and layer that a DSA decode step reads: the indexer's key (128 FP8 + an fp32 scale)
# for every context token, then the latent row (512 FP8 + scales + the bf16 rope key) of each selected token.
INDEX_KEY_ROW = 132
LATENT_ROW = 656


@dataclass(frozen=True)
class Floors:
    fixed: int  # bytes every decode step reads: all weights but the embedding and the routed experts
    expert: int  # bytes of one routed expert as stored (FP8 + scales, bf16, or MXFP4 blocks + scales + biases)
    moe_layers: int
    n_experts: int
    top_k: int
    windows: tuple[int | None, ...]  # per layer: the tokens its attention reads at most (None: the context)
    kv_row: int  # GQA: bytes of one token's keys and values per layer (the cache is bf16)
    dsa_topk: int | None  # DSA: latents selected per query (the cache is read as INDEX_KEY_ROW / LATENT_ROW)
    mxfp4: bool  # experts stored as MXFP4 (in the offload store, on the link and in GPU memory)

    @classmethod
    def of(cls, folder: Path) -> Floors:
        from hearth.engine.config import ModelConfig
        from hearth.engine.loader import ROUTED_EXPERT, tensor_bytes

        config = ModelConfig.from_file(folder)
        sizes = tensor_bytes(folder)
        fixed = sum(b for n, b in sizes.items() if not ROUTED_EXPERT.search(n) and "embed_tokens" not in n)
        experts = sum(b for n, b in sizes.items() if ROUTED_EXPERT.search(n))
        moe = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
        return cls(fixed, experts // (moe * config.n_routed_experts), moe, config.n_routed_experts,
                   config.num_experts_per_tok, tuple(config.window(i) for i in range(config.num_hidden_layers)),
                   2 * config.latent_dim, config.index_topk, config.mxfp4_experts)

    def distinct(self, batch: int) -> float:
        """Expected distinct experts per layer for ``batch`` tokens under uniform routing."""
        return self.n_experts * (1 - (1 - self.top_k / self.n_experts) ** batch)

    def kv_bytes(self, context: int) -> int:
        """Cache bytes one request's decode step reads at ``context`` tokens."""
        if self.dsa_topk is not None:
            return len(self.windows) * (context * INDEX_KEY_ROW + min(context, self.dsa_topk) * LATENT_ROW)
        return sum(context if w is None else min(context, w) for w in self.windows) * self.kv_row

    def step_bytes(self, batch: int, context: int) -> float:
        return self.fixed + self.moe_layers * self.distinct(batch) * self.expert + batch * self.kv_bytes(context)

    def describe(self, context: int) -> str:
        cache = "indexer keys + selected latents" if self.dsa_topk is not None else "K/V of the context"
        held = ""
        if self.mxfp4:  # 4.25 bits a value, as stored: in the offload store, over the link, in cache slots and
            # resident on the GPU, where the fused MoE kernel reads it directly
            held = " (MXFP4 as stored: in RAM, over the link and on the GPU, resident or in a cache slot)"
        return (f"floors: {self.fixed / 1e9:.2f} GB read by every step besides routed experts; "
                f"{self.expert / 1e6:.1f} MB per routed expert{held}; {cache} {self.kv_bytes(context) / 1e6:.1f} MB "
                f"per request at {context} tokens; batch 1 step floor {self.step_bytes(1, context) / HBM * 1e3:.3f} ms")


# ---- the server ------------------------------------------------------------------------------


class Server:
    """``hearth --cli serve`` in its own process (as a user starts it); ``url`` once it answers."""

    def __init__(self, model: Path, flags: list[str], max_model_len: int, max_num_seqs: int, log: Path,
                 samples: Path | None = None) -> None:
        """``samples``: where the server writes its engine and HTTP threads' stack samples
        (``hearth.engine.stack_samples``; ``--stack-samples``)."""
        with socket.socket() as probe:  # a free port for the server to bind
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        cmd = [sys.executable, "-m", "hearth.app.main", "--cli", "serve", "--model", str(model),
               "--port", str(self.port), "--max-model-len", str(max_model_len),
               "--max-num-seqs", str(max_num_seqs), *flags]
        self.log = log.open("w")
        self.t0 = time.perf_counter()
        self.samples = samples
        # Hearth's folders, the chat cache's among them, empty as on a new install: a server started earlier
        # (another config, or another run of this script, whose prompts repeat) saved its prompts' pages there
        # when it stopped, and a new one would find its prompts cached (chat-cache passes its own folder)
        self.home = tempfile.TemporaryDirectory(prefix="hearth-bench-home-")
        env = {**os.environ, HOME_ENV: self.home.name}
        if samples is not None:
            samples.unlink(missing_ok=True)
            env[STACK_SAMPLES_ENV] = str(samples)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.load_s = math.nan
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 900) -> None:
        import httpx

        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            if time.perf_counter() - self.t0 > timeout:
                raise TimeoutError("server did not start")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.load_s = time.perf_counter() - self.t0

    def stats(self) -> dict:
        import httpx

        return httpx.get(self.url + "/hearth/stats", timeout=30).json()

    def load_text(self) -> str:
        """The load time as printed: with the engine's warm-up at start (part of it) when it ran one."""
        warm_up_s = self.stats().get("warm_up_s")
        return f"load {self.load_s:.1f} s" + ("" if warm_up_s is None else f" (engine warm-up {warm_up_s:.1f} s of it)")

    def stop(self, timeout: float = 60) -> float:
        """End the server as a user's Ctrl-C does (it saves its chat cache on the way out); returns how
        long that took."""
        t0 = time.perf_counter()
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        self.home.cleanup()
        return time.perf_counter() - t0


def window_step_means(before: dict, after: dict) -> dict:
    """Means over the decode steps between two /hearth/stats snapshots (the engine's running totals):
    step wall time, the gap before the next step, model GPU time, generated tok/s, and the steps by
    how they ran (overlapped, or synchronous and why). Empty when the server has no totals."""
    def delta(key: str) -> float:
        return (find_number(after, key) or 0.0) - (find_number(before, key) or 0.0)

    out: dict = {}
    if (micro := delta("runahead_steps")) > 0:  # the runahead decoder's calls (engine/step_timer.py)
        out.update(window_runahead_calls=micro, window_runahead_call_ms=delta("runahead_step_ms_sum") / micro,
                   window_runahead_ms_per_token=delta("runahead_step_ms_sum") / max(delta("runahead_tokens"), 1.0))
    steps = delta("decode_steps")
    if steps <= 0:
        return out
    out |= {"window_step_ms": delta("decode_step_ms_sum") / steps,
           "window_gap_ms": delta("decode_gap_ms_sum") / max(delta("decode_gaps"), 1.0),
           "window_engine_tok_s": delta("generated_tokens") / max(after["uptime_s"] - before["uptime_s"], 1e-9),
           "window_steps_by_kind": {k.removeprefix("decode_steps_"): after[k] - before.get(k, 0.0)
                                    for k in sorted(after) if k.startswith("decode_steps_")}}
    if delta("decode_run_gpu_steps") > 0:
        out["window_run_gpu_ms"] = delta("decode_run_gpu_ms_sum") / delta("decode_run_gpu_steps")
    return out


HOST_SPEEDS = ("host_link_per_expert_ms", "host_cpu_fixed_ms", "host_cpu_per_token_ms", "host_transfer_ms")
TTFT_EXPERT_COUNTERS = ("misses", "bytes_fetched", "cpu_computed", "evictions", "streamed_layer_steps", "copy_ms")


def host_speeds(stats: dict) -> dict[str, float]:
    """The server's host-experts probe (its measured link and host costs: which missed experts it computes
    on the host follows from them), empty when the probe did not run (``--host-experts`` on / off)."""
    found = {key: find_number(stats, f"expert_cache_{key}") for key in HOST_SPEEDS}
    return {key: value for key, value in found.items() if value is not None}


def expert_deltas(before: dict, after: dict, runs: int) -> dict[str, float]:
    """Expert-cache counters between two stats snapshots, per run (bytes as GB)."""
    out = {}
    for key in TTFT_EXPERT_COUNTERS:
        a, b = find_number(before, f"expert_cache_{key}"), find_number(after, f"expert_cache_{key}")
        if a is not None and b is not None:
            gb = key == "bytes_fetched"
            out["gb_fetched" if gb else key] = (b - a) / runs / (1e9 if gb else 1)
    return out


def find_number(stats: dict, key: str) -> float | None:
    """The first value named ``key`` anywhere in the stats JSON."""
    stack = [stats]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if key in node and isinstance(node[key], int | float):
                return float(node[key])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


# ---- the client ------------------------------------------------------------------------------


class Prompts:
    """Prompts of an exact length (counted with the checkpoint's tokenizer): a chat message, or for
    harmony models (gpt-oss) the rendered chat prompt opened at the final channel's message, sent as a
    text completion (see the module docstring)."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        from hearth.engine.config import ModelConfig
        from hearth.engine.text.harmony import uses_harmony

        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.seed = 0
        harmony = uses_harmony(ModelConfig.from_file(folder).model_type)
        self.template = (folder / "chat_template.jinja").read_text(encoding="utf-8") if harmony else None

    def text(self, tokens: int) -> str:
        """Random lowercase words of about ``tokens`` tokens; each call is new (no prefix-cache hits)."""
        self.seed += 1
        gen = torch.Generator().manual_seed(self.seed)
        letters = "abcdefghijklmnopqrstuvwxyz"
        words = []
        for length in torch.randint(2, 9, (tokens,), generator=gen).tolist():
            idx = torch.randint(0, 26, (length,), generator=gen).tolist()
            words.append("".join(letters[i] for i in idx))
        text = " ".join(words)
        ids = self.tokenizer.encode(text).ids[:tokens]
        return self.tokenizer.decode(ids)

    def prompt(self, tokens: int) -> Request:
        """What one request sends: ``tokens`` tokens of words as the user's message."""
        return self.request([{"role": "user", "content": self.text(tokens)}])

    def request(self, messages: list[dict[str, str]]) -> Request:
        """What a request with these chat messages sends: the messages (chat), or the whole harmony
        prompt rendered from them (text completion)."""
        from hearth.engine.text.chat_template import render_chat_template

        if self.template is None:
            return messages
        return render_chat_template(self.template, messages) + HARMONY_FINAL


# A chat request's messages, or a text completion's prompt (harmony models).
Request = list[dict[str, str]] | str


# After the prompt's <|start|>assistant: the answer's message header, so the completion is message text.
HARMONY_FINAL = "<|channel|>final<|message|>"


@dataclass
class Stream:
    ttft: float
    decode_s: float
    completion_tokens: int
    prompt_tokens: int
    start: float
    end: float
    arrivals: list[float]  # when each content chunk (one token, as the server streams) arrived
    cached_tokens: int = 0  # usage.prompt_tokens_details: prompt tokens served from the prefix cache
    text: str = ""

    @property
    def decode_tok_s(self) -> float:
        return (self.completion_tokens - 1) / self.decode_s if self.decode_s > 0 else math.nan


async def one_stream(client, model: str, request: Request, max_tokens: int, started: asyncio.Queue,
                     conversation: str | None = None) -> Stream:
    """Stream one request (a text completion when ``request`` is a rendered prompt); ``conversation``
    names its chat for the server's prefix cache."""
    start = time.perf_counter()
    first = None
    usage = None
    arrivals: list[float] = []
    pieces: list[str] = []
    extra: dict = {"ignore_eos": True}
    if conversation is not None:
        extra["hearth"] = {"conversation_id": conversation}
    sampling = dict(model=model, max_tokens=max_tokens, temperature=0.0, stream=True,
                    stream_options={"include_usage": True}, extra_body=extra)
    completions = isinstance(request, str)
    if completions:
        stream = await client.completions.create(prompt=request, **sampling)
    else:
        stream = await client.chat.completions.create(messages=request, **sampling)
    async for chunk in stream:
        now = time.perf_counter()
        choice = chunk.choices[0] if chunk.choices else None
        text = (choice.text if completions else choice.delta.content) if choice is not None else None
        if text:
            arrivals.append(now)
            pieces.append(text)
        if first is None and choice is not None and (text or choice.finish_reason):
            first = now
            started.put_nowait(first)
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    assert usage is not None, "the server sent no usage chunk"
    first = first or end
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    return Stream(first - start, end - first, usage.completion_tokens, usage.prompt_tokens, start, end, arrivals,
                  cached, "".join(pieces))


def decode_window(streams: list[Stream]) -> tuple[list[float], float]:
    """Per-stream tokens/s while every stream decodes (after the last first token, before the first
    stream ends: no prefill of another stream shares those steps), and the window's length."""
    lo = max(s.start + s.ttft for s in streams)
    hi = min(s.arrivals[-1] if s.arrivals else s.end for s in streams)
    if hi - lo <= 0:
        return [s.decode_tok_s for s in streams], 0.0
    return [sum(lo < t <= hi for t in s.arrivals) / (hi - lo) for s in streams], hi - lo


async def run_streams(url: str, model: str, prompts: list[Request], max_tokens: int,
                      snapshots: list | None = None) -> list[Stream]:
    """Stream every prompt at once; with ``snapshots``, append (time, /hearth/stats) once every stream
    has its first token (prefill over, decode only from here) and again when all are done."""
    import httpx
    from openai import AsyncOpenAI

    started: asyncio.Queue = asyncio.Queue()

    async def snapshot_when_all_decode() -> None:
        for _ in prompts:
            await started.get()
        async with httpx.AsyncClient() as http:
            stats = (await http.get(url + "/hearth/stats", timeout=30)).json()
        snapshots.append((time.perf_counter(), stats))

    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=1800, max_retries=0) as client:
        watcher = asyncio.create_task(snapshot_when_all_decode()) if snapshots is not None else None
        requests = (one_stream(client, model, p, max_tokens, started) for p in prompts)
        streams = list(await asyncio.gather(*requests))
        if watcher is not None:
            await watcher
            async with httpx.AsyncClient() as http:
                snapshots.append((time.perf_counter(), (await http.get(url + "/hearth/stats", timeout=30)).json()))
        return streams


def triton_builds() -> set[Path]:
    """The kernel builds in the Triton cache the bench and its servers share (TRITON_CACHE_DIR, as `gpu_verify.sh
    first` sets it): one folder a build, holding its <kernel>.cubin. Empty when that variable is not set."""
    root = os.environ.get("TRITON_CACHE_DIR")
    return set(Path(root).glob("*/*.cubin")) if root else set()


def new_builds(before: set[Path]) -> str:
    """The kernels built since ``before`` (`triton_builds`), by name with their counts: what a request compiled."""
    names: dict[str, int] = {}
    for path in sorted(triton_builds() - before):
        names[path.stem] = names.get(path.stem, 0) + 1
    return ", ".join(f"{name} x{n}" if n > 1 else name for name, n in names.items()) or "none"


def measure(server: Server, model: str, prompts: Prompts, args: argparse.Namespace, floors: Floors,
            offloaded: bool) -> dict:
    def streams(lengths: list[int], max_tokens: int, snapshots: list | None = None) -> list[Stream]:
        return asyncio.run(run_streams(server.url, model, [prompts.prompt(n) for n in lengths], max_tokens,
                                       snapshots))

    res: dict = {"load_s": server.load_s}
    import httpx  # noqa: F401 - the client's imports (about a second), before the first request is timed
    import openai  # noqa: F401 - (until 2026-12-04 its first_request_s included them)

    builds = triton_builds()
    t0 = time.perf_counter()
    streams([256], 16)
    res["first_request_s"] = time.perf_counter() - t0
    res["warm_up_s"] = server.stats().get("warm_up_s")
    print(f"  {server.load_text()}; first request (compiles, graph captures) {res['first_request_s']:.1f} s",
          flush=True)
    if os.environ.get("TRITON_CACHE_DIR"):
        res["first_request_builds"] = new_builds(builds)
        print(f"    kernels the first request built: {res['first_request_builds']}", flush=True)
    if offloaded:
        res["host_speeds"] = host_speeds(server.stats())
        if res["host_speeds"]:
            print("  host-experts probe: " + ", ".join(f"{k} {v:.3f}" for k, v in res["host_speeds"].items()),
                  flush=True)
    # Warm every batch bucket (graph captures) before timing.
    for c in args.concurrency:
        streams([64] * c, 8)
    for length in args.ttft:  # one untimed run first: a new prompt length compiles prefill kernels
        builds = triton_builds()
        first = streams([length], 2)[0]
        res[f"ttft_{length}_first_s"] = first.ttft  # (what a first prompt this long costs: compiles on a new machine)
        if os.environ.get("TRITON_CACHE_DIR"):
            res[f"ttft_{length}_first_builds"] = new_builds(builds)
            print(f"    kernels the untimed first {length}-token prompt built: {res[f'ttft_{length}_first_builds']}",
                  flush=True)
        before = server.stats() if offloaded else {}
        sent, runs = [], []
        for _ in range(args.reps):
            sent.append(time.time())
            runs.append(streams([length], 2)[0])
        if server.samples is not None:  # --stack-samples: where the timed prompts' time went in the server
            print_stack_samples(server.samples, sent[0], time.time(), f"TTFT {length} x {args.reps}")
            slowest = max(range(len(runs)), key=lambda i: runs[i].ttft)
            if len(runs) > 1:  # one slow run among fast ones: its own window
                print_stack_samples(server.samples, sent[slowest], sent[slowest] + runs[slowest].ttft,
                                    f"TTFT {length}, slowest run ({runs[slowest].ttft * 1e3:.0f} ms)")
        ttft = statistics.median(r.ttft for r in runs)
        res[f"ttft_{length}_s"] = ttft
        cached = res[f"ttft_{length}_cached_tokens"] = max(r.cached_tokens for r in [first, *runs])  # 0: read whole
        each = f"; runs {', '.join(f'{r.ttft * 1e3:.0f}' for r in runs)} ms" if len(runs) > 1 else ""
        print(f"  TTFT {runs[0].prompt_tokens}-token prompt: {ttft * 1e3:.0f} ms "
              f"({runs[0].prompt_tokens / ttft:.0f} prompt tok/s{each}; the untimed first {first.ttft * 1e3:.0f} ms)"
              + (f"; NOT read whole: up to {cached} tokens from the prefix cache" if cached else ""),
              flush=True)
        if offloaded:  # what the prompts' steps did with the experts, per run (prefill and one decode step)
            spent = expert_deltas(before, server.stats(), args.reps)
            res[f"ttft_{length}_experts"] = spent
            print("    experts per run: " + ", ".join(f"{k} {v:.2f}" for k, v in spent.items()), flush=True)
    rows = []
    for c in args.concurrency:
        snaps: list = []
        decoded = streams([args.prompt] * c, args.decode_tokens, snaps)
        (t_a, before), (t_b, after) = snaps
        rates, window = decode_window(decoded)
        per_req = statistics.median(rates)
        if not per_req > 0:  # (e.g. 8 streams of 8 tokens: the first ends before the last starts decoding)
            print(f"  c={c}: no window in which every stream decodes (raise --decode-tokens)", flush=True)
            continue
        span = max(s.end for s in decoded) - min(s.start for s in decoded)
        agg = sum(rates)
        ms_per_token = 1e3 / per_req
        floor_ms = floors.step_bytes(c, args.prompt + args.decode_tokens // 2) / HBM * 1e3
        row = {"concurrency": c, "per_request_tok_s": per_req, "aggregate_tok_s": agg, "window_s": window,
               "total_tok_s": sum(s.completion_tokens for s in decoded) / span, "ms_per_token": ms_per_token,
               "hbm_floor_ms": floor_ms, "pct_of_hbm_floor": 100 * floor_ms / ms_per_token,
               "engine_step_ms": find_number(after, "decode_step_ms"),
               "run_gpu_ms": find_number(after, "decode_run_gpu_ms")}
        if offloaded:
            fetched = (find_number(after, "expert_cache_bytes_fetched") or 0) - \
                (find_number(before, "expert_cache_bytes_fetched") or 0)
            steps = max(1.0, (t_b - t_a) * 1e3 / ms_per_token)  # decode steps between the snapshots
            row["link_floor_ms"] = fetched / steps / LINK * 1e3
            row["link_busy_pct"] = 100 * fetched / LINK / (t_b - t_a)
            row["x_link_floor"] = ms_per_token / row["link_floor_ms"] if row["link_floor_ms"] else math.nan
        row.update(window_step_means(before, after))
        if row["engine_step_ms"] and row["run_gpu_ms"]:
            row["outside_run_pct"] = 100 * (ms_per_token - row["run_gpu_ms"]) / ms_per_token
        if row.get("window_run_gpu_ms"):  # the same, from this window's steps only
            row["window_outside_run_pct"] = 100 * (ms_per_token - row["window_run_gpu_ms"]) / ms_per_token
        rows.append(row)
        extra = f"; link floor {row['link_floor_ms']:.2f} ms ({row['x_link_floor']:.2f}x)" if offloaded else ""
        step, gpu = row["engine_step_ms"] or math.nan, row["run_gpu_ms"] or math.nan
        print(f"  c={c}: {per_req:.1f} tok/s per request ({ms_per_token:.2f} ms/token), aggregate {agg:.0f} tok/s; "
              f"HBM floor {floor_ms:.2f} ms ({row['pct_of_hbm_floor']:.0f}% of it); engine step {step:.2f} ms, "
              f"model GPU {gpu:.2f} ms{extra}", flush=True)
        if "window_step_ms" in row:
            print(f"    this window only: engine step {row['window_step_ms']:.3f} ms + gap "
                  f"{row['window_gap_ms']:.3f} ms, "
                  f"model GPU {row.get('window_run_gpu_ms', math.nan):.3f} ms, engine {row['window_engine_tok_s']:.0f} "
                  f"tok/s; steps {row['window_steps_by_kind']}", flush=True)
        if "window_runahead_calls" in row:
            print(f"    runahead decoder: {row['window_runahead_calls']:.0f} calls of "
                  f"{row['window_runahead_call_ms']:.3f} ms, {row['window_runahead_ms_per_token']:.3f} ms of them "
                  f"per token finished", flush=True)
    res["decode"] = rows
    return res


# ---- a conversation's cache across turns, chat switches and restarts (chat-cache) -------------


CHAT_CACHE = "chat-cache"
CHAT_CACHE_TIERS = "chat-cache-tiers"  # the same rows for a tiered chat (``TIER_FLAGS``, as tiers64k)
CHAT_BLOCK_SIZE = 64  # tokens per cache page (the engine's default, passed explicitly for the sizing)
CHAT_ANSWER_TOKENS = 32  # the first turn's answer
CHAT_FOLLOW_UP_TOKENS = 64  # each follow-up's new user message
CHAT_ROOM = 1024  # context beyond --chat-context the server allows: the answer and a follow-up
CHAT_TARGET_S = 0.5  # issue 16: a follow-up's TTFT in a 64K-token chat after a chat switch and after a restart
CHAT_TARGET_CONTEXT = 65536
# Each stage: its follow-up's label and its name in the report. A tiered chat's keys and latents live in
# host RAM (recent ones also on the GPU) and are parked there when a turn ends; a restarted server
# reads a parked chat's file when a prompt matches it (no warm start: that is the pages').
CHAT_STAGES = {"gpu": ("follow-up, pages in the device cache", "in the device cache"),
               "host": ("follow-up after {others} other chats (from RAM)", "after switching chats"),
               "disk": ("follow-up after a restart (warm start, then a warm-up chat)",
                        "after a restart (warm start, warm-up chat)"),
               "cold": ("follow-up sent when a restarted server is ready (no warm-up chat)",
                        "after a restart, sent at ready (no warm-up chat)")}
TIER_STAGES = {**CHAT_STAGES, "gpu": ("follow-up right after its turn (tiers parked in RAM)",
                                      "right after its turn (tiers parked in RAM)"),
               "disk": ("follow-up after a restart (then a warm-up chat)", "after a restart (warm-up chat)")}
# tier_cache_*, as deltas
TIER_COUNTERS = ("hits_tokens", "restored_chats", "disk_bytes", "files_rejected", "preloaded_chats")
# the engine's host time (ms) on the follow-up's path, tier_cache_<name> as deltas, in the row as tier_<name>
# (hearth.engine.tier_cache.TierCache.stats): adopting (of it reading a file back: allocating its pinned
# tensors, checksumming; the tiers' resume), parking, writing chats the RAM budget pushes out
TIER_TIMES = ("restore_ms", "resume_ms", "match_ms", "disk_read_ms", "pin_alloc_ms", "disk_crc_ms", "park_ms",
              "spill_ms", "write_ms", "preload_wait_ms")


@dataclass
class Chat:
    """A conversation of one long user message and its answer; each follow-up adds a new message."""

    conversation: str
    first: str
    answer: str = ""

    def turn(self, message: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.first}, {"role": "assistant", "content": self.answer},
                {"role": "user", "content": message}]


def send(server: Server, model: str, request: Request, max_tokens: int, conversation: str) -> Stream:
    """One streamed request, alone on the server."""
    from openai import AsyncOpenAI

    async def go() -> Stream:
        async with AsyncOpenAI(base_url=server.url + "/v1", api_key="none", timeout=1800, max_retries=0) as client:
            return await one_stream(client, model, request, max_tokens, asyncio.Queue(), conversation)

    return asyncio.run(go())


def prefix_stats(stats: dict) -> dict[str, float]:
    return {k: v for k, v in stats.items() if k.startswith("prefix_cache_")}


def stats_delta(before: dict, after: dict, key: str) -> float:
    """How much a /hearth/stats counter moved (0 where the server has none)."""
    return (after.get(key) or 0.0) - (before.get(key) or 0.0)


def tier_row(before: dict, after: dict) -> dict:
    """A tiered chat's follow-up: what the parked tiers' counters (``tier_cache_*``) moved between the
    stats before and after it, and where its tiers came from (``tier_source``): "disk" (a parked
    chat's file read back on its path), "preloaded" (from RAM, on a server whose warm start read
    chats' files into RAM: a restarted one's), "ram" (a chat parked in RAM) or "recomputed" (none
    adopted: its whole prompt prefilled). ``tier_disk_mb`` is the change of the files' bytes (negative when the turn's
    longer chat, parked in RAM, replaced the file it was read from)."""
    moved = {key: stats_delta(before, after, f"tier_cache_{key}") for key in TIER_COUNTERS}
    row = {"tier_hit_tokens": int(moved["hits_tokens"]), "tier_restored_chats": int(moved["restored_chats"]),
           "tier_disk_mb": moved["disk_bytes"] / 1e6, "tier_files_rejected": int(moved["files_rejected"]),
           "tier_disk_chats": int(before.get("tier_cache_disk_chats") or 0),  # on disk when it was sent
           "tier_cache": {k: v for k, v in after.items() if k.startswith("tier_cache_")}}
    row.update({f"tier_{key}": stats_delta(before, after, f"tier_cache_{key}") for key in TIER_TIMES})
    row["tier_disk_read_mb"] = stats_delta(before, after, "tier_cache_disk_read_bytes") / 1e6
    row["tier_preloaded"] = int(after.get("tier_cache_preloaded_chats") or 0)  # by the server's warm start
    read_back = row["tier_restored_chats"] - int(moved["preloaded_chats"])  # (by the engine itself)
    row["tier_source"] = ("recomputed" if not row["tier_hit_tokens"] else "disk" if read_back > 0 else
                          "preloaded" if row["tier_preloaded"] else "ram")
    return row


def tier_times_text(row: dict) -> str:
    """The engine's host time on a tiered follow-up's path, as printed: adopting its tiers (of it the
    file read back and the tiers' resume), parking, spilling other chats to disk."""
    text = f"restore {row['tier_restore_ms']:.0f} ms of host time"
    if row["tier_disk_read_mb"]:
        text += (f", of it {row['tier_disk_read_mb']:.0f} MB read from disk in {row['tier_disk_read_ms']:.0f} ms "
                 f"({row['tier_pin_alloc_ms']:.0f} ms allocating, {row['tier_disk_crc_ms']:.0f} ms checksumming)")
    text += f", resume {row['tier_resume_ms']:.0f} ms; matching {row['tier_match_ms']:.0f} ms, " \
            f"parking {row['tier_park_ms']:.0f} ms"
    if row["tier_spill_ms"] >= 1:  # other chats written to disk on the request path
        text += f", spilling {row['tier_spill_ms']:.0f} ms (writing {row['tier_write_ms']:.0f} ms)"
    return text


def server_steps_text(row: dict) -> str:
    """Where a follow-up's time went on the server, beside the tiers' host times: its prompt steps,
    decode graphs captured on its path, and the pages the prefix cache restored (from disk or RAM)."""
    text = f"server: {row['prompt_steps']} prompt steps {row['prompt_step_ms']:.0f} ms"
    if row["graph_captures"]:
        text += f", {row['graph_captures']} decode graph captures {row['graph_capture_ms']:.0f} ms"
    if row["restored_tokens"]:
        text += f", {row['restored_tokens']} page tokens restored in {row['restore_ms']:.0f} ms"
        if row["disk_read_mb"]:
            text += f" ({row['disk_read_mb']:.0f} MB from disk in {row['disk_read_ms']:.0f} ms)"
        if row["preload_wait_ms"]:
            text += f", {row['preload_wait_ms']:.0f} ms waiting for the pages' warm start"
    return text


def tier_source_text(row: dict) -> str:
    """Where a tiered follow-up's tiers came from, as printed."""
    if row["tier_source"] == "disk":
        return f"adopted from disk ({row['tier_restored_chats']} chat file read back)"
    if row["tier_source"] == "ram":
        return "adopted from RAM"
    if row["tier_source"] == "preloaded":
        wait = f", {row['tier_preload_wait_ms']:.0f} ms waiting for its read" if row["tier_preload_wait_ms"] else ""
        return f"adopted from RAM (the warm start's copy of its file{wait})"
    rejected = row["tier_files_rejected"]
    return "NOT adopted (recomputed" + (f"; {rejected} files rejected)" if rejected else ")")


class ChatBench:
    """The stages of the chat-cache measurement on one server at a time (``measure_chat_cache``);
    ``tiers``: the chat's keys and latents are tiered (chat-cache-tiers)."""

    def __init__(self, model: str, prompts: Prompts, context: int, tiers: bool = False) -> None:
        self.model = model
        self.prompts = prompts
        self.context = context
        self.tiers = tiers
        self.stages = TIER_STAGES if tiers else CHAT_STAGES
        self.chats = 0

    def new_chat(self) -> Chat:
        self.chats += 1
        return Chat(f"bench-chat-{self.chats}", self.prompts.text(self.context))

    def variant(self, chat: Chat, index: int) -> Chat:
        """The same chat as another conversation whose first letter differs (by ``index``), so no cached
        page matches it: its follow-up is a full re-prefill of the same length."""
        self.chats += 1
        letters = [c for c in string.ascii_lowercase if c != chat.first[0]]
        return Chat(f"bench-chat-{self.chats}", letters[index % len(letters)] + chat.first[1:], chat.answer)

    def first_turn(self, server: Server, chat: Chat) -> Stream:
        """The chat's first turn (its answer becomes part of the chat)."""
        request = self.prompts.request([{"role": "user", "content": chat.first}])
        first = send(server, self.model, request, CHAT_ANSWER_TOKENS, chat.conversation)
        chat.answer = first.text
        return first

    def follow_up(self, server: Server, chat: Chat, label: str) -> dict:
        """Time a new follow-up turn of ``chat`` (a new user message each time, as a user would send),
        with the cache counters it moved (for a tiered chat also ``tier_row``'s)."""
        before = server.stats()
        request = self.prompts.request(chat.turn(self.prompts.text(CHAT_FOLLOW_UP_TOKENS)))
        sent = time.time()
        turn = send(server, self.model, request, 2, chat.conversation)
        after = server.stats()
        if server.samples is not None and turn.ttft >= SLOW_TTFT_S:
            print_stack_samples(server.samples, sent, sent + turn.ttft, label)
        def delta(key: str) -> float:
            return stats_delta(before, after, key)

        row = {"ttft_s": turn.ttft, "prompt_tokens": turn.prompt_tokens, "cached_tokens": turn.cached_tokens,
               "restored_tokens": int(delta("prefix_cache_restored_tokens")), "prefix_cache": prefix_stats(after),
               "restore_ms": delta("prefix_cache_restore_ms"), "disk_read_ms": delta("prefix_cache_disk_read_ms"),
               "disk_read_mb": delta("prefix_cache_disk_read_bytes") / 1e6, "spill_ms": delta("prefix_cache_spill_ms"),
               "preload_wait_ms": delta("prefix_cache_preload_wait_ms"),
               # the server's warm start when the follow-up was sent (its stats snapshot: <= 0.25 s old)
               "preloaded_mb": (before.get("prefix_cache_preloaded_bytes") or 0.0) / 1e6,
               "preload_running": bool(before.get("prefix_cache_preload_running")),
               # the server's steps while it ran (its prompt chunks, whole-step graphs captured for it)
               "prompt_steps": int(delta("prompt_steps")), "prompt_step_ms": delta("prompt_step_ms_sum"),
               "graph_captures": int(delta("decode_graph_captures")),
               "graph_capture_ms": delta("decode_graph_capture_ms")}
        row["from_ram"] = bool(row["restored_tokens"]) and row["disk_read_mb"] == 0
        if self.tiers:
            row.update(tier_row(before, after))
            disk = f"; tier files {row['tier_disk_mb']:+.0f} MB" if row["tier_disk_mb"] else ""
            print(f"  {label}: TTFT {turn.ttft * 1e3:.0f} ms, {turn.prompt_tokens} prompt tokens, "
                  f"{turn.cached_tokens} cached ({row['tier_hit_tokens']} from parked tiers, "
                  f"{tier_source_text(row)}{disk}; {tier_times_text(row)}; {server_steps_text(row)})", flush=True)
            return row
        where = ""
        if row["restored_tokens"]:  # the engine's host time restoring them, of it reading files
            where = f"; restore {row['restore_ms']:.0f} ms of host time, " + (
                "every page from RAM" if row["from_ram"] else
                f"of it {row['disk_read_mb']:.0f} MB read from disk in {row['disk_read_ms']:.0f} ms")
            if row["preload_wait_ms"]:
                where += f", {row['preload_wait_ms']:.0f} ms waiting for the warm start's read"
        if row["preloaded_mb"] or row["preload_running"]:
            where += (f"; the warm start had read {row['preloaded_mb']:.0f} MB into RAM"
                      f"{' and was still reading' if row['preload_running'] else ''}")
        if row["spill_ms"] >= 1:  # pages of other chats the device reused for this one, kept in RAM first
            where += f"; spilling other chats' pages {row['spill_ms']:.0f} ms"
        print(f"  {label}: TTFT {turn.ttft * 1e3:.0f} ms, {turn.prompt_tokens} prompt tokens, "
              f"{turn.cached_tokens} cached ({row['restored_tokens']} restored from RAM or disk{where})", flush=True)
        return row


SLOW_TTFT_S = 0.3  # a follow-up this slow gets its server's stack samples printed (--stack-samples)


def print_stack_samples(path: Path, start: float, end: float, label: str) -> None:
    """The commonest stacks of the server's engine and HTTP threads between a follow-up's sending and
    its first token (the sampler writes them twice a second: waited for)."""
    time.sleep(0.7)
    for thread in ("hearth-engine", "MainThread"):
        stacks = read_samples(path, start, end, thread)
        print(f"    {label}: {thread} stack samples over {end - start:.2f} s: {len(stacks)}", flush=True)
        for n, stack in top_stacks(stacks, frames=5, top=6):
            print(f"      {n:5d}  {stack}", flush=True)


def drop_file_cache(folder: Path) -> bool:
    """Write the cache files out (the page files, and a tiered chat's in ``tiers/``) and drop them from
    the OS file cache, so a restart reads them from the disk rather than from RAM (False where the OS
    offers no posix_fadvise)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def chat_cache_flags(pages: int, store: str, device_flags: list[str], tiers: bool = False) -> list[str]:
    """The chat-cache servers' flags, the same at every restart as a user's are: the cache folder the
    page files (and a tiered chat's files, in its ``tiers`` folder) go to and come back from, and for
    a tiered chat its tier config (the files name it: another config's are stale and deleted)."""
    return [*config_flags("resident", 0), *(TIER_FLAGS if tiers else []), "--block-size", str(CHAT_BLOCK_SIZE),
            "--num-cache-blocks", str(pages), "--prefix-cache-offload", "true", "--prefix-cache-dir", store,
            *device_flags]


def measure_chat_cache(folder: Path, prompts: Prompts, args: argparse.Namespace, device_flags: list[str],
                       tiers: bool = False) -> dict:
    """A follow-up turn of a ``--chat-context``-token chat, timed (TTFT) while its cache pages are on the
    GPU, after switching chats (pages restored from host RAM), after restarting the server (the files
    dropped from the OS file cache first; the server's warm start reads them back into RAM while the
    model loads and while the server warms up, and the row says whether the follow-up found them
    there or read the disk), and against a full re-prefill of the same turn (the same words with a
    changed first letter: no page matches). Last, the cold case: the server restarted once more (files
    dropped again) and the follow-up sent the moment it is ready, before any warm-up chat, so its TTFT
    includes whatever compiles the engine's warm-up at start (``--warm-up``) left to the first request
    and whatever the warm start has not read yet.

    The server holds one request (``--max-num-seqs 1``) and a device cache of one chat
    (``--num-cache-blocks``: its context in pages, unless ``--chat-cache-blocks`` says otherwise), so
    switching chats takes only as many other long chats as fill the whole device cache (two) and
    pushes every page of the first chat to the host. The page files go to a temporary folder of the
    bench's own. Each server is warmed first by a whole chat of the same size (first turn and a
    follow-up, untimed) so no measured turn includes compiles; its pages are then evicted like any
    other chat's.

    ``tiers`` (chat-cache-tiers): the same stages for a chat with tiered keys and latents
    (``TIER_FLAGS``). Its pages hold neither (the prefix cache is off); each turn's tiers are parked
    in host RAM when it ends and the next turn adopts them: right after the turn, after the other
    chats (parked beside them within the RAM budget), and after a restart from the file the stopping
    server wrote for every chat held only in RAM (``Engine.close``) into ``tiers`` in the same cache
    folder, which the restarted server (same flags: the files name the tier config) indexes at start
    and reads when the follow-up matches it. The rows add ``tier_row``: the ``tier_cache_*`` counters'
    changes and whether the follow-up adopted its tiers from RAM, from disk, or recomputed them."""
    max_len = max(args.max_model_len, args.chat_context + CHAT_ROOM)
    pages = args.chat_cache_blocks or -(-max_len // CHAT_BLOCK_SIZE)
    bench = ChatBench(folder.name, prompts, args.chat_context, tiers)
    res: dict = {"chat_context": args.chat_context, "max_model_len": max_len, "num_cache_blocks": pages}
    suffix, files = ("-tiers", "tier files") if tiers else ("", "page files")
    if tiers:
        res["tier_flags"] = TIER_FLAGS
    with tempfile.TemporaryDirectory(prefix=f"hearth-bench-chat-cache{suffix}-") as store:
        flags = chat_cache_flags(pages, store, device_flags, tiers)
        print(f"  server flags: {' '.join(flags)} --max-model-len {max_len} --max-num-seqs 1", flush=True)

        def start(log_tail: str, warm_up_chat: bool = True) -> Server:
            samples = args.logs / f"server-chat-cache{suffix}{log_tail}.stacks.jsonl" if args.stack_samples else None
            server = Server(folder, flags, max_len, 1, args.logs / f"server-chat-cache{suffix}{log_tail}.log", samples)
            try:
                server.wait()
                print(f"  server ready: {server.load_text()}", flush=True)
                if tiers:  # the parked chats' files the server found in the cache folder
                    stats = server.stats()
                    found = {k: int(stats.get(f"tier_cache_{k}") or 0) for k in ("disk_chats", "disk_bytes",
                                                                                  "files_rejected")}
                    res.setdefault("tier_files_at_start", []).append(found)
                    print(f"  tier files at start: {found['disk_chats']} chats, {found['disk_bytes'] / 1e6:.0f} MB, "
                          f"{found['files_rejected']} rejected", flush=True)
                if warm_up_chat:
                    warm = bench.new_chat()
                    bench.first_turn(server, warm)
                    bench.follow_up(server, warm, "warm-up chat (untimed)")
            except BaseException:
                server.stop()
                raise
            return server

        def stop(server: Server) -> float:
            took = server.stop(timeout=900)
            uncached = drop_file_cache(Path(store))
            print(f"  server stopped (saving its cache) in {took:.1f} s; {files} "
                  f"{'dropped from' if uncached else 'left in'} the OS file cache", flush=True)
            res["files_uncached"] = uncached
            return took

        server = start("")
        try:
            res["load_s"] = server.load_s
            chat = bench.new_chat()
            first = bench.first_turn(server, chat)
            res["first_turn"] = {"ttft_s": first.ttft, "prompt_tokens": first.prompt_tokens,
                                 "cached_tokens": first.cached_tokens}
            print(f"  first turn: TTFT {first.ttft:.2f} s, {first.prompt_tokens} prompt tokens", flush=True)
            res["gpu"] = bench.follow_up(server, chat, bench.stages["gpu"][0])
            device_tokens = int(server.stats()["cache_blocks_total"]) * CHAT_BLOCK_SIZE
            others = -(-device_tokens // args.chat_context)
            for _ in range(others):  # other chats' long turns until the device cache was rewritten whole
                bench.first_turn(server, bench.new_chat())
            res["switched_chats"] = others
            res["host"] = bench.follow_up(server, chat, bench.stages["host"][0].format(others=others))
        finally:
            res["shutdown_s"] = stop(server)
        server = start("-restart")
        try:
            res["restart_load_s"] = server.load_s
            res["disk"] = bench.follow_up(server, chat, bench.stages["disk"][0])
            full = [bench.follow_up(server, bench.variant(chat, i), f"full re-prefill {i + 1}")
                    for i in range(args.reps)]
        finally:
            stop(server)
        server = start("-cold", warm_up_chat=False)
        try:
            res["cold_load_s"] = server.load_s
            res["cold"] = bench.follow_up(server, chat, bench.stages["cold"][0])
        finally:
            server.stop(timeout=900)
    res["full"] = {"ttft_s": statistics.median(r["ttft_s"] for r in full), "runs": full}
    report_chat_cache(res, tiers)
    return res


def report_chat_cache(res: dict, tiers: bool = False) -> None:
    """Each follow-up against the full re-prefill, and the issue's target; for a tiered chat where each
    follow-up's tiers came from."""
    full = res["full"]["ttft_s"]
    print(f"  full re-prefill: TTFT {full:.3f} s (median of {len(res['full']['runs'])})", flush=True)
    for stage, (_, what) in (TIER_STAGES if tiers else CHAT_STAGES).items():
        row = res[stage]
        row["x_full"] = row["ttft_s"] / full
        target = ""
        if stage != "gpu" and res["chat_context"] >= CHAT_TARGET_CONTEXT:
            row["target_met"] = row["ttft_s"] <= CHAT_TARGET_S
            target = f"; target <= {CHAT_TARGET_S} s {'met' if row['target_met'] else 'NOT met'}"
        source = ""
        if tiers:
            source = f"; tiers {tier_source_text(row)}"
        elif stage in ("disk", "cold") and row["restored_tokens"]:
            source = "; pages preloaded (restored from RAM)" if row["from_ram"] else \
                f"; {row['disk_read_mb']:.0f} MB read from disk"
        print(f"  {what}: TTFT {row['ttft_s']:.3f} s = {row['x_full']:.3f}x the full re-prefill "
              f"({full / row['ttft_s']:.1f}x faster), {row['cached_tokens']} of {row['prompt_tokens']} "
              f"tokens cached{source}{target}", flush=True)
    for name, stats in (("prefix", res["disk"]["prefix_cache"]),
                        *((("tier", res["disk"]["tier_cache"]),) if tiers else ())):
        print(f"  {name} cache after the restart: " + ", ".join(f"{k.removeprefix(f'{name}_cache_')} {v:.0f}"
                                                               for k, v in stats.items()), flush=True)


def serve_and_measure(name: str, folder: Path, prompts: Prompts, args: argparse.Namespace, floors: Floors,
                      device_flags: list[str]) -> dict:
    """Start the server with configuration ``name``'s flags and take ``measure``'s rows."""
    flags = config_flags(name, floors.n_experts)
    print(f"  server flags: {' '.join(flags)}", flush=True)
    max_len = 65536 + 4096 if name == "tiers64k" else args.max_model_len
    samples = args.logs / f"server-{name}.stacks.jsonl" if args.stack_samples else None
    server = Server(folder, [*flags, *device_flags], max_len, max(args.concurrency), args.logs / f"server-{name}.log",
                    samples)
    try:
        server.wait()
        return measure(server, folder.name, prompts, args, floors, "offload" in name)
    finally:
        server.stop()


# ---- runner-level steps (same run) -----------------------------------------------------------


def kernel_profile(runner, context: int) -> str:
    """GPU time by kernel over 10 eager batch-1 decode steps (the graphed step runs the same kernels)."""
    from torch.profiler import ProfilerActivity, profile

    from hearth.engine.runner import StepInput

    table = list(range(-(-runner.max_model_len // runner.block_size)))
    ids = list(range(3, 3 + context))
    for start in range(0, context, 2048):
        runner.run([StepInput(table, start, ids[start:start + 2048])])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for step in range(10):
            runner.run([StepInput(table, context + step, [5])], use_graphs=False).argmax(-1).tolist()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)


def runner_steps(folder: Path, batches: list[int], context: int, profile: Path | None = None) -> dict:
    """ms per decode step of ModelRunner.run (CUDA graphs) on this checkpoint and, for an FP8 one, on bf16
    weights of the same shapes built on the GPU (the other checkpoints already run in bf16)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_decode_step as bds

    from hearth.engine.api import EngineConfig
    from hearth.engine.config import ModelConfig
    from hearth.engine.runner import ModelRunner

    out: dict = {}
    max_len = 1 << (context + 200).bit_length()
    cfg = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=max_len, max_num_seqs=max(batches),
                       offload="never")
    config = ModelConfig.from_file(folder)
    stored = "fp8" if config.quantization is not None else "bf16"
    runner = ModelRunner.load(str(folder), cfg)
    probe = bds.RoutingProbe(runner.model)
    for b in batches:
        out[f"{stored}_b{b}_ms"] = bds.run_batch(runner, b, context, 30, graphs=True, probe=probe)["median_s"] * 1e3
    if profile is not None:
        profile.write_text(kernel_profile(runner, context))
    del runner, probe
    torch.cuda.empty_cache()
    if config.quantization is not None:
        device = torch.device("cuda")
        model = bds.build_model(config, device, ModelRunner.features_for(config, cfg, device).attention)
        runner = ModelRunner.from_model(model, cfg)
        probe = bds.RoutingProbe(model)
        for b in batches:
            out[f"bf16_b{b}_ms"] = bds.run_batch(runner, b, context, 30, graphs=True, probe=probe)["median_s"] * 1e3
        del runner, model
        torch.cuda.empty_cache()
    print("  runner-level step (CUDA graphs): " + ", ".join(f"{k} {v:.2f}" for k, v in out.items()), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "hearth-bench-ckpt")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="deepseek_v32")
    parser.add_argument("--moe-layers", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["resident"], choices=CONFIG_NAMES)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--ttft", type=int, nargs="*", default=[2048, 16384], help="prompt lengths for TTFT")
    parser.add_argument("--prompt", type=int, default=1536, help="prompt tokens of the decode streams")
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=20480)
    parser.add_argument("--chat-context", type=int, default=65536,
                        help="chat-cache(-tiers): tokens of the chat's first message")
    parser.add_argument("--chat-cache-blocks", type=int,
                        help="chat-cache(-tiers): device cache pages (default: one chat's context)")
    parser.add_argument("--runner", action="store_true", help="also time ModelRunner.run in-process")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--stack-samples", action="store_true",
                        help="the servers sample their engine and HTTP threads' stacks into --logs; a chat-cache "
                             "follow-up slower than 0.3 s and every timed TTFT run print their commonest stacks")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--device", default="cuda", help="cpu: smoke-test the script itself (with a tiny family)")
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    folder = write_checkpoint(args.dir, args.family, args.moe_layers, device)
    floors = Floors.of(folder)
    print(floors.describe(args.prompt), flush=True)
    prompts = Prompts(folder)
    results: dict = {"family": args.family, "moe_layers": args.moe_layers, "configs": {},
                     "torch": torch.__version__,
                     "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "none"}
    device_flags = ["--device", "cpu"] if device.type == "cpu" else []
    for name in args.configs:
        print(f"== {name}", flush=True)
        try:
            if name in (CHAT_CACHE, CHAT_CACHE_TIERS):
                results["configs"][name] = measure_chat_cache(folder, prompts, args, device_flags,
                                                              tiers=name == CHAT_CACHE_TIERS)
            else:
                results["configs"][name] = serve_and_measure(name, folder, prompts, args, floors, device_flags)
        except Exception as exc:  # a failing configuration is a result too: report it and go on
            print(f"  FAILED: {type(exc).__name__}: {exc}", flush=True)
            results["configs"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    if args.runner:
        results["runner"] = runner_steps(folder, [b for b in args.concurrency if b <= 8], args.prompt,
                                         args.logs / "kernel-profile.txt")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
