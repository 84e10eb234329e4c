"""Residency of a host pool's rows in a device cache, planned on the device.

A "row" is a fixed-size record of a pool in host memory (a page of indexer keys, 64 x 132 bytes; a
latent row, 576 bf16). The device holds a combined buffer: ``ring`` rows (the most recent ids, at
slot ``id % ring``, managed by the caller) followed by ``slots`` cache rows. One decode step names
up to C distinct candidate ids (-1 = none); ``plan_residency`` (one program) maps each to a slot of
the combined buffer:

- an id >= ``ring_start`` is in the ring: slot ``id % ring``;
- an id whose row is cached (``slot_of[id] >= 0``) is a hit: ``ring + slot_of[id]``;
- a miss takes a cache slot that holds no hit of this step, in clock order from a moving hand (a
  FIFO that never evicts what the step reads; rows read every step stay), and is listed for
  ``gather_misses``, which copies it from the host pool into its slot.

Reading host memory from a kernel: the host pool is pinned (``cudaHostAlloc`` through torch's
``pin_memory``), which under unified virtual addressing is mapped into the device's address space
at the same address. Triton's launcher turns a tensor argument into a pointer by calling its
``data_ptr()`` and then ``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)``, which
succeeds for mapped pinned memory (it rejects only pageable memory: "cannot be accessed from Triton
(cpu tensor?)"), so the pinned CPU tensor is passed as it is and the gather kernel's loads go over
the link (zero-copy). Under ``TRITON_INTERPRET=1`` every tensor is a CPU tensor and the same
kernels run.

State (all int32 on the device, owned by the caller, created by ``ResidencyPlan.new``): ``slot_of``
[capacity] (cache slot of each id, -1), ``owner`` [slots] (id in each slot, -1), ``hit_stamp``
[slots] (step stamp of the last hit, protects slots within a step), ``victims`` [slots] (scratch),
``clock`` [2] (hand, step stamp). Outputs per step: ``slot`` [C] (combined-buffer slot, -1 for no
id), ``miss_src`` / ``miss_dst`` [C] (host row, combined-buffer row; the first ``n_miss`` valid),
``n_miss`` [1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hearth.kernels._utils import check_tensor, require


@triton.jit
def plan_step(
    cand_ptr,
    ring_start,
    slot_of_ptr,
    owner_ptr,
    stamp_ptr,
    victims_ptr,
    clock_ptr,
    slot_ptr,
    miss_src_ptr,
    miss_dst_ptr,
    n_miss_ptr,
    C,
    SLOTS,
    RING,
    C_P2: tl.constexpr,
    S_CHUNK: tl.constexpr,
):
    """The plan of one step (module doc) for the C ids at cand_ptr, ring ids those >= ring_start
    (a scalar): one program; also the tail of the tiered keys' candidate kernel. The free slots are
    looked for S_CHUNK at a time from the hand, only until there are as many as misses (a decode step
    misses a few of thousands of slots)."""
    o_c = tl.arange(0, C_P2)
    m_c = o_c < C
    b_id = tl.load(cand_ptr + o_c, mask=m_c, other=-1)
    m_valid = m_c & (b_id >= 0)
    m_ring = m_valid & (b_id >= ring_start)
    m_cold = m_valid & (b_id < ring_start)
    b_old_slot = tl.load(slot_of_ptr + b_id, mask=m_cold, other=-1)
    m_hit = m_cold & (b_old_slot >= 0)
    m_miss = m_cold & (b_old_slot < 0)
    hand = tl.load(clock_ptr)
    stamp = tl.load(clock_ptr + 1) + 1
    b_miss_rank = tl.cumsum(m_miss.to(tl.int32), 0) - 1
    n_miss = tl.sum(m_miss.to(tl.int32), 0)
    # 1. protect the slots this step hits
    tl.store(stamp_ptr + b_old_slot, tl.zeros([C_P2], dtype=tl.int32) + stamp, mask=m_hit)
    tl.debug_barrier()
    # 2. the first n_miss free slots in clock order from the hand: victims[r] = r-th free slot (there
    # are enough: slots >= candidates >= hits + misses)
    found = n_miss * 0
    start = n_miss * 0
    while (found < n_miss) & (start < SLOTS):
        o_s = start + tl.arange(0, S_CHUNK)
        m_s = o_s < SLOTS
        o_rot = (hand + o_s) % SLOTS
        m_free = m_s & (tl.load(stamp_ptr + o_rot, mask=m_s, other=0) != stamp)
        b_rank = found + tl.cumsum(m_free.to(tl.int32), 0) - 1
        tl.store(victims_ptr + b_rank, o_rot, mask=m_free & (b_rank < n_miss))
        found += tl.sum(m_free.to(tl.int32), 0)
        start += S_CHUNK
    tl.debug_barrier()
    # 3. the r-th miss takes the r-th free slot; its previous row is forgotten
    b_new = tl.load(victims_ptr + b_miss_rank, mask=m_miss, other=0)
    b_evicted = tl.load(owner_ptr + b_new, mask=m_miss, other=-1)
    tl.store(slot_of_ptr + b_evicted, tl.full([C_P2], -1, dtype=tl.int32), mask=m_miss & (b_evicted >= 0))
    tl.debug_barrier()
    tl.store(slot_of_ptr + b_id, b_new, mask=m_miss)
    tl.store(owner_ptr + b_new, b_id, mask=m_miss)
    b_last = tl.load(victims_ptr + tl.maximum(n_miss - 1, 0))
    tl.store(clock_ptr, tl.where(n_miss > 0, (b_last + 1) % SLOTS, hand))
    tl.store(clock_ptr + 1, stamp)
    # 4. outputs
    b_slot = tl.where(m_ring, b_id % RING, tl.where(m_hit, b_old_slot + RING, tl.where(m_miss, b_new + RING, -1)))
    tl.store(slot_ptr + o_c, b_slot, mask=m_c)
    tl.store(miss_src_ptr + b_miss_rank, b_id, mask=m_miss)
    tl.store(miss_dst_ptr + b_miss_rank, b_new + RING, mask=m_miss)
    tl.store(n_miss_ptr, n_miss)


@triton.jit
def ring_start_of(written, UNIT: tl.constexpr, ring):
    """First id held in a ring of the `ring` most recent ids once `written` items are written, UNIT
    items an id (a page of UNIT tokens; 1: the items are the ids)."""
    return tl.maximum((written + UNIT - 1) // UNIT - ring, 0)


@triton.jit
def _plan_kernel(
    cand_ptr,
    bound_ptr,
    slot_of_ptr,
    owner_ptr,
    stamp_ptr,
    victims_ptr,
    clock_ptr,
    slot_ptr,
    miss_src_ptr,
    miss_dst_ptr,
    n_miss_ptr,
    C,
    SLOTS,
    RING,
    UNIT: tl.constexpr,
    RING_FROM_WRITTEN: tl.constexpr,
    C_P2: tl.constexpr,
    S_CHUNK: tl.constexpr,
):
    if RING_FROM_WRITTEN:
        ring_start = ring_start_of(tl.load(bound_ptr), UNIT, RING)
    else:
        ring_start = tl.load(bound_ptr)
    plan_step(cand_ptr, ring_start, slot_of_ptr, owner_ptr, stamp_ptr, victims_ptr, clock_ptr, slot_ptr,
              miss_src_ptr, miss_dst_ptr, n_miss_ptr, C, SLOTS, RING, C_P2, S_CHUNK)


@triton.jit
def _gather_kernel(
    host_ptr,
    dev_ptr,
    miss_src_ptr,
    miss_dst_ptr,
    n_miss_ptr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (p, j) copies words [j * BLOCK, (j + 1) * BLOCK) of rows src_rows[i] of one buffer into
    rows dst_rows[i] of the other for i = p, p + P, ... below n_miss (P programs: the i-th miss from
    the mapped host pool into its device row; a written-through row the other way: loads or stores
    over the link). A grid of at most GATHER_PROGRAMS rows of programs, not one per possible miss: a
    decode step has a few misses, and thousands of programs that only read n_miss cost a wave."""
    o_w = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m_w = o_w < ROW
    for i_m in range(tl.program_id(0), tl.load(n_miss_ptr), tl.num_programs(0)):
        src = tl.load(miss_src_ptr + i_m).to(tl.int64)
        dst = tl.load(miss_dst_ptr + i_m).to(tl.int64)
        b_w = tl.load(host_ptr + src * ROW + o_w, mask=m_w)
        tl.store(dev_ptr + dst * ROW + o_w, b_w, mask=m_w)


SLOT_CHUNK = 512  # free cache slots looked at a round of a plan (a decode step's misses are fewer)


def slot_chunk(slots: int) -> int:
    """The plan's S_CHUNK for a cache of ``slots`` slots."""
    return min(triton.next_power_of_2(slots), SLOT_CHUNK)


GATHER_PROGRAMS = 128  # rows of programs of a gather: about one per SM, each loops over its misses


@dataclass
class ResidencyPlan:
    """Residency state of one host pool behind one device cache (see the module doc), and the
    per-step outputs (reused every step: fixed addresses for CUDA graphs)."""

    slot_of: torch.Tensor  # [capacity] int32
    owner: torch.Tensor  # [slots] int32
    hit_stamp: torch.Tensor  # [slots] int32
    victims: torch.Tensor  # [slots] int32 scratch
    clock: torch.Tensor  # [2] int32: hand, step stamp
    slot: torch.Tensor  # [C] int32 output
    miss_src: torch.Tensor  # [C] int32 output
    miss_dst: torch.Tensor  # [C] int32 output
    n_miss: torch.Tensor  # [1] int32 output
    ring: int

    @classmethod
    def new(cls, capacity: int, slots: int, candidates: int, ring: int, device: torch.device,
            ring_entries: int = 0) -> ResidencyPlan:
        """State for steps naming up to `candidates` cold ids plus up to `ring_entries` ring ids (a
        ring id never misses, so only the cold ones need free slots)."""
        require(slots >= candidates >= 1, f"need slots ({slots}) >= candidates ({candidates}) >= 1")
        require(ring >= 1 and ring_entries >= 0, f"need ring >= 1 and ring_entries >= 0, got {ring}, {ring_entries}")

        def full(n: int, value: int) -> torch.Tensor:
            return torch.full((n,), value, dtype=torch.int32, device=device)

        return cls(full(capacity, -1), full(slots, -1), full(slots, 0), full(slots, 0), full(2, 0),
                   full(candidates + ring_entries, -1), full(candidates, 0), full(candidates, 0), full(1, 0), ring)

    @property
    def num_slots(self) -> int:
        return int(self.owner.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.slot_of.shape[0])

    def grow(self, capacity: int) -> None:
        """Room for ids below capacity (a new tensor: call outside a captured step)."""
        if capacity > self.capacity:
            new = torch.full((capacity,), -1, dtype=torch.int32, device=self.slot_of.device)
            new[: self.capacity] = self.slot_of
            self.slot_of = new

    def device_bytes(self) -> int:
        return sum(t.numel() * 4 for t in (self.slot_of, self.owner, self.hit_stamp, self.victims, self.clock,
                                            self.slot, self.miss_src, self.miss_dst, self.n_miss))


def plan_residency(plan: ResidencyPlan, candidates: torch.Tensor, ring_start: torch.Tensor | None = None, *,
                   written: torch.Tensor | None = None, unit: int = 1) -> torch.Tensor:
    """Map a step's candidate ids to combined-buffer slots and list the misses (module doc).

    candidates: [C] int32, distinct ids < plan.capacity or -1 (C = plan.slot.shape[0]). The ring
    holds the ids from ring_start ([1] int32) on, or, given written instead ([1] int32: items written,
    `unit` items an id, e.g. tokens of pages of `unit` tokens), the plan.ring most recent ids:
    from max(ceil(written / unit) - ring, 0). Returns plan.slot ([C] int32). No host sync."""
    dev = plan.slot.device
    n_cand = plan.slot.shape[0]
    require((ring_start is None) != (written is None), "pass exactly one of ring_start and written")
    bound = ring_start if written is None else written
    check_tensor("candidates", candidates, dtypes=(torch.int32,), shape=(n_cand,), device=dev)
    check_tensor("ring_start" if written is None else "written", bound, dtypes=(torch.int32,), shape=(1,), device=dev)
    require(unit >= 1, f"unit must be >= 1, got {unit}")
    _plan_kernel[(1,)](
        candidates, bound, plan.slot_of, plan.owner, plan.hit_stamp, plan.victims, plan.clock,
        plan.slot, plan.miss_src, plan.miss_dst, plan.n_miss, n_cand, plan.num_slots, plan.ring,
        UNIT=unit, RING_FROM_WRITTEN=written is not None,
        C_P2=triton.next_power_of_2(n_cand), S_CHUNK=slot_chunk(plan.num_slots), num_warps=8,
    )
    return plan.slot


def row_words(t: torch.Tensor) -> torch.Tensor:
    """A 2-D row buffer as [rows, words]: int32 words when a row's bytes allow, else bytes."""
    raw = t.view(t.shape[0], -1).view(torch.uint8)
    return raw.view(torch.int32) if raw.shape[1] % 4 == 0 else raw


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor,
              count: torch.Tensor) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for i < count[0]: row indices (C,) int32 and count (1,) int32
    on the device, so a step can copy rows it chose on the device (a decode token's page or latent
    row written through to the pinned host pool, read in place on CUDA as ``gather_misses`` reads it).
    One launch of a fixed grid (``GATHER_PROGRAMS`` rows of programs at most). No host sync."""
    require(src.dtype == dst.dtype and src.shape[1:] == dst.shape[1:], "source and destination rows must match")
    require(src.is_contiguous() and dst.is_contiguous(), "row buffers must be contiguous")
    if src.is_cuda or dst.is_cuda:
        for t in (src, dst):
            require(t.is_cuda or t.is_pinned(), "a host row buffer must be pinned CPU memory")
    a, b = row_words(src), row_words(dst)
    row = a.shape[1]
    block = min(1024, triton.next_power_of_2(row))
    grid = (min(src_rows.shape[0], GATHER_PROGRAMS), triton.cdiv(row, block))
    _gather_kernel[grid](a, b, src_rows, dst_rows, count, ROW=row, BLOCK=block, num_warps=4)


def gather_misses(plan: ResidencyPlan, host: torch.Tensor, dev: torch.Tensor) -> None:
    """Copy the planned misses' rows: host [capacity, ...] (pinned CPU tensor on CUDA, read in place by
    the kernel; any CPU tensor under the interpreter) -> dev [ring + slots, ...] (same row layout).
    One launch of a fixed grid (``copy_rows``). No host sync."""
    if dev.is_cuda:
        require(host.device.type == "cpu" and host.is_pinned(), "the host pool must be pinned CPU memory")
    copy_rows(host, dev, plan.miss_src, plan.miss_dst, plan.n_miss)
