"""The plain path's prefill selection (``Indexer._select``) in blocks of query rows under a small budget
selects exactly what one block does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hearth.engine.kv_cache import SeqSlice
from hearth.engine.models import mla
from hearth.engine.models.mla import Indexer


def _select(q, w, keys, topk):
    n = keys.shape[0]
    seq = SeqSlice(start=0, q_len=q.shape[0], context_len=n, slots=torch.arange(n))
    return Indexer._select(SimpleNamespace(n_heads=q.shape[1], topk=topk), q, w, keys, seq)


@pytest.mark.parametrize("context,q_len,topk,ties", [(203, 77, 50, False), (131, 131, 300, False), (97, 41, 16, True)])
def test_prefill_select_in_row_blocks_matches_one_block(context, q_len, topk, ties, monkeypatch):
    g = torch.Generator().manual_seed(context)
    keys = torch.randn(context, 32, generator=g)
    q = torch.randn(q_len, 4, 32, generator=g)
    if ties:  # half the queries score every key 0: the stable sort's order decides
        q[::2] = 0
    w = torch.rand(q_len, 4, generator=g)
    whole = _select(q, w, keys, topk)
    assert whole.shape == (q_len, min(topk, context))
    if ties:  # earliest positions first
        assert whole[0].tolist() == list(range(min(topk, context - q_len + 1))) + [-1] * (topk - context + q_len - 1)
    pair = context * mla.SELECT_BYTES_PER_PAIR
    calls = []
    real = mla._select_rows
    monkeypatch.setattr(mla, "_select_rows", lambda qf, *a: calls.append(qf.shape[0]) or real(qf, *a))
    for score_rows in (None, 5):  # the default einsum split (one einsum here), then 5 queries per einsum
        if score_rows is not None:
            monkeypatch.setattr(mla, "_SCORE_BUDGET", score_rows * 4 * context)
        for rows, want in ((1, 1), (7, 5 if score_rows else 7), (16, 15 if score_rows else 16), (q_len, q_len)):
            monkeypatch.setattr(mla, "_SELECT_BUDGET", rows * pair + pair // 2)
            calls.clear()
            got = _select(q, w, keys, topk)
            assert calls == [want] * (q_len // want) + ([q_len % want] if q_len % want else []), (rows, calls)
            assert torch.equal(got, whole), (score_rows, rows)
