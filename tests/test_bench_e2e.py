"""bench/bench_e2e.py's chat-cache rows for a tiered chat (``--configs chat-cache-tiers``): the servers'
flags, the row taken from the ``tier_cache_*`` counters, and the whole run on the CPU (tiny DeepSeek-V3.2,
real server processes), whose restarted server must adopt the chat's parked tiers from their file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import bench_e2e  # noqa: E402


def test_the_tiered_chat_servers_add_the_tier_flags_and_keep_the_cache_folder():
    plain = bench_e2e.chat_cache_flags(32, "/tmp/store", ["--device", "cpu"])
    tiered = bench_e2e.chat_cache_flags(32, "/tmp/store", ["--device", "cpu"], tiers=True)
    assert plain == ["--offload", "never", "--block-size", "64", "--num-cache-blocks", "32",
                     "--prefix-cache-offload", "true", "--prefix-cache-dir", "/tmp/store", "--device", "cpu"]
    assert tiered == [*plain[:2], *bench_e2e.TIER_FLAGS, *plain[2:]]
    assert bench_e2e.config_flags("tiers64k", 0) == ["--offload", "never", *bench_e2e.TIER_FLAGS]


def _stats(hits: float, restored: float, disk_bytes: float, rejected: float = 0.0, chats: float = 0.0) -> dict:
    return {"tier_cache_hits_tokens": hits, "tier_cache_restored_chats": restored,
            "tier_cache_disk_bytes": disk_bytes, "tier_cache_files_rejected": rejected,
            "tier_cache_disk_chats": chats, "prefix_cache_hits_tokens": 0.0}


@pytest.mark.parametrize(("after", "source"), [
    (_stats(1024 + 4096, 1, 5e6, chats=3), "disk"),
    (_stats(1024 + 4096, 0, 5e6, chats=3), "ram"),
    (_stats(1024, 0, 5e6, rejected=1, chats=2), "recomputed"),
])
def test_the_tier_row_says_where_the_follow_up_found_its_tiers(after, source):
    before = _stats(1024, 0, 5e6, chats=3)
    row = bench_e2e.tier_row(before, after)
    assert row["tier_source"] == source
    assert row["tier_hit_tokens"] == (4096 if source != "recomputed" else 0)
    assert row["tier_restored_chats"] == (source == "disk")
    assert row["tier_files_rejected"] == (source == "recomputed")
    assert row["tier_disk_chats"] == 3 and row["tier_disk_mb"] == 0
    assert set(row["tier_cache"]) == {k for k in after if k.startswith("tier_cache_")}
    assert ("NOT adopted" in bench_e2e.tier_source_text(row)) == (source == "recomputed")


def test_the_tier_row_takes_the_host_times_of_the_follow_up():
    before = {**_stats(1024, 0, 5e6, chats=1), "tier_cache_restore_ms": 10.0, "tier_cache_park_ms": 4.0,
              "tier_cache_disk_read_bytes": 1e6, "tier_cache_disk_read_ms": 2.0}
    after = {**_stats(1024 + 4096, 1, 5e6, chats=1), "tier_cache_restore_ms": 1510.0, "tier_cache_park_ms": 9.0,
             "tier_cache_disk_read_bytes": 255e6, "tier_cache_disk_read_ms": 1202.0, "tier_cache_pin_alloc_ms": 300.0,
             "tier_cache_disk_crc_ms": 150.0, "tier_cache_resume_ms": 250.0, "tier_cache_match_ms": 1205.0,
             "tier_cache_spill_ms": 800.0, "tier_cache_write_ms": 700.0}
    row = bench_e2e.tier_row(before, after)
    assert row["tier_restore_ms"] == 1500 and row["tier_disk_read_ms"] == 1200 and row["tier_disk_read_mb"] == 254
    assert row["tier_park_ms"] == 5 and row["tier_pin_alloc_ms"] == 300 and row["tier_spill_ms"] == 800
    text = bench_e2e.tier_times_text(row)
    assert text.startswith("restore 1500 ms of host time, of it 254 MB read from disk in 1200 ms (300 ms allocating")
    assert "parking 5 ms" in text and "spilling 800 ms (writing 700 ms)" in text
    ram = bench_e2e.tier_times_text(bench_e2e.tier_row(before, {**before, "tier_cache_restore_ms": 12.0}))
    assert ram.startswith("restore 2 ms of host time, resume 0 ms") and "read from disk" not in ram
    assert "spilling" not in ram


def test_a_server_without_tier_counters_reads_as_recomputed():
    row = bench_e2e.tier_row({}, {"prefix_cache_hits_tokens": 9.0})
    assert row["tier_source"] == "recomputed" and row["tier_hit_tokens"] == 0 and row["tier_cache"] == {}


@pytest.mark.slow
def test_chat_cache_tiers_on_the_cpu_adopts_the_parked_tiers_after_each_restart(tmp_path):
    """The bench as a user runs it (``--device cpu``, tiny family, ~40 s): the restarted servers'
    follow-ups adopt the chat's tiers from the files the stopping server wrote; re-prefills adopt none."""
    out = tmp_path / "e2e.json"
    cmd = [sys.executable, str(BENCH / "bench_e2e.py"), "--family", "tiny", "--device", "cpu",
           "--dir", str(tmp_path / "ckpt"), "--configs", "chat-cache-tiers", "--chat-context", "1024",
           "--max-model-len", "2048", "--reps", "1", "--logs", str(tmp_path / "logs"), "--json", str(out),
           "--stack-samples"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    res = json.loads(out.read_text())["configs"]["chat-cache-tiers"]
    assert "error" not in res, res
    assert res["tier_flags"] == bench_e2e.TIER_FLAGS
    # the first server wrote its parked chats on the way out; each restart found them
    assert [found["disk_chats"] > 0 for found in res["tier_files_at_start"]] == [False, True, True]
    assert all(found["files_rejected"] == 0 for found in res["tier_files_at_start"])
    # after a restart: the warm start's copy in RAM, or the file read back (the warm start had not read
    # it yet, or parking the warm-up chat evicted it)
    for stage, sources in (("gpu", {"ram"}), ("host", {"ram"}), ("disk", {"disk", "preloaded"}),
                           ("cold", {"disk", "preloaded"})):
        row = res[stage]
        assert row["tier_source"] in sources, (stage, row)
        assert row["tier_hit_tokens"] >= 1024 and row["cached_tokens"] == row["tier_hit_tokens"], (stage, row)
        assert row["prompt_steps"] >= 1 and row["prompt_step_ms"] > 0, (stage, row)  # (its new tokens' prefill)
        if row["tier_source"] != "preloaded":
            assert row["tier_restored_chats"] == (row["tier_source"] == "disk"), (stage, row)
    assert all(r["tier_source"] == "recomputed" and r["cached_tokens"] == 0 for r in res["full"]["runs"])
    assert "tiers adopted from" in run.stdout
    # each server sampled its engine thread (--stack-samples), while it served at least
    samples = sorted((tmp_path / "logs").glob("server-chat-cache-tiers*.stacks.jsonl"))
    assert len(samples) == 3 and all('"hearth-engine"' in path.read_text() for path in samples)


@pytest.mark.slow
def test_stack_samples_cover_the_timed_first_tokens(tmp_path):
    """``--stack-samples`` on a plain config (``--device cpu``, tiny family, ~15 s): the server samples its
    engine thread and the timed TTFT runs print the commonest stacks of their window."""
    cmd = [sys.executable, str(BENCH / "bench_e2e.py"), "--family", "tiny", "--device", "cpu",
           "--dir", str(tmp_path / "ckpt"), "--configs", "resident", "--concurrency", "1", "--ttft", "64",
           "--decode-tokens", "4", "--reps", "1", "--max-model-len", "2048", "--logs", str(tmp_path / "logs"),
           "--stack-samples"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "TTFT 64 x 1: hearth-engine stack samples over" in run.stdout
    assert '"hearth-engine"' in (tmp_path / "logs" / "server-resident.stacks.jsonl").read_text()


@pytest.mark.slow
def test_a_second_run_of_the_bench_finds_none_of_the_first_runs_prompts_cached(tmp_path):
    """Each run's prompts repeat the last run's (the same seeds), and a stopping server saves its prompts' pages
    to its chat cache folder: each server gets its own Hearth folders, empty as on a new install, so a second
    run (or the next config's server) reads its TTFT prompts whole (~2 x 15 s on the CPU)."""
    cmd = [sys.executable, str(BENCH / "bench_e2e.py"), "--family", "tiny", "--device", "cpu",
           "--dir", str(tmp_path / "ckpt"), "--configs", "resident", "--concurrency", "1", "--ttft", "256",
           "--decode-tokens", "4", "--reps", "1", "--max-model-len", "2048", "--logs", str(tmp_path / "logs")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HEARTH_HOME": str(tmp_path / "home")}  # (one home, as a user's)
    for run_number in range(2):
        out = tmp_path / f"e2e-{run_number}.json"
        run = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=600, env=env)
        assert run.returncode == 0, run.stdout + run.stderr
        res = json.loads(out.read_text())["configs"]["resident"]
        assert res["ttft_256_cached_tokens"] == 0, (run_number, res)
