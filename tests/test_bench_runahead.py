"""bench/bench_runahead.py on the tiny model (``--small``, CPU): every configuration runs each scheduler
with the timed case as its warm-up, the schedulers take turns running first, and each row carries the
verdict inputs (how long sync leaves the link idle, the ratios over sync and prefetch)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import bench_runahead  # noqa: E402


def test_the_schedulers_take_turns_and_each_row_has_its_verdict_inputs(tmp_path, monkeypatch, capsys):
    runs: list[tuple[str, int]] = []
    real = bench_runahead.run_case

    def recorded(engine, concurrency, tokens, prompt_len):
        runs.append((engine.config.scheduler, tokens))
        return real(engine, concurrency, tokens, prompt_len)

    monkeypatch.setattr(bench_runahead, "run_case", recorded)
    monkeypatch.setattr(bench_runahead, "_TURNS", iter(range(10)))
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["bench_runahead.py", "--small", "--concurrency", "1", "2", "--tokens", "2",
                                      "--cache-fraction", "0.25", "--routing", "uniform", "--json", str(out)])
    bench_runahead.main()
    # two configurations of four schedulers, each run twice (warm-up, then timed) with the timed length
    # ("runahead-always" is the "runahead" engine with auto's gate taken off)
    order = [s for s, _ in runs[::2]]
    assert order == ["sync", "prefetch", "runahead", "runahead", "prefetch", "runahead", "runahead", "sync"]
    assert [s for s, _ in runs[1::2]] == order and {t for _, t in runs} == {2}
    results = json.loads(out.read_text())["results"]
    assert [r["concurrency"] for r in results] == [1, 2]
    for row in results:
        assert list(row)[5:9] == ["sync", "prefetch", "runahead", "runahead-always"]  # in the asked order
        assert isinstance(row["tokens_differ"], list)
        assert row["always_over_sync"] > 0
        assert 0.0 <= row["sync_link_idle"] <= 1.0 and row["runahead_over_sync"] > 0
    assert "sync leaves the link idle" in capsys.readouterr().out
