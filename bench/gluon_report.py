"""What the compiler made of the Gluon sparse MLA decode kernels (kernels/sparse_mla/gluon_kernels.py), offline:
registers, spills, shared memory, per-partition register budgets, and whether the PTX has the wgmma,
cp.async and mbarrier instructions the design relies on. No GPU needed.

    PYTHONPATH=/tmp/t36 python bench/gluon_report.py [--variant seesaw simple] [--regs 232 240] [--ptx-dir DIR]

Compiles for sm_90 (GPUTarget("cuda", 90, 32)) with gluon's own AST source class (`GluonASTSource`, which
builds the module from the @gluon.jit function directly, without Triton's layout passes); pointer, stride and
size arguments are declared 16-divisible as the launcher specialises them at run time on the GPU. For numbers
that match the H200 machine use its Triton (3.6): ``pip install --no-deps --target /tmp/t36 triton==3.6.0``.
`--regs` compiles the seesaw variant once per consumer register budget (the producer partition gets what the
two consumer warpgroups leave of 3 x 168). Registers and spills come from ptxas -v on the PTX (Triton's
own ptxas); spills are summed over all partitions (ptxas reports one function).
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

from hearth.kernels.sparse_mla import gluon_kernels as gd

INSTRUCTIONS = {  # label: PTX pattern counted
    "wgmma": r"wgmma\.mma_async",
    "wgmma.wait": r"wgmma\.wait_group",
    "cp.async 16B": r"cp\.async\.cg\.shared\.global",
    "cp.async <16B": r"cp\.async\.ca\.shared\.global",
    "cp.async.mbarrier.arrive": r"cp\.async\.mbarrier\.arrive",
    "cp.async.wait_group": r"cp\.async\.wait_group",
    "mbarrier.try_wait": r"mbarrier\.try_wait",
    "mbarrier.arrive": r"(?<!async\.)mbarrier\.arrive\.shared",
    "fence.proxy.async": r"fence\.proxy\.async",
    "bar.sync": r"\bbar(?:rier)?\.sync",
    "ldmatrix / stmatrix": r"\b(?:ld|st)matrix",
}


@dataclass
class GluonReport:
    name: str
    registers: int | None
    spill_bytes: int | None
    shared_bytes: int
    setmaxnreg: list[str]
    counts: dict[str, int]
    ptxas_notes: list[str]

    def lines(self) -> list[str]:
        regs = "?" if self.registers is None else self.registers
        spills = "?" if self.spill_bytes is None else self.spill_bytes
        out = [f"{self.name}: registers {regs} (kernel-level .maxnreg / ptxas), spills {spills} B, "
               f"shared {self.shared_bytes} B ({self.shared_bytes / 1024:.1f} KiB of 227)"]
        if self.setmaxnreg:
            out.append("  setmaxnreg (partition register budgets, in PTX order): " + ", ".join(self.setmaxnreg))
        out.append("  PTX: " + ", ".join(f"{k} {v}" for k, v in self.counts.items()))
        out += [f"  ptxas: {n}" for n in self.ptxas_notes]
        return out


def ptxas(ptx: str, arch: int = 90) -> tuple[int | None, int | None, list[str]]:
    """Registers, spill-store bytes and any warnings from Triton's ptxas -v."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    try:
        for name in ("ptxas", "ptxas-blackwell"):
            path = os.path.join(bin_dir, name)
            if not os.path.exists(path):
                continue
            run = subprocess.run([path, f"-arch=sm_{arch}a", "-v", f.name, "-o", os.devnull], capture_output=True,
                                 text=True)
            if run.returncode == 0:
                regs = re.search(r"Used (\d+) registers", run.stderr)
                spills = re.search(r"(\d+) bytes spill stores", run.stderr)
                notes = [ln.strip() for ln in run.stderr.splitlines() if "warning" in ln.lower()]
                return (int(regs.group(1)) if regs else None, int(spills.group(1)) if spills else 0, notes)
        return None, None, ["no ptxas accepted the PTX"]
    finally:
        os.unlink(f.name)


def compile_variant(variant: str, regs: int | None = None, block_size: int = 64, arch: int = 90):
    """triton.compile one variant as `sparse_mla_decode_gluon` launches it (16-divisible pointers, strides,
    TOPK and CHUNK), returning the CompiledKernel."""
    from triton.experimental.gluon._runtime import GluonASTSource

    if variant == "seesaw":
        fn, cfg = gd._sparse_mla_seesaw_kernel, dict(gd.SEESAW)
    else:
        fn, cfg = gd._sparse_mla_simple_kernel, dict(gd.SIMPLE)
    names = fn.arg_names
    types = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "table_ptr": "*i32", "ctx_ptr": "*i32",
             "limit_bias": "i32", "o_ptr": "*bf16", "lse_ptr": "*fp32", "TOPK": "i32", "CHUNK": "i32",
             "qk_scale": "fp32"}
    constexprs = dict(BLOCK_SIZE=block_size, BN=cfg["block_n"], NS=cfg["stages"])
    if variant == "seesaw":
        constexprs["REGS_CONSUMER"] = regs if regs is not None else cfg["regs"]
        constexprs["PROXY_FENCE"] = cfg["proxy_fence"]
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}  # (strides: i32)
    aligned = [n for n, t in signature.items() if t.startswith("*") or n.startswith("stride") or n in ("TOPK", "CHUNK")]
    source = GluonASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": cfg["num_warps"]})


def report(variant: str, regs: int | None = None, arch: int = 90, ptx_dir: str | None = None) -> GluonReport:
    kernel = compile_variant(variant, regs, arch=arch)
    ptx = kernel.asm["ptx"]
    name = variant if regs is None else f"{variant} regs={regs}"
    if ptx_dir:
        os.makedirs(ptx_dir, exist_ok=True)
        tag = name.replace(" ", "_").replace("=", "")
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(ptx_dir, f"{tag}.{ext}"), "w") as f:
                f.write(kernel.asm[ext])
    registers, spills, notes = ptxas(ptx, arch)
    counts = {label: len(re.findall(pat, ptx)) for label, pat in INSTRUCTIONS.items()}
    setmax = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
    return GluonReport(name, registers, spills, kernel.metadata.shared, [f"{d} {n}" for d, n in setmax], counts, notes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", nargs="*", default=list(gd.VARIANTS), choices=gd.VARIANTS)
    ap.add_argument("--regs", nargs="*", type=int, default=[], help="seesaw consumer register budgets to compile")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--ptx-dir", default=None, help="also write each compile's TTGIR and PTX here")
    args = ap.parse_args()
    if gd.GLUON_ERROR is not None:
        raise SystemExit(gd.GLUON_ERROR)
    print(f"# Triton {triton.__version__}, sm_{args.arch}", flush=True)
    for variant in args.variant:
        budgets = args.regs if (variant == "seesaw" and args.regs) else [None]
        for regs in budgets:
            for line in report(variant, regs, args.arch, args.ptx_dir).lines():
                print(line, flush=True)


if __name__ == "__main__":
    main()
