"""How fast a chat's cache pages leave the device and come back: from host RAM (a chat switch) and
from disk (an engine restart), through the engine's own ``PageTier`` and ``PrefixStore``.

The pages have DeepSeek-V3.2's real widths for a 1 dense + 2 MoE layer checkpoint (``bench_e2e``'s):
per token and layer a 576-value latent in the cache dtype and, on the kernel path (CUDA), a 132-byte
FP8 indexer key (bf16 128-value keys elsewhere); 64-token pages. ``--pages 1024`` is a 64K-token chat.

Stages, each timed to the end of its copies (``torch.cuda.synchronize``):
  spill          the pages leave the device cache into host RAM (what the GPU does when it reuses them);
  restore RAM    they come back into other device pages (the follow-up turn after a chat switch);
  flush          RAM to segment files (the engine stopping);
  scan           a new store on the folder reads the segment headers (the engine starting);
  restore disk   the pages come back from the files, dropped from the OS file cache first
                 (``posix_fadvise``, where the OS has it), as after a restart.
Every restore is checked byte for byte against the pages spilled.

    python bench/bench_chat_cache.py [--pages 1024] [--device cuda] [--reps 3] [--dir /path/on/the/disk]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hearth.engine.config import ModelConfig
from hearth.engine.kv_cache import PagedCache
from hearth.engine.prefix_store import PageTier, PrefixStore

BLOCK_SIZE = 64


def deepseek_v32_config() -> ModelConfig:
    """DeepSeek-V3.2's attention widths, 3 layers (the cache needs nothing else)."""
    return ModelConfig.from_dict(dict(
        model_type="deepseek_v32", vocab_size=129280, num_hidden_layers=3, first_k_dense_replace=1,
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
        index_n_heads=64, index_head_dim=128, index_topk=2048, scoring_func="sigmoid", topk_method="noaux_tc",
        norm_topk_prob=True, routed_scaling_factor=2.5, rope_theta=10000.0, max_position_embeddings=163840,
        eos_token_id=1, bos_token_id=0))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def drop_file_cache(folder: Path) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def fill(cache: PagedCache) -> None:
    gen = torch.Generator(device="cpu").manual_seed(0)
    for tensor in cache.latent + cache.index_keys:
        if tensor is not None:
            raw = tensor.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def pages_equal(cache: PagedCache, src: list[int], dst: list[int]) -> bool:
    return torch.equal(cache.read_pages(src, pin=False), cache.read_pages(dst, pin=False))


def run_once(args: argparse.Namespace, device: torch.device, folder: Path, rep: int) -> dict[str, float]:
    n = args.pages
    cache = PagedCache(deepseek_v32_config(), 2 * n, BLOCK_SIZE, torch.bfloat16, device,
                       index_fp8=device.type == "cuda")
    fill(cache)
    store = PrefixStore(cache.page_bytes, 4 * n * cache.page_bytes, folder=folder, disk_bytes=1 << 40,
                        fingerprint_="bench", key=f"bench{rep}")
    tier = PageTier(cache, store)
    hashes = [(rep << 32) + i + 1 for i in range(n)]
    chat, other = list(range(n)), list(range(n, 2 * n))
    out = {"page_bytes": cache.page_bytes}
    out["spill"] = timed(device, lambda: tier.spill([(b, h, frozenset({"chat"})) for b, h in zip(chat, hashes)]))
    out["restore_ram"] = timed(device, lambda: tier.restore(list(zip(hashes, other))))
    assert pages_equal(cache, chat, other), "the pages restored from RAM differ"
    out["flush"] = timed(device, store.flush)
    out["uncached"] = drop_file_cache(folder)
    reopened: list[PrefixStore] = []
    out["scan"] = timed(device, lambda: reopened.append(PrefixStore(
        cache.page_bytes, 4 * n * cache.page_bytes, folder=folder, disk_bytes=1 << 40, fingerprint_="bench",
        key=f"bench{rep}")))
    cache.write_pages(other, torch.zeros(n, cache.page_bytes, dtype=torch.uint8))
    tier = PageTier(cache, reopened[0])
    restored: list[list] = []
    out["restore_disk"] = timed(device, lambda: restored.append(tier.restore(list(zip(hashes, other)))))
    assert len(restored[0]) == n and pages_equal(cache, chat, other), "the pages restored from disk differ"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=1024, help="pages of 64 tokens (1024: a 64K-token chat)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the segment files go (a temporary folder)")
    args = parser.parse_args()
    device = torch.device(args.device)
    runs = []
    with tempfile.TemporaryDirectory(prefix="hearth-bench-chat-cache-", dir=args.dir) as root:
        for rep in range(args.reps + 1):  # the first run warms up allocators and the thread pool
            runs.append(run_once(args, device, Path(root) / f"run{rep}", rep))
    runs = runs[1:]
    page_bytes = runs[0]["page_bytes"]
    total = args.pages * page_bytes
    print(f"{args.pages} pages of {page_bytes:,} bytes ({total / 1e6:.0f} MB) on {device}, median of {args.reps}; "
          f"files {'dropped from' if runs[0]['uncached'] else 'left in'} the OS file cache before the disk restore")
    for stage in ("spill", "restore_ram", "flush", "scan", "restore_disk"):
        seconds = statistics.median(run[stage] for run in runs)
        rate = "" if stage == "scan" else f"  {total / seconds / 1e9:6.2f} GB/s"
        print(f"  {stage:13s} {seconds * 1e3:8.1f} ms{rate}")


if __name__ == "__main__":
    main()
