"""hearth.engine: config, checkpoint loading, model code, caches, sampling, tokenizers and chat
formats, the scheduler and the ``Engine`` facade. Never imports Qt or ``hearth.app``."""
