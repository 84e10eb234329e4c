"""FP8 block-scaled linear kernels on DeepSeek-V3.2's projection shapes: the decode GEMV and the prefill
GEMM against the path they replace (dequantise to bf16 every call, then ``F.linear``) and against a plain
bf16 ``F.linear`` (cuBLAS, twice the weight bytes). Correctness first (each shape against the torch
reference), then medians of CUDA-graph replays (``triton.testing.do_bench_cudagraph``).

    python bench/bench_fp8_linear.py [--rows 1 8 32 2048] [--sweep] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton

from hearth.kernels.fp8_linear import GemmConfig, GemvConfig, dequantize, fp8_gemm, fp8_gemv, fp8_linear

HBM = 4.28e12
# (name, out_features N, in_features K) of DeepSeek-V3.2's FP8 linears
SHAPES = [("q_a", 1536, 7168), ("q_b", 24576, 1536), ("kv_a", 576, 7168), ("o_proj", 7168, 16384),
          ("idx_wq_b", 8192, 1536), ("dense_gate_up", 36864, 7168), ("dense_down", 7168, 18432),
          ("shared_gate_up", 4096, 7168), ("shared_down", 7168, 2048)]


def weights(n: int, k: int):
    w8 = (torch.randn(n, k, device="cuda") * 8).to(torch.float8_e4m3fn)
    scale = torch.exp2(torch.randint(-12, -8, (triton.cdiv(n, 128), triton.cdiv(k, 128)), device="cuda").float())
    return w8, scale


def timed(fn, rep: int = 50) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=rep) * 1e-3


SWEEP_SHAPES = ("q_b", "o_proj")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 2048])
    parser.add_argument("--sweep", action="store_true", help="also sweep GEMV / GEMM tiles")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    print("| shape | M | fp8 kernel us | GB/s | % HBM | TFLOP/s | dequant+linear us | bf16 linear us "
          "| vs dequant | vs bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (name, n, k), m in itertools.product(SHAPES, args.rows):
        w8, scale = weights(n, k)
        x = torch.randn(m, k, device="cuda").bfloat16()
        wbf = dequantize(w8, scale, torch.bfloat16)
        got = fp8_linear(x, w8, scale)
        want = x.float() @ wbf.float().T
        err = float((got.float() - want).norm() / want.norm())
        assert err < 1e-2, f"{name} M={m}: relative error {err}"
        t = timed(lambda: fp8_linear(x, w8, scale))  # noqa: B023
        t_deq = timed(lambda: F.linear(x, dequantize(w8, scale, torch.bfloat16)))  # noqa: B023
        t_bf = timed(lambda: F.linear(x, wbf))  # noqa: B023
        nbytes = n * k + scale.numel() * 4 + m * (n + k) * 2
        row = dict(shape=name, n=n, k=k, m=m, us=t * 1e6, gbs=nbytes / t / 1e9, pct_hbm=100 * nbytes / t / HBM,
                   tflops=2 * m * n * k / t / 1e12, dequant_us=t_deq * 1e6, bf16_us=t_bf * 1e6, rel_err=err)
        rows.append(row)
        print(f"| {name} {n}x{k} | {m} | {t * 1e6:.1f} | {row['gbs']:.0f} | {row['pct_hbm']:.0f}% | "
              f"{row['tflops']:.0f} | {t_deq * 1e6:.1f} | {t_bf * 1e6:.1f} | {t_deq / t:.1f}x | {t_bf / t:.2f}x |",
              flush=True)
    sweep = []
    if args.sweep:
        for name, n, k in SHAPES:
            if name not in SWEEP_SHAPES:
                continue
            w8, scale = weights(n, k)
            for m in (1,):
                x = torch.randn(m, k, device="cuda").bfloat16()
                best = None
                for bn, bk, nw, mp in itertools.product((8, 16, 32), (256, 512, 1024), (4,), (264, 1056)):
                    cfg = GemvConfig(block_n=bn, block_k=bk, num_warps=nw, min_programs=mp)
                    t = timed(lambda: fp8_gemv(x, w8, scale, cfg), rep=20)  # noqa: B023
                    sweep.append(dict(kind="gemv", shape=name, m=m, cfg=str(cfg), us=t * 1e6))
                    if best is None or t < best[0]:
                        best = (t, cfg)
                print(f"gemv {name} M={m}: best {best[0] * 1e6:.1f} us {best[1]}", flush=True)
            x = torch.randn(8, k, device="cuda").bfloat16()
            best = None
            for bn, bk, nw, mp in itertools.product((32, 64, 128), (64, 128), (4, 8), (264, 528)):
                cfg = GemmConfig(block_m=16, block_n=bn, block_k=bk, group_m=1, num_warps=nw, min_programs=mp)
                t = timed(lambda: fp8_gemm(x, w8, scale, cfg), rep=20)  # noqa: B023
                sweep.append(dict(kind="skinny", shape=name, m=8, cfg=str(cfg), us=t * 1e6))
                if best is None or t < best[0]:
                    best = (t, cfg)
            print(f"skinny {name} M=8: best {best[0] * 1e6:.1f} us {best[1]}", flush=True)
            x = torch.randn(2048, k, device="cuda").bfloat16()
            best = None
            for bm, bn, bk, nw, ns in itertools.product((64, 128), (128, 256), (64, 128), (4, 8), (3, 4)):
                cfg = GemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                try:
                    t = timed(lambda: fp8_gemm(x, w8, scale, cfg), rep=20)  # noqa: B023
                except Exception:  # out of shared memory for this tile
                    continue
                sweep.append(dict(kind="gemm", shape=name, m=2048, cfg=str(cfg), us=t * 1e6))
                if best is None or t < best[0]:
                    best = (t, cfg)
            print(f"gemm {name} M=2048: best {best[0] * 1e6:.1f} us ({2 * 2048 * n * k / best[0] / 1e12:.0f} "
                  f"TFLOP/s) {best[1]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "sweep": sweep}, f, indent=1)


if __name__ == "__main__":
    main()
