"""Computing a missed expert on the host instead of fetching it (as Fiddler does).

A miss costs one expert copy over the link; computing it on the host costs reading (and, for FP8,
dequantising) its weights plus a few matrix-vector products, and moving the tokens' activations to
the host and the results back. Which is faster depends on the machine, so both speeds are measured
once at start-up (:func:`measure_host_speeds`) and :func:`choose_host_experts` splits a call's misses
between the link and the host so that the later of the two finishes first.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hearth.kernels.moe.reference import swiglu_expert
from hearth.offload.expert_store import SCALE_BLOCK, ExpertStore, ExpertWeights

HOST_POLICIES = ("auto", "on", "off")


@dataclass(frozen=True)
class HostSpeeds:
    """Measured costs (ms) of serving a missed expert by fetching it or by computing it on the host."""

    link_ms_per_expert: float  # one expert record host -> device (copies run one after another)
    cpu_fixed_ms: float  # one expert on the host, independent of its tokens (dequantise, read weights)
    cpu_ms_per_token: float
    transfer_ms: float  # per call with host experts: activations to the host and results back

    def cpu_ms(self, tokens: int) -> float:
        return self.cpu_fixed_ms + tokens * self.cpu_ms_per_token

    def describe(self) -> str:
        return (f"link {self.link_ms_per_expert:.3f} ms/expert, host {self.cpu_fixed_ms:.3f} ms/expert + "
                f"{self.cpu_ms_per_token:.3f} ms/token, transfers {self.transfer_ms:.3f} ms/call")


# The least share of a call's all-link time the host must be predicted to save. On the H200 (FP8
# DeepSeek-V3 experts, ~30 ms each on the host's 16 cores, 0.8 ms per copy) 32 requests missing ~80
# experts per layer sent 2 of them to the host for a predicted 2.5% saving, and the sync step ran at
# 82 tok/s against 160 with the host off (bench/bench_runahead.py --host-experts, docs/benchmarks.md).
HOST_MIN_SAVING = 0.25


def choose_host_experts(tokens: Sequence[int], speeds: HostSpeeds | None, policy: str = "auto",
                        min_saving: float = HOST_MIN_SAVING) -> list[bool]:
    """For each missed expert (serving ``tokens[i]`` (token, k) pairs): True = compute it on the host.

    ``on``: all of them; ``off`` (or no speeds): none. ``auto``: the experts serving the fewest tokens
    go to the host while that shortens the call, modelled as the later of the link (copies one after
    another) and the host (transfers + experts one after another) finishing; ties go to the link,
    which also leaves the expert cached for the next step. The host is used only when the model says
    it saves at least ``min_saving`` of the all-link time: what the model leaves out (the host's
    compute holds the thread that queues the next layer, its memory traffic meets the copies') ate
    every marginal win measured (see HOST_MIN_SAVING).
    """
    if policy not in HOST_POLICIES:
        raise ValueError(f"host expert policy must be one of {HOST_POLICIES}, got {policy!r}")
    n = len(tokens)
    if policy == "on":
        return [True] * n
    if policy == "off" or speeds is None or n == 0:
        return [False] * n
    by_tokens = sorted(range(n), key=lambda i: tokens[i])
    best_k, best_ms = 0, n * speeds.link_ms_per_expert
    host_ms = speeds.transfer_ms
    for k, i in enumerate(by_tokens, start=1):
        host_ms += speeds.cpu_ms(tokens[i])
        ms = max(host_ms, (n - k) * speeds.link_ms_per_expert)
        if ms < best_ms:
            best_k, best_ms = k, ms
    if best_ms > (1 - min_saving) * n * speeds.link_ms_per_expert:
        best_k = 0
    chosen = set(by_tokens[:best_k])
    return [i in chosen for i in range(n)]


def _dequant(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """[N, K] fp32 of ``w`` times its [ceil(N/128), ceil(K/128)] block scales (partial edges allowed)."""
    out = w.float()
    if scale is None:
        return out
    n, k = out.shape
    b = SCALE_BLOCK
    if n % b == 0 and k % b == 0:
        return (out.view(n // b, b, k // b, b) * scale[:, None, :, None]).view(n, k)  # (N/b, b, K/b, b)
    return out * scale.repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]


def host_expert(x: torch.Tensor, w: ExpertWeights, index: int = 0) -> torch.Tensor:
    """``down(silu(gate x) * up x)`` of expert ``index`` of ``w`` (host tensors) for x [n, D]: [n, D] fp32.

    fp32 math with the hidden activation rounded to x.dtype before the down projection, as the fused
    kernel and its reference do; FP8 weights are dequantised by their 128x128 block scales first.
    """
    inter = w.w13.shape[1] // 2
    if w.s13 is None:
        gate, up, down = w.w13[index, :inter].float(), w.w13[index, inter:].float(), w.w2[index].float()
    else:
        rows = w.s13.shape[1] // 2  # scale rows of the gate half
        gate = _dequant(w.w13[index, :inter], w.s13[index, :rows])
        up = _dequant(w.w13[index, inter:], w.s13[index, rows:])
        down = _dequant(w.w2[index], w.s2[index])
    if w.b13 is not None or w.swiglu_limit is not None:  # gpt-oss: biases and the clamped SwiGLU
        return swiglu_expert(x.float(), gate, up, down, _host_biases(w, index), w.swiglu_limit, w.swiglu_alpha)
    xf = x.float()
    h = (F.silu(F.linear(xf, gate)) * F.linear(xf, up)).to(x.dtype).float()  # (n, I)
    return F.linear(h, down)


def _host_biases(w: ExpertWeights, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    if w.b13 is None:
        return None
    inter = w.w13.shape[1] // 2
    return w.b13[index, :inter].float(), w.b13[index, inter:].float(), w.b2[index].float()


def _ms(fn, reps: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) * 1e3 / reps


def measure_host_speeds(store: ExpertStore, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                        num_copies: int = 4) -> HostSpeeds:
    """Time a few expert copies to ``device`` and one expert on the host at 1 and 4 tokens (three host
    runs: about 0.1-0.3 s for an FP8 DeepSeek-V3 expert on 16 cores)."""
    device = torch.device(device)
    layer = store.layers[0]
    record = store.record_bytes
    num_copies = max(1, min(num_copies, store.num_experts))
    link_ms = record / 55e6  # nominal pinned PCIe Gen5 x16 when there is no GPU to measure
    transfer_ms = 0.0
    if device.type == "cuda":
        dst = torch.empty(record, dtype=torch.uint8, device=device)
        dst.copy_(store.expert(layer, 0), non_blocking=True)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for e in range(num_copies):
            dst.copy_(store.expert(layer, e), non_blocking=True)
        end.record()
        end.synchronize()
        link_ms = start.elapsed_time(end) / num_copies
        act = torch.randn(8, store.layout.hidden, device=device)

        def round_trip() -> None:
            act.cpu().to(device, non_blocking=True)
            torch.cuda.synchronize(device)

        round_trip()
        transfer_ms = _ms(round_trip, reps=3)
    x = torch.randn(4, store.layout.hidden).to(dtype)
    # NOTE: the weights are read (and an MXFP4 store's dequantised) inside the timed runs, as a call does.
    host_expert(x[:1], store.expert_weights(layer, 0))  # warm-up (allocator, thread pool)
    one = _ms(lambda: host_expert(x[:1], store.expert_weights(layer, 0)))
    four = _ms(lambda: host_expert(x, store.expert_weights(layer, 0)))
    per_token = max(0.0, (four - one) / 3)
    return HostSpeeds(link_ms, max(0.0, one - per_token), per_token, transfer_ms)
