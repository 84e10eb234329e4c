"""What a demo-model training run leaves beside the weights: ``loss_log.csv``, ``loss_curve.svg``
(drawn by hand: no plotting library is needed), ``samples.txt`` (the saved folder loaded back with
``hearth.engine.Engine``) and ``MODEL_CARD.md``.
"""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path
from typing import Any

SAMPLE_PROMPTS = ("The", "A list is", "To open a file,")
CHAT_PROMPTS = ("How do I read a file?",)  # sent as chat messages (DeepSeek-V3.2 prompt format)
_W, _H, _PAD = 640, 360, 48


def write_loss_svg(log: list[dict[str, float]], path: Path) -> None:
    """Training and held-out loss against tokens seen (and the indexer KL, dashed), as a small SVG."""
    points = [(r["tokens"], r["loss"]) for r in log if math.isfinite(r["loss"])]
    kl = [(r["tokens"], r["indexer_kl"]) for r in log if math.isfinite(r["indexer_kl"])]
    val = [(r["tokens"], r["val_loss"]) for r in log if math.isfinite(r.get("val_loss", math.nan))]
    if not points:
        points = [(0.0, 0.0)]
    x_max = max(p[0] for p in points) or 1.0
    y_max = max(max(p[1] for p in points), max((k[1] for k in kl), default=0.0)) * 1.05 or 1.0

    def xy(x: float, y: float) -> str:
        return f"{_PAD + x / x_max * (_W - 2 * _PAD):.1f},{_H - _PAD - y / y_max * (_H - 2 * _PAD):.1f}"

    ticks = []
    for i in range(5):
        y = y_max * i / 4
        ticks.append(f'<text x="{_PAD - 6}" y="{xy(0, y).split(",")[1]}" text-anchor="end" font-size="11">'
                     f"{y:.1f}</text>")
        x = x_max * i / 4
        ticks.append(f'<text x="{xy(x, 0).split(",")[0]}" y="{_H - _PAD + 16}" text-anchor="middle" '
                     f'font-size="11">{x / 1e6:.1f}M</text>')
    svg = f"""<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}">
<rect width="100%" height="100%" fill="white"/>
<polyline fill="none" stroke="#888" points="{xy(0, y_max)} {xy(0, 0)} {xy(x_max, 0)}"/>
{''.join(ticks)}
<polyline fill="none" stroke="#c0392b" stroke-width="1.5" points="{' '.join(xy(*p) for p in points)}"/>
<polyline fill="none" stroke="#2c7fb8" stroke-dasharray="4 3" points="{' '.join(xy(*p) for p in kl)}"/>
<polyline fill="none" stroke="#27ae60" stroke-width="1.5" points="{' '.join(xy(*p) for p in val)}"/>
<text x="{_W / 2}" y="20" text-anchor="middle" font-size="13">Demo model: training loss (red), held-out
 loss (green) and indexer KL (blue, dashed) vs tokens</text>
<text x="{_W / 2}" y="{_H - 10}" text-anchor="middle" font-size="11">tokens seen</text>
</svg>
"""
    path.write_text(svg, encoding="utf-8")


def write_loss_csv(log: list[dict[str, float]], path: Path) -> None:
    if not log:
        path.write_text("", encoding="utf-8")
        return
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(log[0]))
        writer.writeheader()
        writer.writerows(log)


def sample_texts(model_dir: Path, max_tokens: int = 60, deadline: float | None = None) -> list[tuple[str, str]]:
    """Load the saved folder with Hearth's engine and continue a few prompts (seeded sampling).
    Stops early (keeping what it has) once ``time.monotonic()`` passes ``deadline``."""
    from hearth.engine import Engine, EngineConfig, SamplingParams
    from hearth.engine.api import Finished, TokenDelta

    engine = Engine.load(str(model_dir), EngineConfig(device="cpu"))
    out = []
    requests = [(p, {"prompt": p}) for p in SAMPLE_PROMPTS]
    requests += [(f"[chat] {p} ->", {"messages": [{"role": "user", "content": p}]}) for p in CHAT_PROMPTS]
    for label, request in requests:
        text = ""
        sampling = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=max_tokens, seed=0)
        for event in engine.generate(**request, sampling=sampling):
            if isinstance(event, TokenDelta):
                text += event.text
            if isinstance(event, Finished) or (deadline is not None and time.monotonic() > deadline):
                break
        out.append((label, text))
        if deadline is not None and time.monotonic() > deadline:
            break
    return out


def _source(data: Path) -> dict[str, Any]:
    path = data / "source.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _hardware(s: dict[str, Any]) -> str:
    if s["device"] == "cpu":
        return f"CPU ({s['threads']} thread(s))"
    return f"{s['device']} (torch {s.get('torch', '?')}{', torch.compile' if s.get('compiled') else ''})"


def model_card(summary: dict[str, Any], source: dict[str, Any], samples: list[tuple[str, str]]) -> str:
    s = summary
    sample_md = "\n\n".join(f"```text\n{p}{t.rstrip()}\n```" for p, t in samples) or "(not sampled)"
    status = ("**Trained on the CPU as a stand-in**: the GPU run (`scripts/train_demo_gpu.sh`, one H200, the "
              "`h200` preset) will replace it.\n" if s["device"] == "cpu" else "")
    stop = {"decay finished": "held-out loss plateaued, so the decay started early",
            "budget": "time budget", "max steps": "step limit"}.get(s.get("stop", ""), s.get("stop", "?"))
    return f"""# Hearth demo model

A tiny DeepSeek-V3.2-architecture model (`model_type: deepseek_v32`: MLA with q-LoRA, YaRN rope, the DSA
lightning indexer with `index_topk` {s['index_topk']} < training context {s['context']}, a dense first layer then
MoE layers with sigmoid `noaux_tc` routing and `e_score_correction_bias`) trained from scratch by
`train/train_demo.py` with Hearth's own model code (`DeepseekForCausalLM`'s modules, run over whole
batches by `train/batched.py`). It exists so that Hearth has something to run on first start: it
writes English-looking text about Python and is useless for anything else.

{status}
## Training

| | |
|---|---|
| hardware | {_hardware(s)} |
| parameters | {s['params']:,} ({s['file_bytes'] / 1e6:.1f} MB in bf16) |
| steps | {s['steps']} x {s['batch']} sequences x {s['context']} tokens |
| tokens seen | {s['tokens_seen']:,} ({s['tokens_seen'] / max(1, s['corpus_tokens']):.1f} passes over the corpus) |
| training time | {s['train_seconds']} s ({s['tokens_per_second']:,} tokens/s); stopped by: {stop} |
| final train loss | {s['final_train_loss']:.3f} (with dropout) |
| held-out loss | {s['val_loss']:.3f} at step {s.get('best_step', s['steps'])}, the weights shipped \
({s.get('val_tokens', 0):,} held-out tokens: the last 1% of the token stream, in {s['context']}-token windows) |
| schedule | AdamW (0.9, 0.95), peak lr {s['peak_lr']}: warm-up, constant, cosine decay (started early when the \
held-out loss stops improving); the weights with the best held-out loss are kept |
| regularisation | residual dropout {s.get('dropout', 0.0)}, weight decay {s.get('weight_decay', 0.1)} on matrices |
| DSA | dense attention for the first {s['dense_frac']:.0%} of the run, then sparse top-{s['index_topk']} |
| indexer | trained by KL(main attention summed over heads, indexer) on detached inputs |
| balancing | auxiliary-loss-free: `e_score_correction_bias` += {s['bias_rate']} * sign(mean load - load) per step |

The curve is in `loss_curve.svg`; `loss_log.csv` has every logged step.

Reproduce (the corpus first, then the run on one GPU; see train/README.md):

```bash
bash scripts/fetch_corpus.sh
OUT=/tmp/out bash scripts/train_demo_gpu.sh      # -> /tmp/out/demo_model/
```

## What it can and cannot do

- It continues a prompt with English sentences in the style of the Python documentation (module,
  class and function vocabulary, "you can ...", "returns ..."): enough to see that tokenizer, MLA,
  sparse attention, MoE routing, sampling and streaming work end to end, offline.
- It cannot answer questions, follow instructions, write code (code blocks were removed from its
  data), hold a conversation or state facts reliably: its sentences are fluent-looking and often
  wrong or circular. It was never trained on chat turns, so the chat format only changes the prompt.
- It has {s['params']:,} parameters and learned from a {s['corpus_tokens']:,}-token corpus; use a real model
  from the Models tab for anything beyond a smoke test.

## Data

{source.get('description', 'Python documentation (reStructuredText sources), reduced to prose by train/corpus.py.')}

- package: `{source.get('package', '?')}` version `{source.get('version', '?')}` (Debian)
- license: {source.get('license', '?')}
- extraction: `{source.get('command', 'bash scripts/fetch_corpus.sh')}`
- corpus: {s['corpus_tokens']:,} tokens with a 4096-entry byte-level BPE trained on the same text

## Samples

Seeded sampling (temperature 0.7, top-p 0.9, 60 tokens) by `hearth.engine.Engine` from the saved folder
(`[chat]`: the prompt sent as a user message in the DeepSeek-V3.2 chat format):

{sample_md}
"""


def write_report(out: Path, data: Path, log: list[dict[str, float]], summary: dict[str, Any],
                 sample: bool = True, deadline: float | None = None) -> None:
    write_loss_csv(log, out / "loss_log.csv")
    write_loss_svg(log, out / "loss_curve.svg")
    samples: list[tuple[str, str]] = []
    if sample:
        try:
            samples = sample_texts(out, deadline=deadline)
        except Exception as exc:  # the weights are saved; a failed sample must not lose the run
            samples = [("(sampling failed)", f" {type(exc).__name__}: {exc}")]
    (out / "samples.txt").write_text("\n\n".join(p + t for p, t in samples), encoding="utf-8")
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    (out / "MODEL_CARD.md").write_text(model_card(summary, _source(data), samples), encoding="utf-8")
