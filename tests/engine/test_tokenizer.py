"""Tokenizer loading, round trips, special tokens, errors, and the tiny trained tokenizers;
chat prompts are compared with transformers (a test-only reference)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hearth.engine.api import CheckpointError, HearthError
from hearth.engine.testing.tiny_tokenizer import CORPUS, write_tiny_tokenizer
from hearth.engine.text.tokenizer import Tokenizer

FAMILIES = ("deepseek_v32", "deepseek_v3", "deepseek_v2", "glm_moe_dsa")
TEXTS = (
    "Hello, world!",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\ttabbed",
    "café naïve résumé Ångström",
    "日本語のテキストと中文字符",
    "emoji 😀👍🏽 and flags 🇫🇷, zero-width\u200djoiner",
    "",
)
CONVERSATIONS = (
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And café × 3? 😀"},
    ],
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {family: _write(root / family, family, 320) for family in FAMILIES}


def _write(path: Path, family: str, vocab_size: int) -> Path:
    write_tiny_tokenizer(path, family, vocab_size)
    return path


def test_corpus_is_long_enough():
    assert len(CORPUS) >= 3000


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tiny: dict[str, Path], family: str, text: str):
    tok = Tokenizer.from_pretrained(tiny[family], family)
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("vocab_size", [320, 777, 5000])
def test_vocab_size_is_exact(tmp_path: Path, family: str, vocab_size: int):
    _write(tmp_path, family, vocab_size)
    tok = Tokenizer.from_pretrained(tmp_path, family)
    assert tok.vocab_size == vocab_size
    assert all(tok.id_to_token(i) is not None for i in range(vocab_size))


@pytest.mark.parametrize(("family", "marker", "visible"), [("glm4_moe", "<think>", True),
                                                        ("gpt_oss", "<|channel|>", False)])
def test_synthetic_vocab_is_exact_and_keeps_the_family_markers(tmp_path: Path, family: str, marker: str,
                                                               visible: bool):
    """The benchmarks' constructed vocabulary (release sizes): exactly vocab_size ids, word ids decode to
    letters, and the family's markers stay single tokens (GLM-4.5's reasoning markers as decoded text)."""
    write_tiny_tokenizer(tmp_path, family, 3000, synthetic=True)
    tok = Tokenizer.from_pretrained(tmp_path, family)
    assert tok.vocab_size == 3000
    assert tok.encode(marker) == [tok.token_to_id(marker)]
    assert tok.decode([tok.token_to_id(marker)], skip_special_tokens=True) == (marker if visible else "")
    assert tok.decode(tok.encode("hearth")) == "hearth"


def test_vocab_too_small_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="vocab_size"):
        write_tiny_tokenizer(tmp_path, "deepseek_v32", 200)
    with pytest.raises(ValueError, match="model_type"):
        write_tiny_tokenizer(tmp_path, "llama", 512)


def test_deepseek_v32_special_ids(tmp_path: Path):
    ids = write_tiny_tokenizer(tmp_path, "deepseek_v32", 320)
    assert ids == {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}
    assert not (tmp_path / "chat_template.jinja").exists()
    tok = Tokenizer.from_pretrained(tmp_path, "deepseek_v32")
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (0, (1,), 1)
    for special in ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"):
        assert tok.encode(special) == [tok.token_to_id(special)]


def test_glm_special_ids(tiny: dict[str, Path]):
    ids = write_tiny_tokenizer(tiny["glm_moe_dsa"], "glm_moe_dsa", 320)
    tok = Tokenizer.from_pretrained(tiny["glm_moe_dsa"], "glm_moe_dsa")
    eos_tokens = [tok.id_to_token(i) for i in ids["eos_token_id"]]
    assert eos_tokens == ["<|endoftext|>", "<|user|>", "<|observation|>"]
    assert ids["bos_token_id"] is None and tok.bos_token_id is None
    assert tok.encode("[gMASK]<sop>") == [tok.token_to_id("[gMASK]"), tok.token_to_id("<sop>")]


SCRIPT = (
    "import sys; from pathlib import Path; from hearth.engine.testing.tiny_tokenizer import write_tiny_tokenizer; "
    "write_tiny_tokenizer(Path(sys.argv[1]), 'glm_moe_dsa', 600)"
)


def test_output_is_deterministic_across_processes(tmp_path: Path):
    for name, seed in (("a", "1"), ("b", "2")):
        env = {"PYTHONHASHSEED": seed, "PATH": ""}
        subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / name)], check=True, env=env)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes()


def test_generation_config_eos_is_merged(tmp_path: Path):
    _write(tmp_path, "glm_moe_dsa", 320)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 4, 6]}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa"}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.model_type == "glm_moe_dsa"
    assert tok.eos_token_ids == (0, 4, 6)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == (0, 5)


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(changes)
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def test_added_token_dicts_and_add_bos(tmp_path: Path):
    _write(tmp_path, "deepseek_v3", 320)
    bos = {"content": "<｜begin▁of▁sentence｜>", "special": True, "__type": "AddedToken"}
    _edit_config(tmp_path, bos_token=bos, add_bos_token=True)
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.bos_token_id == 0
    assert tok.encode("hi", add_special_tokens=True) == [0, *tok.encode("hi")]
    assert tok.encode("hi")[0] != 0


def test_named_template_list(tmp_path: Path):
    _write(tmp_path, "deepseek_v32", 320)
    templates = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"},
    ]
    _edit_config(tmp_path, chat_template=templates)
    tok = Tokenizer.from_pretrained(tmp_path, "deepseek_v32")
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "[a]"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert Tokenizer.from_pretrained(tmp_path, "deepseek_v32").apply_chat_template([]) == "J0"


def test_missing_tokenizer_json(tmp_path: Path):
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("payload", [b"{not json", b'{"model": {"type": "BPE"}}', b"\xff\xfe\x00"])
def test_corrupt_tokenizer_json(tmp_path: Path, payload: bytes):
    (tmp_path / "tokenizer.json").write_bytes(payload)
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_corrupt_tokenizer_config(tmp_path: Path):
    _write(tmp_path, "deepseek_v3", 320)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_no_chat_format(tmp_path: Path):
    _write(tmp_path, "deepseek_v3", 320)
    (tmp_path / "chat_template.jinja").unlink()
    tok = Tokenizer.from_pretrained(tmp_path, "deepseek_v3")
    assert not tok.has_chat_format
    assert tok.decode(tok.encode("still works")) == "still works"
    with pytest.raises(HearthError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(HearthError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# --------------------------------------------------------------------------- vs transformers


def _hf_tokenizer(path: Path):
    transformers = pytest.importorskip("transformers")
    config = json.loads((path / "tokenizer_config.json").read_text())
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"),
        bos_token=config["bos_token"],
        eos_token=config["eos_token"],
        pad_token=config["pad_token"],
        chat_template=(path / "chat_template.jinja").read_text(),
    )


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "glm_moe_dsa"])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tiny: dict[str, Path], family: str, conversation: list, add_generation_prompt: bool
):
    ours = Tokenizer.from_pretrained(tiny[family], family)
    ref = _hf_tokenizer(tiny[family])
    for extra in ({}, {"enable_thinking": False}):
        kwargs = dict(add_generation_prompt=add_generation_prompt, **extra)
        text = ours.apply_chat_template(conversation, **kwargs)
        assert text == ref.apply_chat_template(conversation, tokenize=False, **kwargs)
        ref_ids = ref.apply_chat_template(conversation, tokenize=True, return_dict=False, **kwargs)
        assert ours.encode(text) == list(ref_ids)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm_moe_dsa"])
def test_plain_encoding_matches_transformers(tiny: dict[str, Path], family: str):
    ours = Tokenizer.from_pretrained(tiny[family], family)
    ref = _hf_tokenizer(tiny[family])
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_folder_loads_in_transformers(tiny: dict[str, Path], family: str, monkeypatch: pytest.MonkeyPatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ref = transformers.AutoTokenizer.from_pretrained(str(tiny[family]))
    ours = Tokenizer.from_pretrained(tiny[family], family)
    assert (ref.bos_token_id, ref.pad_token_id) == (ours.bos_token_id, ours.pad_token_id)
    assert ref.eos_token_id == ours.eos_token_ids[0]
    assert len(ref) == ours.vocab_size
    for text in TEXTS:
        assert ref.encode(text, add_special_tokens=True) == ours.encode(text, add_special_tokens=True)
    if ours.chat_template is not None:
        for conversation in CONVERSATIONS:
            expected = ref.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
            assert ours.apply_chat_template(conversation) == expected
