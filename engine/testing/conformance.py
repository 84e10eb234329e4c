"""Conformance API: ``load_model(path, device=..., dtype=...)`` returns an object whose
``.logits(token_ids)`` runs the engine's own prefill path (paged cache, block table, optional
chunking) and returns ``[T, vocab]`` fp32 logits on the CPU. Tests compare it with reference implementations.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hearth.engine.api import EngineConfig, RequestError
from hearth.engine.block_manager import BlockManager
from hearth.engine.runner import ModelRunner, StepInput


class ConformanceModel:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.config = runner.model_config
        self._calls = 0

    def logits(self, token_ids: Sequence[int], chunk_size: int | None = None) -> torch.Tensor:
        """Prefill ``token_ids`` from position 0 (in chunks of ``chunk_size`` if given) into fresh
        cache pages; returns (T, vocab) fp32 logits of every position."""
        ids = [int(t) for t in token_ids]
        if not ids or len(ids) > self.runner.max_model_len:
            raise RequestError(f"need 1..{self.runner.max_model_len} tokens, got {len(ids)}")
        blocks = BlockManager(self.runner.num_blocks, self.runner.block_size, enable_prefix_caching=False)
        seq_id = f"conformance-{self._calls}"
        self._calls += 1
        blocks.allocate(seq_id, ids)
        table = blocks.block_table(seq_id)
        step = chunk_size or len(ids)
        out = [
            self.runner.run([StepInput(table, start, ids[start:start + step], seq_id)], all_logits=True)
            for start in range(0, len(ids), step)
        ]
        blocks.free(seq_id)
        self.runner.forget(seq_id)
        return torch.cat(out).cpu()


def load_model(path: str, device: str = "auto", dtype: str = "auto", **engine_options) -> ConformanceModel:
    """Load a checkpoint folder for conformance checks. ``engine_options`` go to ``EngineConfig``
    (e.g. ``faithful=True``, ``keep_fp8=True``)."""
    config = EngineConfig(device=device, dtype=dtype, max_num_seqs=1, **engine_options)
    return ConformanceModel(ModelRunner.load(path, config))
