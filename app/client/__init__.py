"""Talking to an engine: ``ChatClient`` for any OpenAI-compatible server (Hearth's engine host,
vLLM, SGLang, LM Studio) and ``EngineProcess`` for Hearth's local engine host subprocess. Qt-free;
the GUI wraps these in its own worker objects."""

from hearth.app.client.local_engine import EngineProcess, EngineStartError
from hearth.app.client.openai_client import ChatChunk, ChatClient, ClientError, EngineDiedError

__all__ = ["ChatChunk", "ChatClient", "ClientError", "EngineDiedError", "EngineProcess", "EngineStartError"]
