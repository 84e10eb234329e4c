"""One request's structured answer, as the engine drives it: the mask before each sampled token, the
token after it.

    answer = outputs.answer(params.json_schema, params, prompt_ids)    # StructuredOutputs, per engine
    mask = answer.mask()        # [width] bool on the host, or None while the model reasons (no mask)
    outcome = answer.accept(token)   # GOES_ON, DONE (the JSON is whole, nothing may follow) or REFUSED

Once the JSON is complete but may still go on (a top-level number), EOS and the request's stop tokens
are allowed beside the grammar's tokens; once it is terminal the engine ends the request with "stop"
without sampling again. Special tokens are otherwise never allowed in the answer.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from hearth.engine.api import RequestError, SamplingParams
from hearth.engine.structured.gates import AnswerGate, answer_gate
from hearth.engine.structured.grammar import Grammar
from hearth.engine.structured.masks import TokenIndex
from hearth.engine.structured.schema import SchemaError
from hearth.engine.text.reasoning import PROMPT_TAIL_TOKENS, THINK_START
from hearth.engine.text.tokenizer import Tokenizer

GOES_ON, DONE, REFUSED = "goes_on", "done", "refused"
_GRAMMARS_KEPT = 32


class JsonAnswer:
    """The grammar's state over one request's answer (after its reasoning: ``gates``)."""

    def __init__(self, grammar: Grammar, index: TokenIndex, gate: AnswerGate, finish_ids: Sequence[int]) -> None:
        self.grammar = grammar
        self.index = index
        self.gate = gate
        self.state = grammar.initial
        self._finish = torch.tensor([i for i in finish_ids if 0 <= i < index.width], dtype=torch.long)
        self._first = True

    def mask(self) -> torch.Tensor | None:
        """[width] bool: the tokens allowed next; None while reasoning. Do not write to it."""
        if not self.gate.open:
            return None
        mask = self.index.mask(self.grammar, self.state)
        extra = [self.gate.opener] if self._first and self.gate.opener is not None else []
        complete = self.grammar.is_complete(self.state)
        if extra or (complete and len(self._finish)):
            mask = mask.clone()
            if extra:
                mask[extra] = True
            if complete:
                mask[self._finish] = True
        return mask

    def accept(self, token: int) -> str:
        """Follow the sampled ``token``; GOES_ON, DONE (the JSON is whole and nothing may follow) or
        REFUSED (a token the mask did not allow)."""
        first, self._first = self._first, False
        if not self.gate.open:
            data = self.gate.feed(self.index.token_text(token))
            if data is None:
                return GOES_ON
        elif first and token == self.gate.opener:
            self.gate.take_opener()
            return GOES_ON
        else:
            data = self.index.token_bytes(token)
            if data is None:
                return REFUSED
        state = self.grammar.advance_bytes(self.state, data)
        if state is None:
            return REFUSED
        self.state = state
        return DONE if self.grammar.is_terminal(state) else GOES_ON


class StructuredOutputs:
    """An engine's structured answers: the compiled grammars of recent schemas (shared between requests
    with the same schema, so their masks are cached once) and the tokenizer's index. ``answer`` may be
    called from any thread (as ``Engine.add_request``); the answers are then used on the engine's."""

    def __init__(self, tokenizer: Tokenizer, width: int, model_type: str) -> None:
        self.tokenizer = tokenizer
        self.width = width
        self.model_type = model_type
        self._grammars: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def grammar(self, schema_text: str) -> Grammar:
        """The compiled grammar of a schema (JSON text); RequestError (param response_format) when it
        cannot be enforced."""
        with self._lock:
            grammar = self._grammars.get(schema_text)
            if grammar is None:
                grammar = compile_schema(schema_text)
                self._grammars[schema_text] = grammar
                if len(self._grammars) > _GRAMMARS_KEPT:
                    self._grammars.popitem(last=False)
            self._grammars.move_to_end(schema_text)
            return grammar

    def answer(self, schema_text: str, params: SamplingParams, prompt_ids: Sequence[int]) -> JsonAnswer:
        grammar = self.grammar(schema_text)
        tokenizer = self.tokenizer
        tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:])
        gate = answer_gate(self.model_type, tail, tokenizer.token_to_id(THINK_START))
        finish = (() if params.ignore_eos else tokenizer.eos_token_ids) + params.stop_token_ids
        with self._lock:  # (the first request builds the index: once)
            index = tokenizer.token_index(self.width)
        return JsonAnswer(grammar, index, gate, finish)


def compile_schema(schema_text: str) -> Grammar:
    try:
        schema: Any = json.loads(schema_text)
        return Grammar.from_schema(schema)
    except (SchemaError, ValueError, RecursionError) as err:
        raise RequestError(f"response_format: {err}", "response_format") from None
