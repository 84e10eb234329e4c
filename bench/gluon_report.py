"""What the compiler made of the Gluon sparse MLA decode kernels (kernels/sparse_mla/gluon_kernels.py), offline:
registers, spills, shared memory, per-partition register budgets, and whether the PTX has the wgmma,
cp.async and mbarrier instructions the design relies on. No GPU needed.

    PYTHONPATH=/tmp/t36 python bench/gluon_report.py [--variant seesaw simple seesaw_fp8] [--regs 232 240]
        [--no-prefetch] [--ptx-dir DIR] [--diff-ptx DIR]

"seesaw_fp8" is the seesaw over an FP8 cache (`_sparse_mla_seesaw_fp8_kernel`, `SEESAW_FP8`). Per partition: the
SASS (ptxas -> nvdisasm, Triton's own binaries) is cut where a USETMAXREG sets a partition's register budget, and
each piece's spill instructions (LDL / STL), partition barriers (BAR.SYNC) and conversions are counted; the
pieces are named by budget (the producer's 24 / 40, the consumers' 240 / 232, 120: a partition's idle wait, 256:
the default partition's prologue and epilogue). --diff-ptx compares each compile's PTX code (line info and DWARF
sections left out) with one written earlier by --ptx-dir (e.g. before a change that must not touch a kernel).

Compiles for sm_90 (GPUTarget("cuda", 90, 32)) with gluon's own AST source class (`GluonASTSource`, which
builds the module from the @gluon.jit function directly, without Triton's layout passes); pointer, stride and
size arguments are declared 16-divisible as the launcher specialises them at run time on the GPU. For numbers
that match the H200 machine use its Triton (3.6): ``pip install --no-deps --target /tmp/t36 triton==3.6.0``.
`--regs` compiles the seesaw variants once per consumer register budget (the producer partition gets what the
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
    "cvt e4m3x2": r"cvt\.rn\.f16x2\.e4m3x2",
    "cvt bf16x2": r"cvt\.rn\.bf16x2\.f32",
    "prefetch.L2": r"cp\.async\.bulk\.prefetch\.L2",
}
SASS_COUNTS = {  # label: SASS pattern counted per partition piece
    "LDL/STL": r"\b(?:LDL|STL)\b",
    "BAR.SYNC": r"\bBAR\.SYNC\b",
    "LDS": r"\bLDS\b",
    "STS": r"\bSTS\b",
    "F2FP": r"\bF2FP\b",
    "HADD2.F32": r"\bHADD2\.F32\b",
}
SEESAW_KINDS = ("seesaw", "seesaw_fp8")


@dataclass
class GluonReport:
    name: str
    registers: int | None
    spill_bytes: int | None
    shared_bytes: int
    setmaxnreg: list[str]
    counts: dict[str, int]
    ptxas_notes: list[str]
    partitions: list[str]
    notes: list[str]

    def lines(self) -> list[str]:
        regs = "?" if self.registers is None else self.registers
        spills = "?" if self.spill_bytes is None else self.spill_bytes
        out = [f"{self.name}: registers {regs} (kernel-level .maxnreg / ptxas), spills {spills} B, "
               f"shared {self.shared_bytes} B ({self.shared_bytes / 1024:.1f} KiB of 227)"]
        if self.setmaxnreg:
            out.append("  setmaxnreg (partition register budgets, in PTX order): " + ", ".join(self.setmaxnreg))
        out.append("  PTX: " + ", ".join(f"{k} {v}" for k, v in self.counts.items() if v or k in ("wgmma",)))
        out += [f"  SASS {p}" for p in self.partitions]
        out += [f"  ptxas: {n}" for n in self.ptxas_notes]
        out += [f"  {n}" for n in self.notes]
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


def sass_partitions(ptx: str, arch: int = 90) -> list[str]:
    """The SASS of `ptx` cut at each USETMAXREG (a partition's register budget), one line per budget: how many
    pieces, their instructions and `SASS_COUNTS` (empty where ptxas / nvdisasm are missing or fail)."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas_bin, nvdisasm = os.path.join(bin_dir, "ptxas"), os.path.join(bin_dir, "nvdisasm")
    if not (os.path.exists(ptxas_bin) and os.path.exists(nvdisasm)):
        return []
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        if subprocess.run([ptxas_bin, f"-arch=sm_{arch}a", src, "-o", cubin], capture_output=True).returncode:
            return []
        run = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True)
        if run.returncode:
            return []
    pieces: dict[str, list[str]] = {}
    budget = "entry"
    for line in run.stdout.splitlines():
        m = re.search(r"USETMAXREG\.\w+(?:\.\w+)*\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)", line)
        if m:
            budget = str(int(m.group(1), 16))
            pieces.setdefault(budget, []).append("")  # a new piece
            continue
        if re.search(r"/\*[0-9a-f]{4,}\*/", line):
            pieces.setdefault(budget, [""])[-1] += line + "\n"
    out = []
    for budget, texts in pieces.items():
        text = "".join(texts)
        n_ins = len(re.findall(r"/\*[0-9a-f]{4,}\*/", text))
        counts = ", ".join(f"{k} {len(re.findall(p, text))}" for k, p in SASS_COUNTS.items())
        out.append(f"{budget:>5s} regs: {len(texts)} pieces, {n_ins} instructions; {counts}")
    return out


def ptx_code(ptx: str) -> str:
    """The PTX without line info and DWARF sections (what changes when only source lines move)."""
    cut = re.search(r"^\s*\.section\s+\.debug", ptx, re.M)
    lines = (ptx[: cut.start()] if cut else ptx).splitlines()
    keep = [re.sub(r"\s*//.*$", "", ln) for ln in lines if not re.match(r"\s*(\.loc|\.file|\$L__tmp)", ln)]
    return "\n".join(ln for ln in keep if ln.strip())


def consumer_code(ptx: str) -> list[str]:
    """The PTX of the seesaw's consumer partitions (from each setmaxnreg.inc to the consumer budget, up to the next
    setmaxnreg.dec), register names, labels, line info and the shared-memory offsets of the small buffers after the
    ring (>= 224 KiB: P exchange, row statistics, mbarriers, which the FP8 kernel's scale buffer moves) left out."""
    budgets = [int(n) for n in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx) if int(n) < 256]
    out: list[str] = []
    on = False
    for line in ptx.splitlines():
        m = re.search(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", line)
        if m:
            on = m.group(1) == "inc" and int(m.group(2)) in budgets
            out += ["== consumer"] if on else []
            continue
        if not on or re.match(r"\s*(\.loc|\$L__tmp|//)", line):
            continue
        line = re.sub(r"\s*//.*$", "", line)
        line = re.sub(r"%(r|rd|rs|p|f|fd)\d+", r"%\1", line)
        line = re.sub(r"\$L__BB\d+_\d+", "$L", line)
        line = re.sub(r"\b(2[2-3]\d{4})\b", lambda n: "SMEM" if int(n.group(1)) >= 229376 else n.group(1), line)
        if line.strip():
            out.append(line)
    return out


def compare_consumers(regs: int | None, arch: int = 90) -> str:
    """Whether the FP8 seesaw's consumers compile to the bf16 seesaw's PTX (at the same register budget)."""
    budget = regs if regs is not None else gd.SEESAW_FP8["regs"]
    a = consumer_code(compile_variant("seesaw", budget, arch=arch).asm["ptx"])
    b = consumer_code(compile_variant("seesaw_fp8", budget, arch=arch).asm["ptx"])
    n_diff = sum(1 for x, y in zip(a, b) if x != y) + abs(len(a) - len(b))
    what = "identical" if not n_diff else f"{n_diff} of {len(a)} lines differ"
    return (f"consumers vs the bf16 seesaw's at {budget} registers: {what} (PTX; register names and the offsets of "
            f"the buffers after the ring aside)")


def compile_variant(variant: str, regs: int | None = None, block_size: int = 64, arch: int = 90,
                    prefetch: bool | None = None):
    """triton.compile one variant as `sparse_mla_decode_gluon` launches it (16-divisible pointers, strides,
    TOPK and CHUNK), returning the CompiledKernel. "seesaw_fp8": the seesaw over an FP8 (uint8) cache."""
    from triton.experimental.gluon._runtime import GluonASTSource

    if variant == "seesaw":
        fn, cfg = gd._sparse_mla_seesaw_kernel, dict(gd.SEESAW)
    elif variant == "seesaw_fp8":
        fn, cfg = gd._sparse_mla_seesaw_fp8_kernel, dict(gd.SEESAW_FP8)
    else:
        fn, cfg = gd._sparse_mla_simple_kernel, dict(gd.SIMPLE)
    names = fn.arg_names
    types = {"q_ptr": "*bf16", "kv_ptr": "*u8" if variant == "seesaw_fp8" else "*bf16", "idx_ptr": "*i32",
             "table_ptr": "*i32", "ctx_ptr": "*i32", "limit_bias": "i32", "o_ptr": "*bf16", "lse_ptr": "*fp32",
             "TOPK": "i32", "CHUNK": "i32", "qk_scale": "fp32"}
    constexprs = dict(BLOCK_SIZE=block_size, BN=cfg["block_n"], NS=cfg["stages"])
    if variant in SEESAW_KINDS:
        constexprs["REGS_CONSUMER"] = regs if regs is not None else cfg["regs"]
        constexprs["PROXY_FENCE"] = cfg["proxy_fence"]
    if variant == "seesaw_fp8":
        constexprs["PREFETCH"] = cfg["prefetch"] if prefetch is None else prefetch
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}  # (strides: i32)
    aligned = [n for n, t in signature.items() if t.startswith("*") or n.startswith("stride") or n in ("TOPK", "CHUNK")]
    source = GluonASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": cfg["num_warps"]})


def report(variant: str, regs: int | None = None, arch: int = 90, ptx_dir: str | None = None,
           prefetch: bool | None = None, diff_dir: str | None = None) -> GluonReport:
    kernel = compile_variant(variant, regs, arch=arch, prefetch=prefetch)
    ptx = kernel.asm["ptx"]
    name = variant if regs is None else f"{variant} regs={regs}"
    if prefetch is not None and variant == "seesaw_fp8":
        name += f" prefetch={prefetch}"
    notes = []
    if diff_dir:
        tag = name.replace(" ", "_").replace("=", "")
        path = os.path.join(diff_dir, f"{tag}.ptx")
        if os.path.exists(path):
            with open(path) as f:
                old, new = ptx_code(f.read()).splitlines(), ptx_code(ptx).splitlines()
            n_diff = sum(1 for a, b in zip(old, new) if a != b) + abs(len(old) - len(new))
            notes.append(f"PTX code against {path}: " + ("identical" if not n_diff else f"{n_diff} lines differ"))
        else:
            notes.append(f"PTX code: no {path} to compare with")
    if ptx_dir:
        os.makedirs(ptx_dir, exist_ok=True)
        tag = name.replace(" ", "_").replace("=", "")
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(ptx_dir, f"{tag}.{ext}"), "w") as f:
                f.write(kernel.asm[ext])
    registers, spills, ptxas_notes = ptxas(ptx, arch)
    counts = {label: len(re.findall(pat, ptx)) for label, pat in INSTRUCTIONS.items()}
    setmax = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
    return GluonReport(name, registers, spills, kernel.metadata.shared, [f"{d} {n}" for d, n in setmax], counts,
                       ptxas_notes, sass_partitions(ptx, arch), notes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    choices = [*gd.VARIANTS, "seesaw_fp8"]
    ap.add_argument("--variant", nargs="*", default=choices, choices=choices)
    ap.add_argument("--regs", nargs="*", type=int, default=[], help="seesaw consumer register budgets to compile")
    ap.add_argument("--no-prefetch", action="store_true", help="seesaw_fp8 without the L2 prefetch of the next rows")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--ptx-dir", default=None, help="also write each compile's TTGIR and PTX here")
    ap.add_argument("--diff-ptx", default=None, help="compare each compile's PTX code with --ptx-dir's from before")
    args = ap.parse_args()
    if gd.GLUON_ERROR is not None:
        raise SystemExit(gd.GLUON_ERROR)
    print(f"# Triton {triton.__version__}, sm_{args.arch}", flush=True)
    for variant in args.variant:
        budgets = args.regs if (variant in SEESAW_KINDS and args.regs) else [None]
        prefetch = False if args.no_prefetch and variant == "seesaw_fp8" else None
        for regs in budgets:
            for line in report(variant, regs, args.arch, args.ptx_dir, prefetch, args.diff_ptx).lines():
                print(line, flush=True)
            if variant == "seesaw_fp8":
                print("  " + compare_consumers(regs, args.arch), flush=True)


if __name__ == "__main__":
    main()
