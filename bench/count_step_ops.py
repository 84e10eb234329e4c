"""Count the operations of one decode step on the kernel path, per module: where a step's small
kernels come from.

Builds a small FP8 DeepSeek-V3.2-shaped checkpoint (the kernels' widths: ``KERNEL_SHAPES``, 1 dense +
2 MoE layers) and runs decode steps the way the GPU runs them: the Triton DSA kernels (sparse MLA,
indexer, top-k), FP8 linears through ``hearth.kernels.fp8_linear``, resident fused experts, and the
step described by device tensors only (``DecodeMeta``, as a CUDA-graph replay sees it; ``--eager``
builds the context as ``ModelRunner.run`` does without graphs). On the CPU the Triton kernels run
under Triton's interpreter (``TRITON_INTERPRET=1`` is set when the device is cpu).

Counted per innermost module (layer numbers folded to ``L``), one step:
- aten ops that launch work (views, ``empty`` and other metadata-only ops are left out);
- Triton kernel launches;
- on CUDA also the GPU kernels the profiler saw, attributed to the module that launched them.

    python bench/count_step_ops.py [--device cpu|cuda] [--arch deepseek_v32|glm_moe_dsa] [--context 96]
                                   [--batch 1] [--eager] [--real-width]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

# The interpreter must be chosen before Triton is imported (through hearth.kernels).
if "--device" not in sys.argv or sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from hearth.engine.config import ModelConfig  # noqa: E402
from hearth.engine.kv_cache import DecodeMeta, ForwardContext, PagedCache, SeqSlice, build_context  # noqa: E402
from hearth.engine.loader import load_checkpoint  # noqa: E402
from hearth.engine.models import fused_experts  # noqa: E402
from hearth.engine.models.layers import Fp8Linear  # noqa: E402
from hearth.engine.models.mla import AttentionPaths  # noqa: E402
from hearth.engine.testing.tiny import KERNEL_SHAPES, write_tiny_model  # noqa: E402
from hearth.kernels.fp8_linear import fp8_linear  # noqa: E402

BLOCK_SIZE = 16
# Metadata-only aten ops: no kernel runs for them.
_NO_KERNEL = {
    "view", "_unsafe_view", "reshape", "alias", "as_strided", "expand", "permute", "select", "slice",
    "split", "split_with_sizes", "squeeze", "unsqueeze", "t", "transpose", "unbind", "detach", "empty",
    "empty_strided", "empty_like", "new_empty", "new_empty_strided", "view_as", "unflatten", "flatten",
    "_reshape_alias", "lift_fresh", "chunk", "narrow", "expand_as", "view_as_real", "is_same_size",
    "_local_scalar_dense", "promote_types", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "size",
}
# Width of the real DeepSeek-V3.2 (attention and indexer only; experts stay few so the CPU copes).
_REAL_WIDTH = {"hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
               "qk_nope_head_dim": 128, "v_head_dim": 128, "index_n_heads": 64, "intermediate_size": 1024,
               "moe_intermediate_size": 256, "index_topk": 2048}


class ModuleStack:
    """The innermost module running now (forward hooks on every module), names with layer numbers folded."""

    def __init__(self, model: torch.nn.Module, label_ranges: bool) -> None:
        self.names: list[str] = ["(model)"]
        self.label_ranges = label_ranges
        self._ranges: list[torch.autograd.profiler.record_function] = []
        for name, module in model.named_modules():
            if name:
                module.register_forward_pre_hook(self._enter(re.sub(r"\.\d+(?=\.|$)", ".L", name)))
                module.register_forward_hook(self._leave)

    def _enter(self, name: str):
        def hook(module, args):
            self.names.append(name)
            if self.label_ranges:
                rf = torch.autograd.profiler.record_function("hearth::" + name)
                rf.__enter__()
                self._ranges.append(rf)
        return hook

    def _leave(self, module, args, output) -> None:
        self.names.pop()
        if self.label_ranges:
            self._ranges.pop().__exit__(None, None, None)

    @property
    def current(self) -> str:
        return self.names[-1]


class OpCounter(TorchDispatchMode):
    """aten ops that launch work, by the module running them (ops inside a Triton launch are the
    interpreter's own and not counted)."""

    def __init__(self, stack: ModuleStack) -> None:
        super().__init__()
        self.stack = stack
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        copies = name not in ("to", "contiguous") or out is not args[0]  # (a no-op conversion returns self)
        if not self.paused and name not in _NO_KERNEL and copies:
            self.counts[self.stack.current][f"aten.{name}"] += 1
        return out


def count_triton_launches(counter: OpCounter) -> None:
    """Wrap the Triton launch paths (compiled and interpreted) to count kernels per module."""
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    for cls in (jit.JITFunction, interpreter.InterpretedFunction):
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            if not kwargs.get("warmup", False):
                fn = getattr(self, "fn", None)
                counter.counts[counter.stack.current][f"triton.{getattr(fn, '__name__', 'kernel')}"] += 1
            counter.paused += 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                counter.paused -= 1

        cls.run = run


def fp8_kernels_on_cpu() -> None:
    """Fp8Linear dequantises on the CPU; run its GPU kernels there too (under the interpreter)."""

    def forward(self: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, weights_checked=True)

    Fp8Linear.forward = forward


def build(arch: str, device: torch.device, real_width: bool, max_len: int):
    """The FP8 kernel-shaped model on ``device`` (bf16, kernel path, fused experts) and its cache."""
    overrides = {**KERNEL_SHAPES, "num_hidden_layers": 3 if arch == "deepseek_v32" else 4,
                 "max_position_embeddings": max_len, **(_REAL_WIDTH if real_width else {})}
    folder = write_tiny_model(Path(tempfile.mkdtemp()) / arch, arch, seed=1, fp8=True, overrides=overrides)
    config = ModelConfig.from_file(folder)
    model = load_checkpoint(folder, device, torch.bfloat16, keep_fp8=True, config=config,
                            attention=AttentionPaths(use_kernels=True))
    fused_experts.enable(model, require_cuda=False)
    cache = PagedCache(config, -(-max_len // BLOCK_SIZE) + 1, BLOCK_SIZE, torch.bfloat16, device, index_fp8=True)
    return model.eval(), cache


def decode_context(cache: PagedCache, table: list[int], positions: list[int], device: torch.device,
                   eager: bool) -> ForwardContext:
    """One decode token per request; all requests share ``table`` (the counts do not depend on it)."""
    if eager:
        return build_context(cache, [(table, p, 1) for p in positions], device)
    b = len(positions)
    pos = torch.tensor(positions, device=device)
    slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions], device=device)
    tables = torch.tensor([table] * b, dtype=torch.int32, device=device)
    lens = (pos + 1).to(torch.int32)
    seqs = [SeqSlice(start=i, q_len=1, context_len=1, slots=slots[i:i + 1]) for i in range(b)]
    return ForwardContext(positions=pos, slot_mapping=slots, seqs=seqs, cache=cache,
                          decode=DecodeMeta(tables, lens, cache.num_blocks * BLOCK_SIZE))


def gpu_kernels_by_module(prof) -> dict[str, Counter]:
    """GPU kernels of a profile, attributed to the innermost ``hearth::`` range that launched them."""
    out: dict[str, Counter] = defaultdict(Counter)
    for event in prof.events():
        kernels = getattr(event, "kernels", None) or []
        if not kernels:
            continue
        owner, parent = "(model)", event
        while parent is not None:
            if parent.name.startswith("hearth::"):
                owner = parent.name.removeprefix("hearth::")
                break
            parent = parent.cpu_parent
        for kernel in kernels:
            out[owner][kernel.name[:60]] += 1
    return out


def report(title: str, counts: dict[str, Counter]) -> None:
    total = sum(sum(c.values()) for c in counts.values())
    print(f"\n{title}: {total} per step")
    for module in sorted(counts, key=lambda m: -sum(counts[m].values())):
        ops = counts[module]
        detail = ", ".join(f"{op} x{n}" for op, n in ops.most_common())
        print(f"  {sum(ops.values()):4d}  {module}: {detail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--arch", default="deepseek_v32", choices=["deepseek_v32", "glm_moe_dsa"])
    parser.add_argument("--context", type=int, default=96, help="tokens already in the cache per request")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--eager", action="store_true", help="the context as ModelRunner.run builds it eagerly")
    parser.add_argument("--real-width", action="store_true", help="DeepSeek-V3.2's attention widths (slow on cpu)")
    args = parser.parse_args()
    device = torch.device(args.device)
    max_len = 1 << (args.context + 64).bit_length()
    model, cache = build(args.arch, device, args.real_width, max_len)
    if device.type == "cpu":
        fp8_kernels_on_cpu()
    table = list(range(-(-max_len // BLOCK_SIZE)))
    ids = torch.arange(3, 3 + args.context, device=device) % model.config.vocab_size
    with torch.inference_mode():
        model(ids, build_context(cache, [(table, 0, args.context)], device))  # fill the cache (prefill)
        positions = [args.context] * args.batch
        tokens = torch.full((args.batch,), 5, device=device)
        model(tokens, decode_context(cache, table, positions, device, args.eager))  # warm up (compiles)
        stack = ModuleStack(model, label_ranges=device.type == "cuda")
        counter = OpCounter(stack)
        count_triton_launches(counter)
        ctx = decode_context(cache, table, positions, device, args.eager)
        if device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, counter:
                model(tokens, ctx)
                torch.cuda.synchronize()
        else:
            with counter:
                model(tokens, ctx)
    path = "eager (build_context)" if args.eager else "graph path (DecodeMeta)"
    print(f"{args.arch}, {path}, batch {args.batch}, context {args.context}, {args.device}")
    report("aten ops + Triton launches", counter.counts)
    if device.type == "cuda":
        report("GPU kernels (profiler)", gpu_kernels_by_module(prof))


if __name__ == "__main__":
    main()
