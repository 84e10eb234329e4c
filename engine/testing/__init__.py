"""Test fixtures that ship with the engine: tiny random checkpoints and their tokenizer
(``python -m hearth.engine.testing.tiny``) and the conformance harness behind ``hearth.engine.load_model``."""
