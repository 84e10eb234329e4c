"""bench/bench_one_launch.py under the CPU Triton interpreter at small rows: every programs-per-row count
selects the exact top-k (the bench checks each against torch before and after timing), the default is
reported as such and the results land in its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_one_launch.py"


def test_every_programs_per_row_count_selects_the_exact_top_k(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(BENCH), "--rows", "1", "3", "--n", "4500", "--programs", "0", "3",
                           "--warps", "4", "--scans", "0", "2", "--hist-blocks", "512", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "one_launch_programs.json").read_text())
    assert {(r["kind"], r["rows"]) for r in results} == {(k, rows) for k in ("randn", "relu") for rows in (1, 3)}
    assert sum(r["default"] for r in results) == 8
    assert {r["scan"] for r in results} == {0, 2}
    assert {r["programs_per_row"] for r in results if not r["default"]} == {3}
    assert "best:" in done.stdout
    hist = json.loads((tmp_path / "one_launch_hist.json").read_text())  # each checked against torch's bincount
    assert {(r["rows"], r["prefetch"], r["warps"]) for r in hist} == {(rows, p, w) for rows in (1, 3)
                                                                      for p in (False, True) for w in (8, 4)}
