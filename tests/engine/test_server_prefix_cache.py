"""The chat cache through the engine host: requests name their conversation (``"hearth":
{"conversation_id": ...}``), /hearth/stats counts cached chats and bytes, ``POST /hearth/cache/drop``
deletes a chat's files, and a restarted host serves the next turn from disk (real server processes
on 127.0.0.1, tiny DeepSeek-V3.2)."""

from __future__ import annotations

import stat

import httpx
import pytest

from hearth.engine.testing.tiny import write_tiny_model
from tests.engine.test_server_support import ServerProcess, start_server

# 7 pages of 16 tokens: another chat's 80-token prompt evicts the first chat's pages (to disk:
# no page fits in the tiny RAM budget).
FLAGS = ("--block-size", "16", "--num-cache-blocks", "7", "--max-num-seqs", "1", "--prefix-cache-host-gib", "1e-9")
LONG_PROMPT = [(11 * j) % 400 + 20 for j in range(80)]
QUESTION = "Tell me everything about hearths, chimneys, kindling and the warm evenings by the fire."


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("server_cache") / "tiny-v32", "deepseek_v32", seed=3)


def _start(model_path, cache_dir, run_dir) -> ServerProcess:
    return start_server(model_path, run_dir, max_model_len=112, extra=(*FLAGS, "--prefix-cache-dir", str(cache_dir)))


def _chat(server: ServerProcess, messages: list[dict], conversation: str | None) -> dict:
    body = {"model": "tiny-v32", "messages": messages, "max_tokens": 8, "temperature": 0}
    if conversation is not None:
        body["hearth"] = {"conversation_id": conversation}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _evict(server: ServerProcess) -> None:
    body = {"model": "tiny-v32", "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0,
            "hearth": {"conversation_id": "other-chat"}}
    assert httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).status_code == 200


def _stats(server: ServerProcess) -> dict:
    return httpx.get(f"{server.base_url}/hearth/stats", timeout=5).json()


def test_chat_cache_on_disk_survives_a_restart_and_drop_deletes_it(model_path, tmp_path):
    cache_dir = tmp_path / "cache"
    server = _start(model_path, cache_dir, tmp_path / "run1")
    try:
        first = [{"role": "user", "content": QUESTION}]
        answer = _chat(server, first, "chat-1")["choices"][0]["message"]["content"]
        _evict(server)
        stats = _stats(server)
        assert stats["prefix_cache_conversations"] == 2 and stats["prefix_cache_disk_bytes"] > 0
        assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700
        second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
        before = _chat(server, second, "chat-1")
        assert before["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16  # restored from disk
        assert _stats(server)["prefix_cache_hits_tokens"] >= 16
    finally:
        server.stop()  # SIGTERM: the host saves the GPU's cached pages
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in cache_dir.iterdir())

    server = _start(model_path, cache_dir, tmp_path / "run2")
    try:
        assert _stats(server)["prefix_cache_conversations"] == 2
        after = _chat(server, second, "chat-1")

        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16  # from the files of the last run
        assert after["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]

        files = len(list(cache_dir.iterdir()))
        response = httpx.post(f"{server.base_url}/hearth/cache/drop", json={"conversation_id": "chat-1"}, timeout=30)
        assert response.status_code == 200 and response.json()["dropped_pages"] >= 1
        assert len(list(cache_dir.iterdir())) < files
        assert _stats(server)["prefix_cache_conversations"] == 1
        bad = httpx.post(f"{server.base_url}/hearth/cache/drop", json={"conversation_id": "../x"}, timeout=30)
        assert bad.status_code == 400
        bad = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30,
                         json={"model": "tiny-v32", "messages": first, "hearth": {"conversation_id": "a b"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "hearth.conversation_id"
    finally:
        server.stop()
