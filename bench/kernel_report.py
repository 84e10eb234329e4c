"""What the compiler made of Hearth's largest Triton kernels, without a GPU: registers, spills, shared
memory, whether the dots became wgmma and how many loads the pipeliner turned into asynchronous copies.

GPU time is scarce and a kernel's variants are cheap to compile: this answers "does it spill", "does it
fit one or two programs per SM" and "is the gather pipelined at all" before a variant is timed.

    python bench/kernel_report.py sparse_mla [--fp8] [--config "block_n=32,num_stages=7" ...]
    python bench/kernel_report.py one_launch [--config "SCAN=2" "BLOCK=4096,num_warps=4" ...]
    python bench/kernel_report.py cooperative [--config "BLOCK=2048" "SPREAD=true" ...]
    python bench/kernel_report.py fused_cooperative [--config "BLOCK_T=64" "num_stages=4" ...]

Each --config is one compile: comma-separated name=value pairs over the kernel's defaults, where
num_warps / num_stages are launch options and the rest the kernel's constexprs (sparse MLA also takes
block_n / block_h / fp8_tile / q_reload, its `launch_plan` keys). Pointer, stride and size arguments are
declared 16-divisible, as Triton's launcher specialises them at run time (without that no load is
pipelined and the counts mean nothing). For numbers that match the GPU machine, compile with its Triton
(3.6 on the H200): ``pip install --no-deps --target /tmp/t36 triton==3.6.0`` then
``PYTHONPATH=/tmp/t36 python bench/kernel_report.py ...``. Target: sm_90 unless --arch says otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hearth.kernels.indexer import decode_cooperative
from hearth.kernels.sparse_mla import kernel as sparse_mla
from hearth.kernels.topk import cooperative, one_launch
from hearth.kernels.topk.radix import NBINS, PASSES, RADIX_BITS


@dataclass(frozen=True)
class Report:
    registers: int | None
    spill_bytes: int | None  # spill stores, bytes a thread
    shared_bytes: int
    wgmma: bool
    async_copies: int  # async global -> shared copies in the final IR (prologue copies included)

    def line(self) -> str:
        regs = "?" if self.registers is None else self.registers
        spills = "?" if self.spill_bytes is None else self.spill_bytes
        return (f"registers {regs}, spills {spills} B, shared {self.shared_bytes / 1024:.1f} KiB, "
                f"wgmma {'yes' if self.wgmma else 'no'}, async copies {self.async_copies}")


def _ptxas_info(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """Registers and spill-store bytes from ptxas -v (Triton's own ptxas; the newer one it ships for
    Blackwell where the first rejects the PTX version)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    suffix = "a" if arch >= 90 else ""
    try:
        for name in ("ptxas", "ptxas-blackwell"):
            path = os.path.join(bin_dir, name)
            if not os.path.exists(path):
                continue
            run = subprocess.run([path, f"-arch=sm_{arch}{suffix}", "-v", f.name, "-o", os.devnull],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                regs = re.search(r"Used (\d+) registers", run.stderr)
                spills = re.search(r"(\d+) bytes spill stores", run.stderr)
                return (int(regs.group(1)) if regs else None, int(spills.group(1)) if spills else 0)
        return None, None
    finally:
        os.unlink(f.name)


def compile_report(fn, signature: dict[str, str], constexprs: dict, num_warps: int, num_stages: int,
                   arch: int = 90, maxnreg: int | None = None) -> Report:
    """Compile ``fn`` for sm_``arch`` with the given argument types (Triton signature strings) and
    constexpr values; pointer, stride and the names in ``signature`` typed "i32/16" are declared
    16-divisible."""
    names = fn.arg_names
    types = {n: t.removesuffix("/16") for n, t in signature.items()}
    aligned = [n for n, t in signature.items() if t.startswith("*") or t.endswith("/16") or n.startswith("stride")]
    source = ASTSource(
        fn=fn,
        signature={**types, **dict.fromkeys(constexprs, "constexpr")},
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages, "maxnreg": maxnreg})
    registers, spills = _ptxas_info(kernel.asm["ptx"], arch)
    ttgir = kernel.asm["ttgir"]
    return Report(registers, spills, kernel.metadata.shared, "warp_group_dot" in ttgir,
                  len(re.findall(r"async_copy_global_to_local", ttgir)))


def parse_config(text: str) -> dict:
    """``"a=1,b=true,c=x"`` -> {"a": 1, "b": True, "c": "x"}."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        low = value.strip().lower()
        out[name.strip()] = True if low == "true" else False if low == "false" else (
            int(low) if re.fullmatch(r"-?\d+", low) else value.strip())
    return out


def sparse_mla_report(config: dict, fp8: bool, arch: int = 90) -> Report:
    """The sparse MLA forward kernel as `launch_plan` sets it up for decode at batch 64 (no splits),
    with ``config``'s entries over the plan's."""
    plan = sparse_mla.launch_plan(64, 128, 2048, fp8, 132, config)
    fn = sparse_mla._sparse_mla_fwd_kernel
    signature = {"q_ptr": "*bf16", "kv_ptr": "*u8", "kv_f32_ptr": "*fp32", "kv_bf16_ptr": "*bf16",
                 "idx_ptr": "*i32", "table_ptr": "*i32", "limit_ptr": "*i32", "limit_bias": "i32",
                 "o_ptr": "*bf16", "lse_ptr": "*fp32", "H": "i32/16", "TOPK": "i32/16", "CHUNK": "i32/16",
                 "qk_scale": "fp32"}
    signature |= {n: "i32" for n in fn.arg_names if n.startswith("stride")}
    constexprs = dict(BLOCK_SIZE=64, BLOCK_H=plan["block_h"], BLOCK_N=plan["block_n"], IS_FP8=fp8,
                      FP8_TILE=plan["fp8_tile"], PARTIAL=plan["splits"] > 1, DV=sparse_mla.D_LATENT,
                      DR=sparse_mla.D_ROPE, UPCAST=False, Q_RELOAD=plan["q_reload"])
    return compile_report(fn, signature, constexprs, plan["num_warps"], plan["num_stages"], arch)


def _select_setup(config: dict, block: int) -> tuple[dict, tuple, dict]:
    """A top-k selection kernel's compile (k 2048, the default survivor capacity): ``config`` without its launch
    options, those options (warps, stages, maxnreg, defaults 8 / 3 / `SELECT_MAXNREG`) and the shared constexprs."""
    config = dict(config)
    maxnreg = config.pop("maxnreg", one_launch.SELECT_MAXNREG)
    options = (config.pop("num_warps", 8), config.pop("num_stages", 3), maxnreg)
    plan = one_launch.one_launch_plan(2048)
    constexprs = dict(CAP=plan.capacity, CAP2=plan.capacity2, MAP_PAGE=0, BLOCK=block, FBLOCK=plan.finish_block,
                      RANK_BLOCK=one_launch.RANK_BLOCK, NBINS=NBINS, BITS=RADIX_BITS, PASSES=PASSES, PDL=True,
                      TRACE=False)
    return config, options, constexprs


def one_launch_report(config: dict, arch: int = 90) -> Report:
    """The one-launch top-k selection kernel (k 2048, the default survivor capacity), ``config``'s
    constexprs and launch options over its defaults."""
    config, options, constexprs = _select_setup(config, 1024)
    constexprs |= dict(SCAN=one_launch.SCAN, SAMPLE=one_launch.HIST_SAMPLE, SAMPLE_MIN=one_launch.SAMPLE_MIN_PER_K,
                       SIGMAS=float(one_launch.SAMPLE_SIGMAS)) | config
    signature = {"x_ptr": "*fp32", "len_ptr": "*i32", "out_ptr": "*i32", "ws_ptr": "*i32", "map_ptr": "*i32",
                 "trace_ptr": "*i64", "stride_x": "i32", "stride_out": "i32", "stride_ws": "i32", "K": "i32/16",
                 "SEG": "i32/16"}
    return compile_report(one_launch._topk_one_launch_kernel, signature, constexprs, *options[:2], arch, options[2])


def cooperative_report(config: dict, arch: int = 90) -> Report:
    """The cooperative few-row top-k kernel (k 2048, the default capacity, 1024-key slices as at b1 x 128K:
    `MAX_PROGRAMS` a row), ``config``'s constexprs and launch options over its defaults."""
    config, options, constexprs = _select_setup(config, 1024)
    constexprs |= dict(WAYS=one_launch.TABLE_WAYS, POLL_ACQUIRE=cooperative.POLL_ACQUIRE,
                       POLL_HIST=cooperative.POLL_HIST, SPREAD=cooperative.SPREAD) | config
    signature = {"x_ptr": "*fp32", "len_ptr": "*i32", "out_ptr": "*i32", "ws_ptr": "*i32", "map_ptr": "*i32",
                 "trace_ptr": "*i64", "stride_x": "i32", "stride_out": "i32", "stride_ws": "i32", "N": "i32/16",
                 "K": "i32/16"}
    return compile_report(cooperative._cooperative_topk_kernel, signature, constexprs, *options[:2], arch, options[2])


def fused_cooperative_report(config: dict, arch: int = 90) -> Report:
    """The decode indexer + cooperative top-k kernel (`decode_cooperative`; DeepSeek's 64 heads of 128, FP8 queries,
    64-token pages, k 2048, 1024-key slices as at b1 x 128K), ``config``'s constexprs and options over its defaults."""
    config, options, constexprs = _select_setup({"num_stages": decode_cooperative.NUM_STAGES} | config, 1024)
    constexprs.pop("MAP_PAGE")
    constexprs |= dict(WAYS=one_launch.TABLE_WAYS, POLL_ACQUIRE=cooperative.POLL_ACQUIRE,
                       POLL_HIST=cooperative.POLL_HIST, H=64, D=128, BLOCK_SIZE=64, BLOCK_T=decode_cooperative.BLOCK_T,
                       Q_FP8=True, UPCAST=False, PRECISE=True) | config
    signature = {"q_ptr": "*fp8e4nv", "w_ptr": "*fp32", "cache_u8_ptr": "*u8", "cache_f32_ptr": "*fp32",
                 "table_ptr": "*i32", "ctx_ptr": "*i32", "x_ptr": "*fp32", "out_ptr": "*i32", "ws_ptr": "*i32",
                 "trace_ptr": "*i64", "stride_table": "i32", "stride_x": "i32", "stride_out": "i32",
                 "stride_ws": "i32", "stride_blk": "i32", "N": "i32/16", "K": "i32/16"}
    return compile_report(decode_cooperative._indexer_cooperative_kernel, signature, constexprs, *options[:2], arch,
                          options[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", choices=["sparse_mla", "one_launch", "cooperative", "fused_cooperative"])
    ap.add_argument("--config", nargs="*", default=[""], help="one compile each (see the module doc)")
    ap.add_argument("--fp8", action="store_true", help="sparse MLA over the FP8 latent cache")
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    print(f"# Triton {triton.__version__}, sm_{args.arch}", flush=True)
    for text in args.config:
        config = parse_config(text)
        if args.kernel == "sparse_mla":
            report = sparse_mla_report(config, args.fp8, args.arch)
        elif args.kernel == "cooperative":
            report = cooperative_report(config, args.arch)
        elif args.kernel == "fused_cooperative":
            report = fused_cooperative_report(config, args.arch)
        else:
            report = one_launch_report(config, args.arch)
        print(f"{args.kernel} {text or 'defaults'}: {report.line()}", flush=True)


if __name__ == "__main__":
    main()
