"""The model's tokenizer and chat format, loaded from a checkpoint folder.

Reads only data files: ``tokenizer.json`` (through the ``tokenizers`` library; never pickles,
sentencepiece ``.model`` files or remote code), ``tokenizer_config.json``, ``chat_template.jinja`` /
``chat_template.json`` and ``generation_config.json``. Chat prompts come from the checkpoint's Jinja
template, or, for DeepSeek-V3.2 (which ships none), from ``dsv32_encoding``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as _RustTokenizer

from hearth.engine.api import CheckpointError, HearthError, RequestError
from hearth.engine.text import dsv32_encoding
from hearth.engine.text.chat_template import render_chat_template, text_parts
from hearth.engine.text.prompt_tokens import PromptTokens
from hearth.engine.text.reasoning import THINK_END, THINK_START

if TYPE_CHECKING:
    from hearth.engine.structured.masks import TokenIndex
    from hearth.engine.structured.vocabulary import Vocabulary

_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
_BUILTIN_ENCODERS = ("deepseek_v32",)


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; ``{}`` when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not readable JSON: {err}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token given as a string or as an AddedToken dict (``{"content": ...}``)."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
    """``chat_template`` is a string or a list of ``{"name", "template"}``; prefer "default"."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        return named.get("default") or next(iter(named.values()), None)
    return None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def _load_backend(path: Path) -> tuple[_RustTokenizer, str]:
    """The tokenizer and a hash of its file (what its ids depend on: ``Tokenizer.identity``)."""
    if not path.is_file():
        raise CheckpointError(f"tokenizer file not found: {path}")
    try:
        data = path.read_bytes()
        return _RustTokenizer.from_str(data.decode("utf-8")), hashlib.blake2b(data, digest_size=16).hexdigest()
    except OSError as err:
        raise CheckpointError(f"{path} is not readable: {err}") from err
    except Exception as err:  # the Rust library raises a bare Exception for any parse error
        raise CheckpointError(f"{path} is not a valid tokenizer.json: {err}") from err


def _load_template(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    # The standalone .jinja file wins, as in current Hugging Face checkpoints.
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{jinja_file} is not readable text: {err}") from err
    legacy = _read_json(model_dir / "chat_template.json")
    return _pick_template(config.get("chat_template")) or _pick_template(legacy.get("chat_template"))


def _final_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The text a continued last message ends with (its last text part when given as parts: the end
    of the message however a format joins them)."""
    final = messages[-1] if messages else {}
    if final.get("role") != "assistant":
        raise RequestError("continue_final_message needs an assistant message last (the text to continue)",
                           "continue_final_message")
    content = final.get("content")
    if isinstance(content, list):
        parts = text_parts(content)
        content = parts[-1] if parts else None
    if not isinstance(content, str) or not content.strip():
        raise RequestError("continue_final_message needs text in the last (assistant) message to continue",
                           "continue_final_message")
    return content


class Tokenizer:
    """Text <-> token ids for one model, plus its chat prompt format."""

    def __init__(
        self,
        backend: _RustTokenizer,
        config: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        model_type: str | None = None,
        identity: str = "",
    ) -> None:
        config = config or {}
        self._backend = backend
        # A hash of tokenizer.json ("" when unknown): prompts tokenised by another engine are reused
        # only under the same one (``prompt_tokens``).
        self.identity = identity
        self.model_type = model_type
        self.chat_template = chat_template
        self.special_tokens = {name: _token_text(config.get(name)) for name in _SPECIAL_NAMES}
        self._add_bos = config.get("add_bos_token")
        self._add_eos = config.get("add_eos_token")
        self._eos_ids = self._collect_eos(generation_config or {})
        self._token_indexes: dict[int, TokenIndex] = {}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, model_type: str | None = None) -> Tokenizer:
        """Load from a checkpoint folder; ``model_type`` defaults to the one in ``config.json``."""
        model_dir = Path(model_dir)
        backend, identity = _load_backend(model_dir / "tokenizer.json")
        config = _read_json(model_dir / "tokenizer_config.json")
        generation_config = _read_json(model_dir / "generation_config.json")
        if model_type is None:
            model_type = _read_json(model_dir / "config.json").get("model_type")
        template = _load_template(model_dir, config)
        return cls(backend, config, generation_config, template, model_type, identity)

    # ------------------------------------------------------------------ vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added/special tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_index(self, width: int) -> TokenIndex:
        """The structured-output masks' index of this vocabulary for logits ``width`` wide
        (``hearth.engine.structured.masks``), built on first use (a second or so for 150K tokens)."""
        # NOTE: imported here: the index needs torch, which the tokenizer's other users do not load.
        from hearth.engine.structured.masks import TokenIndex

        index = self._token_indexes.get(width)
        if index is None:
            index = self._token_indexes[width] = TokenIndex(self._vocabulary, width)
        return index

    @cached_property
    def _vocabulary(self) -> Vocabulary:
        from hearth.engine.structured.vocabulary import read_vocabulary

        return read_vocabulary(self._backend)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens["bos_token"])

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens["pad_token"])

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: tokenizer_config's eos, then generation_config's."""
        return self._eos_ids

    def _collect_eos(self, generation_config: Mapping[str, Any]) -> tuple[int, ...]:
        ids = [self.token_to_id(self.special_tokens["eos_token"])]
        ids += _as_id_list(generation_config.get("eos_token_id"))
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token text inside ``text`` maps to its special id.

        ``add_special_tokens`` adds BOS/EOS as ``add_bos_token``/``add_eos_token`` say, or, when
        tokenizer_config sets neither, whatever tokenizer.json's post-processor adds.
        """
        explicit = self._add_bos is not None or self._add_eos is not None
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens and not explicit).ids
        if add_special_tokens and explicit:
            bos, eos = self.bos_token_id, self.token_to_id(self.special_tokens["eos_token"])
            if self._add_bos and bos is not None:
                ids = [bos, *ids]
            if self._add_eos and eos is not None:
                ids = [*ids, eos]
        return ids

    def prompt_tokens(self) -> PromptTokens:
        """A cache of chat prompts' ids per conversation: a follow-up turn tokenises only its new
        text (``hearth.engine.text.prompt_tokens``; the ids ``encode(text)`` gives)."""
        return PromptTokens(self._backend, self.fewest_tokens, identity=self.identity)

    @cached_property
    def max_token_chars(self) -> int:
        """Length of the longest vocabulary entry: no token covers more characters of a text. (A
        byte-level entry's length counts bytes, which are never fewer than the characters.)"""
        return max(map(len, self._backend.get_vocab(with_added_tokens=True)), default=1)

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on the tokens ``text`` encodes to, from its length alone: far cheaper than
        tokenising, so a prompt that cannot fit the context is refused before it is tokenised."""
        length = len(text)
        normalizer = self._backend.normalizer
        if normalizer is not None and length > self.max_token_chars:
            # NOTE: a normalizer (NFC...) may merge characters before tokenising; count what it leaves.
            length = len(normalizer.normalize_str(text))
        return -(-length // self.max_token_chars)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``. Skipping special tokens keeps ``<think>`` / ``</think>``: they are
        text the chat layer splits reasoning on, and most released tokenizers mark them not special
        anyway (the tiny DeepSeek-V3.2 / GLM-5 ones, and perhaps some releases, do)."""
        skipped = self._skipped_special_ids if skip_special_tokens else None
        if skipped is not None:
            ids, skip_special_tokens = [i for i in ids if i not in skipped], False
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _skipped_special_ids(self) -> frozenset[int] | None:
        """The special ids that skipping drops when a think marker is special; None when none is
        (the tokenizer's own skipping is then the same)."""
        special = {i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        kept = {self.token_to_id(t) for t in (THINK_START, THINK_END)} & special
        return frozenset(special - kept) if kept else None

    # ------------------------------------------------------------------ chat

    @property
    def has_chat_format(self) -> bool:
        return self.chat_template is not None or self.model_type in _BUILTIN_ENCODERS

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for ``messages``. ``extra`` goes to the template as variables
        (``tools``, ``thinking``, ``enable_thinking``...)."""
        if self.chat_template is not None:
            tokens = {k: v for k, v in self.special_tokens.items() if v is not None}
            return render_chat_template(
                self.chat_template,
                messages,
                add_generation_prompt=add_generation_prompt,
                special_tokens=tokens,
                **extra,
            )
        if self.model_type == "deepseek_v32":
            if not add_generation_prompt and messages and messages[-1].get("role") in ("user", "developer", "tool"):
                raise RequestError("DeepSeek-V3.2's chat format ends every user and tool turn with the assistant's "
                                   "prefix, so add_generation_prompt=false works only after an assistant message",
                                   "add_generation_prompt")
            try:
                return self._encode_dsv32(messages, **extra)
            except (AttributeError, KeyError, TypeError, ValueError) as err:
                # Like a template's failure: the messages or options the request sent do not fit.
                raise RequestError(f"the messages or chat options do not fit DeepSeek-V3.2's chat format "
                                   f"({type(err).__name__}: {err})") from err
        raise HearthError(
            f"this model (model_type {self.model_type!r}) has no chat template; "
            "add a chat_template.jinja to its folder or use plain-text prompts"
        )

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        thinking: bool = False,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """The chat prompt's text. ``thinking`` asks for reasoning before the answer; it is passed
        to templates as both ``thinking`` and ``enable_thinking``. ``continue_final_message``: the
        prompt ends inside the last message, an assistant's, right after its text (no end-of-turn
        token, no generation prompt), so the answer continues that text, as in vLLM and transformers."""
        extra.setdefault("thinking", thinking)
        extra.setdefault("enable_thinking", thinking)
        if not continue_final_message:
            return self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        final = _final_text(messages)
        text = self.apply_chat_template(messages, add_generation_prompt=False, **extra)
        # Some templates strip a message's surrounding whitespace: then the stripped text is what to continue.
        for piece in (final, final.strip()):
            end = text.rfind(piece)
            if end >= 0:
                return text[:end + len(piece)]
        raise RequestError("the chat format does not keep the last message's text as written, so the prompt "
                           "cannot end inside it", "continue_final_message")

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        thinking: bool = False,
        **extra: Any,
    ) -> list[int]:
        """Token ids of the chat prompt (see ``chat_prompt``)."""
        text = self.chat_prompt(messages, add_generation_prompt, thinking, **extra)
        # NOTE: the prompt text already holds BOS, so no special tokens are added here.
        return self.encode(text, add_special_tokens=False)

    @staticmethod
    def _encode_dsv32(
        messages: Sequence[Mapping[str, Any]],
        thinking: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        response_format: Mapping[str, Any] | None = None,
        drop_thinking: bool = True,
        **_ignored: Any,
    ) -> str:
        # The V3.2 format always ends a user turn with the assistant prefix, so there is no
        # separate generation prompt to add (apply_chat_template refuses to leave it out).
        mode: dsv32_encoding.ThinkingMode = "thinking" if thinking else "chat"
        return dsv32_encoding.encode_messages(
            messages, mode, drop_thinking=drop_thinking, tools=tools, response_format=response_format
        )
