"""The engine host's command line reaches the engine: offloaded experts behind a small cache with the
runahead scheduler serve the same greedy answer, and /hearth/stats reports the expert cache."""

from __future__ import annotations

import httpx
import pytest

from hearth.engine.testing.tiny import write_tiny_model
from tests.engine.test_server_support import start_server

MESSAGES = [{"role": "user", "content": "Tell me about hearths."}]


def _greedy(server) -> str:
    body = {"model": "tiny-v32", "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
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
    from hearth.engine.server.main import build_parser

    assert build_parser().parse_args([]).cuda_graphs is True
    assert build_parser().parse_args(["--cuda-graphs", "false"]).cuda_graphs is False


def test_every_engine_option_has_a_flag_that_reaches_the_config():
    """Each EngineConfig field is a server flag with help text; a value given on the command line
    arrives in the EngineConfig unchanged, and flags left out give EngineConfig's defaults."""
    import dataclasses

    from hearth.engine.api import EngineConfig, engine_options
    from hearth.engine.server.main import build_parser, engine_config

    parser = build_parser()
    flags = {action.dest: action for action in parser._actions}
    assert engine_config(parser.parse_args([])) == EngineConfig()
    for option in engine_options():
        assert option.name in flags and option.flag in flags[option.name].option_strings, option.name
        assert option.text.help and option.text.label, option.name
    args = parser.parse_args(["--max-model-len", "4096", "--gpu-memory-gib", "20.5", "--keep-fp8", "auto",
                              "--mli", "true", "--index-topk-pattern", "FSSF", "--use-kernels", "never",
                              "--faithful", "yes", "--num-cache-blocks", "12"])
    want = dataclasses.replace(EngineConfig(), max_model_len=4096, gpu_memory_gib=20.5, mli=True,
                               index_topk_pattern="FSSF", use_kernels="never", faithful=True, num_cache_blocks=12)
    assert engine_config(args) == want
    assert build_parser().parse_args(["--keep-fp8", "false"]).keep_fp8 is False


def test_a_bad_option_value_is_one_clear_error(capsys):
    from hearth.engine.server.main import main

    assert main(["--max-num-seqs", "0"]) == 1
    assert capsys.readouterr().err.strip() == "error: max_num_seqs must be >= 1"
