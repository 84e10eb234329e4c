"""The demo-model pipeline (train/) and the bundled model (resources/demo_model, app/demo_model.py).

Corpus cleaning and the tokenizer on a small hand-written reST set; one training step of the smoke
preset (the batched forward itself is checked against the engine's path in test_train_batched.py);
the learning-rate schedule; a ``--smoke`` training run that must save a folder the engine loads,
with the tensor names hearth.engine.testing.tiny writes; and the shipped model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hearth.app.demo_model import REQUIRED_FILES, bundled_demo_path
from hearth.engine import Engine, EngineConfig, Finished, SamplingParams, TokenDelta
from hearth.engine.config import ModelConfig
from hearth.engine.testing.tiny import make_weights
from train import corpus
from train.train_demo import _PRESETS, Batches, Schedule, demo_config, init_weights, make_step, parse, set_dense, train

RST = """\
.. _tut-lists:

*****
Lists
*****

Python knows a number of *compound* data types, used to group together other values.  The most
versatile is the :class:`list`, which can be written as a list of comma-separated values
(items) between square brackets, see :ref:`the tutorial <tut-intro>`::

   >>> squares = [1, 4, 9, 16, 25]
   >>> squares
   [1, 4, 9, 16, 25]

Like strings, lists can be indexed and sliced with ``squares[0]``.

.. index:: single: slicing

.. note::

   All slice operations return a new list containing the requested elements.

Tuples
======

A tuple consists of a number of values separated by commas, for instance :func:`~os.path.join`.
"""


def _text(sections: list[tuple[str, str]]) -> str:
    return "\n".join(f"{t}\n{b}" for t, b in sections)


def test_rst_is_reduced_to_prose() -> None:
    sections = corpus.rst_to_sections(RST)
    assert [t for t, _ in sections] == ["Lists", "Tuples"]
    text = _text(sections)
    assert "The most versatile is the list, which can be written" in text  # role -> text, line joined
    assert "square brackets, see the tutorial:" in text  # "::" -> ":", labelled ref -> label
    assert "squares[0]" in text and "``" not in text
    assert "All slice operations return a new list" in text  # note body kept
    assert ">>>" not in text and "[1, 4, 9" not in text and "single: slicing" not in text
    assert "for instance join." in text  # ~ keeps the last component


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    docs = tmp_path_factory.mktemp("docs")
    for i in range(12):
        (docs / f"page{i}.rst.txt").write_text(RST.replace("Lists", f"Lists {i}"), encoding="utf-8")
    out = tmp_path_factory.mktemp("corpus")
    summary = corpus.build(docs, out, vocab_size=320)
    assert summary["sections"] == 24 and summary["tokens"] > 1000
    return out


def test_tokenizer_has_the_deepseek_v32_specials(data_dir: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 320
    assert [tok.token_to_id(t) for t in corpus.SPECIALS] == [0, 1, 2, 3, 4, 5]
    config = json.loads((data_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "chat_template" not in config and config["bos_token"] == corpus.BOS
    assert not (data_dir / "chat_template.jinja").exists()


def test_a_training_step_on_the_smoke_preset(data_dir: Path) -> None:
    import numpy as np

    from hearth.engine.models.deepseek import DeepseekForCausalLM

    preset = _PRESETS["smoke"]
    model = DeepseekForCausalLM(ModelConfig.from_dict(demo_config(preset, 320)))
    init_weights(model, seed=0)
    batches = Batches(np.load(data_dir / "tokens.npy"), preset.context, preset.batch, 0, torch.device("cpu"))
    rows = batches.sample()
    assert rows.shape == (preset.batch, preset.context + 1)
    windows = batches.val_windows()  # consecutive: each window's last token starts the next
    assert torch.equal(windows[0], batches.val[:preset.context + 1]) and torch.equal(windows[1:, 0], windows[:-1, -1])
    set_dense(model, False, preset.model["index_topk"], preset.context)
    assert model.config.index_topk < preset.context  # DSA is active at this context
    loss, kl, counts = make_step(model, preset.kl_seqs, preset.dropout)(rows)
    (loss + kl).backward()
    attn = model.layers[0].self_attn
    assert attn.kv_a_proj_with_mqa.weight.grad.abs().sum() > 0
    assert model.layers[1].mlp.gate.weight.grad.abs().sum() > 0  # the router learns via its weights
    assert attn.indexer.wk.weight.grad.abs().sum() > 0  # from the KL objective only (tests/test_train_batched.py)
    assert float(counts[1].sum()) == preset.batch * preset.context * model.config.num_experts_per_tok


def test_the_schedule_warms_up_holds_and_decays_early_on_a_plateau() -> None:
    schedule = Schedule(1.0, 100.0, warmup=0.1, decay_frac=0.25, floor=0.0)
    assert schedule.lr(5) == pytest.approx(0.5) and schedule.lr(50) == 1.0 and schedule.lr(100) == pytest.approx(0)
    assert not schedule.decaying and schedule.lr(75) == 1.0
    assert schedule.decay_now(30.0)  # plateau at 30: decay for a third of the run so far
    assert schedule.decaying and schedule.end == pytest.approx(40.0) and not schedule.decay_now(35.0)
    assert schedule.lr(35) == pytest.approx(0.5) and schedule.done(40) and not schedule.done(39)


@pytest.mark.slow
def test_smoke_training_saves_a_model_the_engine_loads(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    summary = train(parse(["--data", str(data_dir), "--out", str(out), "--smoke"]))
    assert summary["steps"] == 4 and summary["tokens_seen"] == 4 * 2 * 64
    assert summary["val_loss"] < 7 and summary["best_step"] >= 1  # log(320) = 5.8 at the start
    log = (out / "loss_log.csv").read_text(encoding="utf-8").splitlines()
    assert log[0].startswith("step,tokens") and log[0].endswith(",val_loss") and len(log) == 5
    assert (out / "loss_curve.svg").read_text(encoding="utf-8").startswith("<svg")
    raw = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert raw["model_type"] == "deepseek_v32" and raw["topk_method"] == "noaux_tc"
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == set(make_weights(ModelConfig.from_dict(raw), seed=0))  # hearth.engine.testing.tiny's names
    samples = (out / "samples.txt").read_text(encoding="utf-8")
    assert "sampling failed" not in samples and samples.startswith("The")


def _generate(path: Path, **request: object) -> str:
    engine = Engine.load(str(path), EngineConfig(device="cpu"))
    text = ""
    for event in engine.generate(**request, sampling=SamplingParams(temperature=0, max_tokens=24)):
        if isinstance(event, TokenDelta):
            text += event.text
        assert not isinstance(event, Finished) or event.error is None
    return text


def test_the_bundled_demo_model_is_complete_and_writes_words() -> None:
    path = bundled_demo_path()
    assert path is not None, "resources/demo_model is missing or incomplete"
    assert all((path / name).is_file() for name in REQUIRED_FILES)
    assert sum(f.stat().st_size for f in path.iterdir()) < 30e6
    config = ModelConfig.from_dict(json.loads((path / "config.json").read_text(encoding="utf-8")))
    assert config.model_type == "deepseek_v32" and config.has_indexer and config.index_topk < 512
    assert config.is_moe_layer(config.num_hidden_layers - 1) and not config.is_moe_layer(0)
    assert (path / "MODEL_CARD.md").is_file()
    text = _generate(path, prompt="The")
    words = [w.strip(".,;:()") for w in text.split()]
    common = {"the", "a", "of", "to", "is", "and", "in", "be", "for", "an", "that", "this", "it", "are", "with"}
    assert len(words) >= 5 and any(w.lower() in common for w in words), text
    assert _generate(path, messages=[{"role": "user", "content": "What is a list?"}]).strip()
