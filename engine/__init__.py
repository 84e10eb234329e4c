"""hearth.engine: config, checkpoint loading, model code, caches, sampling, tokenizers and chat
formats, the scheduler and the ``Engine`` facade. Never imports Qt or ``hearth.app``."""

from hearth.engine.api import (
    CheckpointError,
    EngineConfig,
    EngineStats,
    Finished,
    HearthError,
    RequestError,
    RequestStats,
    SamplingParams,
    TokenDelta,
    UnsupportedModelError,
)


def __getattr__(name: str):
    # Heavy modules (torch, the model code) load on first use so `hearth --help` stays fast.
    if name == "Engine":
        from hearth.engine.engine import Engine

        return Engine
    if name == "load_model":
        from hearth.engine.testing.conformance import load_model

        return load_model
    raise AttributeError(name)


__all__ = [
    "CheckpointError", "Engine", "EngineConfig", "EngineStats", "Finished", "HearthError", "RequestError",
    "RequestStats", "SamplingParams", "TokenDelta", "UnsupportedModelError", "load_model",
]
