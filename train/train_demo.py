"""Train Hearth's bundled demo model: a few-million-parameter DeepSeek-V3.2 on Python's documentation.

    python -m train.train_demo --data .corpus --out OUT/demo_model --preset gpu --time-budget 200
    python -m train.train_demo --data DIR --out DIR --smoke          # a few CPU steps, tiny sizes

The forward pass is Hearth's own ``DeepseekForCausalLM`` run through a ``ForwardContext`` over a
fresh ``PagedCache`` per step (MLA writes its latents into the cache and attends over them, so the
gradients flow through the cache), with DSA active (``index_topk`` < context). The indexer is
trained by the KL objective of ``train.indexer_loss`` (dense attention for the first
``--dense-frac`` of the run, then sparse); experts are balanced by ``e_score_correction_bias``
updates. AdamW, cosine learning rate over the wall-clock budget, bf16 autocast on CUDA. The run
stops itself ``--reserve`` seconds before ``--time-budget`` (counted from process start) and writes a
Hub-layout model folder (tensor names as ``hearth.engine.tiny`` writes them), ``loss_log.csv``,
``loss_curve.svg``, ``samples.txt`` and ``MODEL_CARD.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_START = time.monotonic()

import numpy as np  # noqa: E402  (imports after the clock starts: they count against the budget)
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from hearth.engine.config import ModelConfig  # noqa: E402
from hearth.engine.kv_cache import PagedCache, build_context  # noqa: E402
from hearth.engine.models.deepseek import DeepseekForCausalLM  # noqa: E402
from hearth.engine.tiny import tiny_config  # noqa: E402
from train.indexer_loss import AttentionTap, ExpertLoad, indexer_kl_loss, lm_loss  # noqa: E402
from train.report import write_report  # noqa: E402

BLOCK_SIZE = 64


@dataclass(frozen=True)
class Preset:
    """Model sizes (Hub config keys) and the batch shape of one training setup."""

    model: dict[str, Any]
    context: int  # tokens per training sequence
    batch: int  # sequences per step
    lr: float
    kl_seqs: int  # sequences per step that feed the indexer loss


_PRESETS: dict[str, Preset] = {
    "gpu": Preset(
        model={"hidden_size": 256, "num_hidden_layers": 4, "first_k_dense_replace": 1, "intermediate_size": 768,
               "moe_intermediate_size": 192, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
               "num_attention_heads": 4, "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
               "qk_rope_head_dim": 16, "v_head_dim": 32, "index_n_heads": 4, "index_head_dim": 32,
               "index_topk": 128},
        context=512, batch=32, lr=3e-3, kl_seqs=4),
    "cpu": Preset(
        model={"hidden_size": 192, "num_hidden_layers": 3, "first_k_dense_replace": 1, "intermediate_size": 512,
               "moe_intermediate_size": 128, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
               "num_attention_heads": 4, "q_lora_rank": 96, "kv_lora_rank": 48, "qk_nope_head_dim": 32,
               "qk_rope_head_dim": 16, "v_head_dim": 32, "index_n_heads": 4, "index_head_dim": 32,
               "index_topk": 64},
        context=256, batch=8, lr=3e-3, kl_seqs=1),
    "smoke": Preset(
        model={"hidden_size": 32, "num_hidden_layers": 2, "first_k_dense_replace": 1, "intermediate_size": 64,
               "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
               "num_attention_heads": 2, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
               "qk_rope_head_dim": 8, "v_head_dim": 8, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 16},
        context=64, batch=2, lr=3e-3, kl_seqs=1),
}


def demo_config(preset: Preset, vocab_size: int) -> dict[str, Any]:
    """The Hub config.json: the tiny DeepSeek-V3.2 config of hearth.engine.tiny, resized."""
    raw = tiny_config("deepseek_v32")
    raw.update(preset.model)
    raw.update(vocab_size=vocab_size, num_key_value_heads=preset.model["num_attention_heads"], n_group=1,
               topk_group=1, num_nextn_predict_layers=0, max_position_embeddings=4 * preset.context,
               torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1, pad_token_id=1,
               rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": preset.context,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    return raw


def init_weights(model: DeepseekForCausalLM, seed: int) -> None:
    """GPT-style init: N(0, 0.02), output projections scaled by depth, norms at one; all trainable
    except the routers' correction biases (set by ExpertLoad, not by gradients)."""
    gen = torch.Generator().manual_seed(seed)
    depth_scale = 1 / math.sqrt(2 * len(model.layers))
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            p.requires_grad_(False)
            p.data.zero_()
            continue
        p.requires_grad_(True)
        if "norm" in name:
            p.data.fill_(0.0 if name.endswith(".bias") else 1.0)
        else:
            std = 0.02 * (depth_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
            p.data.copy_(torch.randn(p.shape, generator=gen) * std)


class Batches:
    """Random windows of ``context + 1`` tokens from the train part of the token stream."""

    def __init__(self, tokens: np.ndarray, context: int, batch: int, seed: int, val_frac: float = 0.01) -> None:
        split = int(len(tokens) * (1 - val_frac))
        self.train, self.val = tokens[:split], tokens[split:]
        self.context, self.batch = context, batch
        self.rng = np.random.default_rng(seed)

    def sample(self, part: np.ndarray | None = None) -> torch.Tensor:
        part = self.train if part is None else part
        starts = self.rng.integers(0, len(part) - self.context - 1, size=self.batch)
        rows = np.stack([part[s:s + self.context + 1] for s in starts]).astype(np.int64)
        return torch.from_numpy(rows)  # (B, context + 1)


def forward_loss(model: DeepseekForCausalLM, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Next-token loss of a batch, through a fresh paged cache: rows (B, T + 1)."""
    batch, context = rows.shape[0], rows.shape[1] - 1
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    cache = PagedCache(model.config, batch * blocks_per_seq, BLOCK_SIZE, torch.float32, device)
    tables = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)) for b in range(batch)]
    ctx = build_context(cache, [(t, 0, context) for t in tables], device)
    rows = rows.to(device)
    logits = model(rows[:, :-1].flatten(), ctx, all_logits=True)  # (B * T, vocab)
    return lm_loss(logits, rows[:, 1:].flatten())


def set_dense(model: DeepseekForCausalLM, dense: bool, topk: int, context: int) -> None:
    """Dense warm-up: let every indexer keep all causal keys (its top-k then selects everything)."""
    for layer in model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.topk = context if dense else topk


def lr_at(progress: float, peak: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    if progress < warmup:
        return peak * progress / warmup
    t = min(1.0, (progress - warmup) / (1 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def save_model(model: DeepseekForCausalLM, raw_config: dict, data: Path, out: Path) -> int:
    """config.json, model.safetensors (bf16), tokenizer files, generation_config.json; returns bytes."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to("cpu", torch.bfloat16).contiguous() for name, p in model.named_parameters()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors creates it owner-only; it gets shipped
    (out / "config.json").write_text(json.dumps(raw_config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((data / name).read_bytes())
    generation = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.7, "top_p": 0.9}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return (out / "model.safetensors").stat().st_size


@torch.no_grad()
def val_loss(model: DeepseekForCausalLM, batches: Batches, device: torch.device, n: int, autocast: Any) -> float:
    with autocast():
        return float(sum(forward_loss(model, batches.sample(batches.val), device) for _ in range(n)) / n)


def train(args: argparse.Namespace, start: float | None = None) -> dict[str, Any]:
    """Run one training; the time budget counts from ``start`` (default: now). Returns the summary."""
    start = time.monotonic() if start is None else start
    preset = _PRESETS[args.preset]
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_file(str(args.data / "tokenizer.json"))
    tokens = np.load(args.data / "tokens.npy")
    raw = demo_config(preset, tokenizer.get_vocab_size(with_added_tokens=True))
    model = DeepseekForCausalLM(ModelConfig.from_dict(raw))
    init_weights(model, args.seed)
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=preset.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    tap, load = AttentionTap(model), ExpertLoad(model)
    batches = Batches(tokens, preset.context, preset.batch, args.seed)
    use_amp = device.type == "cuda"

    def autocast() -> Any:
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp)

    deadline = args.time_budget - args.reserve
    train_start = time.monotonic()
    log: list[dict[str, float]] = []
    step, seen, dense = 0, 0, True
    set_dense(model, True, preset.model["index_topk"], preset.context)
    while True:
        elapsed = time.monotonic() - start
        progress = max((time.monotonic() - train_start) / max(1e-9, deadline - (train_start - start)),
                       step / args.max_steps if args.max_steps else 0.0)
        if progress >= 1.0 or elapsed >= deadline:
            break
        if dense and progress >= args.dense_frac:
            dense = False
            set_dense(model, False, preset.model["index_topk"], preset.context)
        lr = lr_at(progress, preset.lr)
        for group in opt.param_groups:
            group["lr"] = lr
        tap.clear()
        with autocast():
            loss = forward_loss(model, batches.sample(), device)
            kl = indexer_kl_loss(model, tap, preset.kl_seqs)
        opt.zero_grad(set_to_none=True)
        (loss + args.kl_weight * kl).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        imbalance = load.update(args.bias_rate)
        step += 1
        seen += preset.batch * preset.context
        if step == 1 or step % args.log_every == 0:
            row = {"step": step, "tokens": seen, "seconds": round(time.monotonic() - train_start, 2),
                   "lr": lr, "loss": loss.item(), "indexer_kl": kl.item(), "grad_norm": grad_norm.item(),
                   "max_load_ratio": imbalance, "dense": int(dense)}
            log.append(row)
            print(json.dumps(row), flush=True)
    train_seconds = time.monotonic() - train_start
    model.eval()
    final_val = val_loss(model, batches, device, args.val_batches, autocast) if len(batches.val) > preset.context + 1 \
        else float("nan")
    size = save_model(model, raw, args.data, args.out)
    n_params = sum(p.numel() for p in model.parameters())
    summary = {"preset": args.preset, "device": str(torch.cuda.get_device_name(device) if use_amp else "cpu"),
               "threads": torch.get_num_threads(), "params": n_params, "file_bytes": size, "steps": step,
               "tokens_seen": seen, "train_seconds": round(train_seconds, 1),
               "tokens_per_second": round(seen / max(train_seconds, 1e-9)), "final_train_loss": log[-1]["loss"]
               if log else float("nan"), "val_loss": final_val, "context": preset.context, "batch": preset.batch,
               "index_topk": preset.model["index_topk"], "dense_frac": args.dense_frac, "peak_lr": preset.lr,
               "bias_rate": args.bias_rate,
               "corpus_tokens": int(len(tokens))}
    write_report(args.out, args.data, log, summary, sample=not args.no_sample,
                 deadline=start + args.time_budget - 3 if args.max_steps == 0 else None)
    print(json.dumps(summary), flush=True)
    print(f"total wall time {time.monotonic() - start:.1f}s", flush=True)
    return summary


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m train.train_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path(".corpus"), help="folder from train.corpus")
    parser.add_argument("--out", type=Path, required=True, help="model folder to write")
    parser.add_argument("--preset", choices=sorted(_PRESETS), default="gpu")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--time-budget", type=float, default=200.0, help="seconds from process start")
    parser.add_argument("--reserve", type=float, default=25.0, help="seconds kept for evaluation and saving")
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: time only)")
    parser.add_argument("--dense-frac", type=float, default=0.1, help="part of the run with dense attention")
    parser.add_argument("--kl-weight", type=float, default=1.0)
    parser.add_argument("--bias-rate", type=float, default=5e-3, help="e_score_correction_bias update speed")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--val-batches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-sample", action="store_true", help="skip loading the result with Engine")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 4 steps on the CPU")
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.device, args.max_steps, args.log_every, args.val_batches = "smoke", "cpu", 4, 1, 1
    return args


def main(argv: list[str] | None = None) -> int:
    train(parse(argv), start=_START)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
