"""The engine host: an OpenAI-compatible HTTP server around one ``Engine`` (``python -m hearth.engine.server``).

The pieces: ``main`` (flags, start-up, uvicorn), ``host.EngineHost`` (the engine thread), ``app.create_app``
(routes and errors), ``protocol`` (the OpenAI wire format), ``security`` (access policy, body limits, load
folders) and ``tool_calls`` (tool calls in generated text). Nothing is imported here, so
``hearth.engine.server.security`` stays cheap for the CLI, which only needs its flags.
"""
