"""The engine host's command line reaches the engine: offloaded experts behind a small cache with the
runahead scheduler serve the same greedy answer, and /hearth/stats reports the expert cache."""

from __future__ import annotations

import httpx

from hearth.engine.tiny import write_tiny_model
from tests.engine.test_server_support import start_server

MESSAGES = [{"role": "user", "content": "Tell me about hearths."}]


def _greedy(server) -> str:
    body = {"model": "tiny-v32", "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_offload_and_runahead_options(tmp_path):
    model = write_tiny_model(tmp_path / "tiny-v32", "deepseek_v32", seed=3)
    plain = start_server(model, tmp_path / "a")
    try:
        expected = _greedy(plain)
    finally:
        plain.stop()
    offloaded = start_server(model, tmp_path / "b", extra=("--offload", "always", "--expert-cache-slots", "3",
                                                           "--scheduler", "runahead", "--dtype", "float32"))
    try:
        assert _greedy(offloaded) == expected
        stats = httpx.get(f"{offloaded.base_url}/hearth/stats", timeout=5).json()
        assert stats["expert_cache_misses"] > 0 and 0 <= stats["expert_cache_hit_rate"] <= 1
    finally:
        offloaded.stop()


def test_cuda_graphs_flag():
    from hearth.engine.server import build_parser

    assert build_parser().parse_args([]).cuda_graphs is True
    assert build_parser().parse_args(["--cuda-graphs", "false"]).cuda_graphs is False
