"""bench/kernel_report.py: sm_90 compiles on a machine without a GPU (Triton's own ptxas), run as the
tool is (a subprocess without the CPU interpreter, under which @triton.jit builds interpreted functions)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "bench" / "kernel_report.py"


def _report(*args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(TOOL), *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if not line.startswith("#")]


def _fields(line: str) -> dict[str, str]:
    return dict(re.findall(r"(registers|spills|shared|wgmma|async copies) ([^,]+)", line))


def test_the_parsed_config_types_its_values():
    sys.path.insert(0, str(TOOL.parent))
    try:
        from kernel_report import parse_config
    finally:
        sys.path.remove(str(TOOL.parent))
    assert parse_config("block_n=32, num_stages=7,fp8_tile=false,plan=wave") == {
        "block_n": 32, "num_stages": 7, "fp8_tile": False, "plan": "wave"}
    assert parse_config("") == {}


def test_sparse_mla_pipelines_its_gather_into_shared_memory():
    """The query and at least two latent tiles in shared memory (the gathered tile is copied ahead), dots
    on wgmma; a 32-row tile at 7 stages holds more tiles than at 4 (the chain of three loads)."""
    default, deep, shallow = (_fields(line) for line in _report(
        "sparse_mla", "--config", "", "block_n=32,num_stages=7", "block_n=32,num_stages=4"))
    assert default["wgmma"] == "yes" and int(default["async copies"]) > 0
    assert float(default["shared"].split()[0]) >= 72 + 2 * 72  # KiB: query [64, 576] bf16 + two [64, 576] tiles
    assert 0 < int(default["registers"]) <= 255
    assert float(deep["shared"].split()[0]) > float(shallow["shared"].split()[0])


def test_the_one_launch_select_compiles_without_tensor_cores():
    (line,) = _report("one_launch", "--config", "SCAN=2,num_warps=4")
    fields = _fields(line)
    assert fields["wgmma"] == "no" and 0 < int(fields["registers"]) <= 255


def test_the_cooperative_top_k_leaves_room_for_two_programs_an_sm():
    """Its grid barriers need every program resident: at 8 warps, 128 registers a thread or fewer, no spills
    (`maxnreg`), and shared memory for two, at the smallest and largest slice, with either way of polling its
    barriers."""
    for line in _report("cooperative", "--config", "BLOCK=256", "BLOCK=2048",
                        "BLOCK=2048,POLL_ACQUIRE=true,POLL_HIST=true", "BLOCK=256,POLL_ACQUIRE=false"):
        fields = _fields(line)
        assert 0 < int(fields["registers"]) <= 128 and fields["spills"].startswith("0 ")
        assert float(fields["shared"].split()[0]) <= 100  # KiB of the H100 / H200's 228 an SM
