"""Structured output: answers held to a JSON schema (``response_format`` json_schema / json_object).

``schema`` compiles a JSON Schema into nodes (refusing what it cannot enforce; ``regex`` compiles string
``pattern``s to DFAs), ``grammar`` is the byte-level pushdown automaton over them (``patterned`` reads a
patterned string's body), ``vocabulary`` reads each token's bytes from the tokenizer,
``masks`` turns an automaton state into the tokens allowed next, and ``matcher`` follows one request's
answer (after its reasoning, ``gates``) for the engine, which applies the masks before sampling.
"""

from hearth.engine.structured.grammar import Grammar
from hearth.engine.structured.schema import SchemaError

__all__ = ["Grammar", "SchemaError"]
