"""Train Hearth's bundled demo model: a ~12M-parameter DeepSeek-V3.2 on Python's documentation.

    python -m train.train_demo --data .corpus --out OUT/demo_model --preset h200 --time-budget 420
    python -m train.train_demo --data DIR --out DIR --smoke          # a few CPU steps, tiny sizes

The forward pass is Hearth's own ``DeepseekForCausalLM`` (its modules and parameters) computed over
the whole [B, T] batch at once by ``train.batched`` (no per-request or per-expert Python, no host
syncs), with DSA active (``index_topk`` < context). The indexer is trained by the KL objective of
``train.indexer_loss`` (dense attention for the first ``--dense-frac`` of the run, then sparse);
experts are balanced by ``e_score_correction_bias`` updates. AdamW with residual dropout, bf16
autocast on CUDA (optionally ``torch.compile``), and a warm-up / stable / decay learning rate: the
decay starts at ``1 - decay_frac`` of the wall-clock budget, or earlier once the held-out loss
(evaluated every ``--eval-every`` seconds) stops improving; the weights with the best held-out loss
are kept. The run stops itself ``--reserve`` seconds before ``--time-budget`` (counted from process
start) and writes a Hub-layout model folder (tensor names as ``hearth.engine.testing.tiny`` writes them),
``loss_log.csv``, ``loss_curve.svg``, ``samples.txt`` and ``MODEL_CARD.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_START = time.monotonic()

import numpy as np  # noqa: E402  (imports after the clock starts: they count against the budget)
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from hearth.engine.config import ModelConfig  # noqa: E402
from hearth.engine.models.deepseek import DeepseekForCausalLM  # noqa: E402
from hearth.engine.testing.tiny import tiny_config  # noqa: E402
from train.batched import batched_forward  # noqa: E402
from train.indexer_loss import ExpertLoad, lm_loss  # noqa: E402
from train.report import write_report  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Preset:
    """Model sizes (Hub config keys) and the batch shape and regularisation of one training setup."""

    model: dict[str, Any]
    context: int  # tokens per training sequence
    batch: int  # sequences per step
    lr: float
    kl_seqs: int  # sequences per step that feed the indexer loss
    dropout: float = 0.0  # residual dropout
    weight_decay: float = 0.1  # on matrices


_PRESETS: dict[str, Preset] = {
    "h200": Preset(
        model={"hidden_size": 384, "num_hidden_layers": 5, "first_k_dense_replace": 1, "intermediate_size": 1024,
               "moe_intermediate_size": 160, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
               "num_attention_heads": 6, "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
               "qk_rope_head_dim": 16, "v_head_dim": 32, "index_n_heads": 4, "index_head_dim": 32,
               "index_topk": 128},
        context=512, batch=64, lr=2e-3, kl_seqs=8, dropout=0.2),
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
        context=64, batch=2, lr=3e-3, kl_seqs=1, dropout=0.1),
}


def demo_config(preset: Preset, vocab_size: int) -> dict[str, Any]:
    """The Hub config.json: the tiny DeepSeek-V3.2 config of hearth.engine.testing.tiny, resized."""
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
    """Training windows of ``context + 1`` tokens drawn at random from the train part of the token
    stream, and the held-out part (the last ``val_frac``, at least two windows) cut into consecutive
    windows; all on the training device, so a step needs no host-to-device copy."""

    def __init__(self, tokens: np.ndarray, context: int, batch: int, seed: int, device: torch.device,
                 val_frac: float = 0.01) -> None:
        stream = torch.from_numpy(tokens.astype(np.int64))
        split = len(stream) - max(int(len(stream) * val_frac), 2 * context + 1)  # >= 2 held-out windows
        self.train, self.val = stream[:split].to(device), stream[split:].to(device)
        self.context, self.batch = context, batch
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._offsets = torch.arange(context + 1, device=device)

    def sample(self) -> torch.Tensor:
        """(B, context + 1) int64 random training windows."""
        starts = torch.randint(0, len(self.train) - self.context, (self.batch, 1), device=self.train.device,
                               generator=self.generator)
        return self.train[starts + self._offsets]

    def val_windows(self) -> torch.Tensor:
        """(W, context + 1) int64: the held-out tokens as consecutive windows (empty if too short)."""
        starts = torch.arange(0, max(0, len(self.val) - self.context), self.context, device=self.val.device)
        return self.val[starts[:, None] + self._offsets]


class Schedule:
    """Warm-up, stable, then decay of the learning rate over ``total`` units (seconds or steps).

    The decay normally takes the last ``decay_frac`` of ``total``; ``decay_now`` starts it early (the
    held-out loss stopped improving), lasting the same fraction of the run so far."""

    def __init__(self, peak: float, total: float, warmup: float = 0.03, decay_frac: float = 0.25,
                 floor: float = 0.05) -> None:
        self.peak, self.total, self.floor = peak, total, floor
        self.warmup = warmup * total
        self.decay_frac = decay_frac
        self.decay_start = (1 - decay_frac) * total
        self.end = total

    @property
    def decaying(self) -> bool:
        return self.decay_start < (1 - self.decay_frac) * self.total

    def decay_now(self, now: float) -> bool:
        """Start the decay at ``now`` unless it has begun; True if it starts."""
        if now >= self.decay_start:
            return False
        self.decay_start = now
        self.end = min(self.total, now + now * self.decay_frac / (1 - self.decay_frac))
        return True

    def lr(self, now: float) -> float:
        if now < self.warmup:
            return self.peak * now / self.warmup
        if now < self.decay_start:
            return self.peak
        t = min(1.0, (now - self.decay_start) / max(1e-9, self.end - self.decay_start))
        return self.peak * (self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * t)))

    def done(self, now: float) -> bool:
        return now >= self.end


def set_dense(model: DeepseekForCausalLM, dense: bool, topk: int, context: int) -> None:
    """Dense warm-up: let every indexer keep all causal keys (its top-k then selects everything)."""
    for layer in model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.topk = context if dense else topk


StepFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]]


def make_step(model: DeepseekForCausalLM, kl_seqs: int, dropout: float, experts: str = "auto") -> StepFn:
    """rows (B, T + 1) -> (next-token loss, indexer KL, routed-token counts per MoE layer)."""

    def step(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        out = batched_forward(model, rows[:, :-1], kl_seqs=kl_seqs, dropout=dropout, experts=experts)
        return lm_loss(out.logits.flatten(0, 1), rows[:, 1:].flatten()), out.indexer_kl, out.expert_counts

    return step


@torch.no_grad()
def val_loss(model: DeepseekForCausalLM, windows: torch.Tensor, autocast: Any, batch: int = 64) -> float:
    """Mean next-token loss over all held-out windows (eval mode: no dropout)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=windows.device)
    with autocast():
        for i in range(0, len(windows), batch):
            rows = windows[i:i + batch]
            logits = batched_forward(model, rows[:, :-1]).logits
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(),
                                                       reduction="sum")
    model.train(was_training)
    return float(total) / (windows.shape[0] * (windows.shape[1] - 1))


class HeldOut:
    """Held-out evaluations: the best weights so far, and how many evaluations since the loss last
    improved by more than ``min_delta``."""

    def __init__(self, model: DeepseekForCausalLM, windows: torch.Tensor, autocast: Any, min_delta: float) -> None:
        self.model, self.windows, self.autocast, self.min_delta = model, windows, autocast, min_delta
        self.reset()

    def reset(self) -> None:
        """Forget earlier numbers (they measured another function: dense attention)."""
        self.best, self.best_step, self.best_tokens, self.stale = float("inf"), 0, 0, 0
        self.weights: dict[str, torch.Tensor] | None = None

    def evaluate(self, step: int, tokens: int) -> float:
        loss = val_loss(self.model, self.windows, self.autocast) if len(self.windows) else float("nan")
        self.stale = 0 if loss < self.best - self.min_delta else self.stale + 1
        if loss < self.best:
            self.best, self.best_step, self.best_tokens = loss, step, tokens
            self.weights = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        return loss

    @torch.no_grad()
    def restore(self) -> bool:
        """Put the best weights back (False if there are none yet)."""
        if self.weights is None:
            return False
        for name, p in self.model.named_parameters():
            p.copy_(self.weights[name])
        return True


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


def train(args: argparse.Namespace, start: float | None = None) -> dict[str, Any]:
    """Run one training; the time budget counts from ``start`` (default: now). Returns the summary."""
    start = time.monotonic() if start is None else start
    preset = _PRESETS[args.preset]
    if args.batch:
        preset = dataclasses.replace(preset, batch=args.batch)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    use_amp = device.type == "cuda"
    tokenizer = Tokenizer.from_file(str(args.data / "tokenizer.json"))
    tokens = np.load(args.data / "tokens.npy")
    raw = demo_config(preset, tokenizer.get_vocab_size(with_added_tokens=True))
    model = DeepseekForCausalLM(ModelConfig.from_dict(raw))
    init_weights(model, args.seed)
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": preset.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=preset.lr, betas=(0.9, 0.95), fused=use_amp)
    load = ExpertLoad(model)
    batches = Batches(tokens, preset.context, preset.batch, args.seed, device)
    windows = batches.val_windows()
    topk = preset.model["index_topk"]

    def autocast() -> Any:
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp)

    eager = make_step(model, preset.kl_seqs, preset.dropout)
    step_fn, compiled = eager, False
    deadline = args.time_budget - args.reserve
    train_start = time.monotonic()
    by_steps = args.max_steps > 0
    schedule = Schedule(preset.lr, args.max_steps if by_steps else max(1e-9, deadline - (train_start - start)))
    log: list[dict[str, float]] = []
    step, seen, dense = 0, 0, True
    held_out = HeldOut(model, windows, autocast, args.min_delta)
    last_eval, stop, decay_at = time.monotonic(), "budget", None
    set_dense(model, True, topk, preset.context)
    while True:
        now = step if by_steps else time.monotonic() - train_start
        if schedule.done(now) or time.monotonic() - start >= deadline:
            stop = "max steps" if by_steps else "decay finished" if schedule.done(now) and schedule.decaying \
                else "budget"
            break
        if dense and now >= args.dense_frac * schedule.total:
            dense = False
            set_dense(model, False, topk, preset.context)
            held_out.reset()
            if args.compile:  # one compilation, for the sparse stage (the warm-up runs eagerly)
                step_fn, compiled = torch.compile(eager), True
        lr = schedule.lr(now)
        for group in opt.param_groups:
            group["lr"] = lr
        rows = batches.sample()
        try:
            with autocast():
                loss, kl, counts = step_fn(rows)
            opt.zero_grad(set_to_none=True)
            (loss + args.kl_weight * kl).backward()
        except Exception as exc:  # a failed compile must not lose the run: go on eagerly
            if step_fn is eager:
                raise
            print(json.dumps({"compile_failed": f"{type(exc).__name__}: {exc}"[:500]}), flush=True)
            step_fn, compiled = eager, False
            continue
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        load.add(counts)
        load.update(args.bias_rate)
        step += 1
        seen += rows.shape[0] * (rows.shape[1] - 1)
        if step == 1 or step % args.log_every == 0:
            row = {"step": step, "tokens": seen, "seconds": round(time.monotonic() - train_start, 2),
                   "lr": lr, "loss": loss.item(), "indexer_kl": kl.item(), "grad_norm": grad_norm.item(),
                   "max_load_ratio": float(load.worst_ratio) if load.worst_ratio is not None else float("nan"),
                   "dense": int(dense), "val_loss": float("nan")}
            if time.monotonic() - last_eval >= args.eval_every:
                row["val_loss"] = held_out.evaluate(step, seen)
                last_eval = time.monotonic()
                if held_out.stale >= args.patience and not dense and not by_steps \
                        and schedule.decay_now(time.monotonic() - train_start):
                    # the held-out loss stopped improving: back to the best weights, and decay from there
                    decay_at = round(time.monotonic() - train_start, 1)
                    held_out.restore()
            log.append(row)
            print(json.dumps(row), flush=True)
    if use_amp:
        torch.cuda.synchronize()
    train_seconds = time.monotonic() - train_start
    if dense:  # stopped within the warm-up: measure (and ship) the model as inference runs it
        set_dense(model, False, topk, preset.context)
        held_out.reset()
    final_val = held_out.evaluate(step, seen)
    if held_out.best < final_val:  # the held-out loss was lower earlier: ship those weights
        held_out.restore()
    model.eval()
    size = save_model(model, raw, args.data, args.out)
    n_params = sum(p.numel() for p in model.parameters())
    summary = {"preset": args.preset, "device": torch.cuda.get_device_name(device) if use_amp else "cpu",
               "threads": torch.get_num_threads(), "torch": torch.__version__, "compiled": compiled,
               "params": n_params, "file_bytes": size, "steps": step, "tokens_seen": seen,
               "epochs": round(seen / max(1, len(batches.train)), 2), "train_seconds": round(train_seconds, 1),
               "tokens_per_second": round(seen / max(train_seconds, 1e-9)), "stop": stop,
               "final_train_loss": log[-1]["loss"] if log else float("nan"), "val_loss": held_out.best,
               "last_val_loss": final_val, "best_step": held_out.best_step, "best_tokens": held_out.best_tokens,
               "decay_started_s": decay_at,
               "val_tokens": int(windows.shape[0] * (windows.shape[1] - 1)) if len(windows) else 0,
               "context": preset.context, "batch": preset.batch, "index_topk": topk, "dense_frac": args.dense_frac,
               "peak_lr": preset.lr, "dropout": preset.dropout, "weight_decay": preset.weight_decay,
               "bias_rate": args.bias_rate, "corpus_tokens": int(len(tokens))}
    write_report(args.out, args.data, log, summary, sample=not args.no_sample,
                 deadline=start + args.time_budget - 3 if args.max_steps == 0 else None)
    print(json.dumps(summary), flush=True)
    print(f"total wall time {time.monotonic() - start:.1f}s", flush=True)
    return summary


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m train.train_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path(".corpus"), help="folder from train.corpus")
    parser.add_argument("--out", type=Path, required=True, help="model folder to write")
    parser.add_argument("--preset", choices=sorted(_PRESETS), default="h200")
    parser.add_argument("--batch", type=int, default=0, help="sequences per step (0: the preset's)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--time-budget", type=float, default=420.0, help="seconds from process start")
    parser.add_argument("--reserve", type=float, default=30.0, help="seconds kept for evaluation and saving")
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: time only)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the training forward (eager if it fails)")
    parser.add_argument("--dense-frac", type=float, default=0.1, help="part of the run with dense attention")
    parser.add_argument("--kl-weight", type=float, default=1.0)
    parser.add_argument("--bias-rate", type=float, default=1e-3, help="e_score_correction_bias update speed")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--eval-every", type=float, default=10.0, help="seconds between held-out evaluations")
    parser.add_argument("--patience", type=int, default=4, help="evaluations without a new best before the decay")
    parser.add_argument("--min-delta", type=float, default=0.002, help="held-out improvement that counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-sample", action="store_true", help="skip loading the result with Engine")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 4 steps on the CPU")
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.device, args.max_steps, args.log_every, args.eval_every = "smoke", "cpu", 4, 1, 0.0
    return args


def main(argv: list[str] | None = None) -> int:
    train(parse(argv), start=_START)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
