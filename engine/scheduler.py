"""Continuous-batching scheduler: decides which requests run in the next step and how many of
their tokens. A policy over request objects; it never touches tensors.

Each step: every running request that has finished its prompt decodes one token; requests still
in their prompt get the next chunk (chunked prefill) from the remaining token budget; then waiting
requests are admitted in arrival order while cache blocks, the sequence limit and the budget
allow. When a decoding request's cache page cannot grow, the most recently admitted request is
preempted (its pages freed; it re-enters the queue and recomputes its tokens later).

Requests whose state partly lives outside the pages (tiered keys and latents) are admitted through
``PrefixStates`` (``hearth.engine.tier_cache``): a parked state of an earlier turn may cover the
prompt's start, which then counts as cached like a prefix-cache hit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from hearth.engine.api import SamplingParams
from hearth.engine.block_manager import BlockManager


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """A request as the scheduler sees it: all its tokens and how many are in the cache."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose cache entries are written
    num_cached_prefix: int = 0  # prompt tokens served from the prefix cache
    conversation: str | None = None  # tags its cache pages (hearth.engine.prefix_store)
    status: Status = Status.WAITING

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """``token_ids[start:stop]`` without building the whole prompt + output list (a decode step
        needs one token of a prompt that may be thousands long)."""
        prompt = len(self.prompt_ids)
        if start >= prompt:
            return self.output_ids[start - prompt:stop - prompt]
        if stop <= prompt:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[:stop - prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_tokens - 1


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens of this sequence computed in the step, starting at seq.num_computed


class PrefixStates(Protocol):
    """Per-request state kept outside the pages between requests (``hearth.engine.tier_cache``)."""

    def match(self, seq: Sequence) -> int:
        """How many leading tokens of seq a kept state could serve (0: none); takes nothing."""

    def adopt(self, seq: Sequence, offered: int, paged_hit: int) -> int:
        """Start seq from a kept state: ``offered`` as ``match`` said, ``paged_hit`` the tokens the
        pages served (``BlockManager.allocate`` capped at ``offered``). Returns the tokens seq
        starts with (its cached prefix)."""


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 states: PrefixStates | None = None) -> None:
        """states: where requests with state outside the pages find their cached prefix (then the
        pages serve at most what it covers)."""
        self.blocks = blocks
        self.states = states
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.on_preempt: list = []  # callbacks(seq) of executors holding per-request state

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, include_decodes: bool = True, busy: Container[str] = ()) -> list[ScheduledChunk]:
        """The next step's work. include_decodes=False leaves decoding requests to another
        executor (runahead) and schedules prompt chunks only; ``busy``: ids of requests whose next
        token that executor is still computing (they are left to it). That executor takes a request
        only once it has a sampled token, so without decodes every uncomputed token of a request it
        does not hold is read here: a prompt whose last chunk left exactly one token (or a preempted
        request recomputed up to its last token) would otherwise never be read by anyone."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for seq in list(self.running) if include_decodes else []:
            if seq not in self.running:
                continue  # preempted below while making room for an earlier request
            if seq.in_prefill or seq.request_id in busy:
                continue
            if not self.make_room(seq) or budget < 1:
                continue
            chunks.append(ScheduledChunk(seq, 1))
            budget -= 1
        for seq in self.running:
            orphan = not include_decodes and seq.num_computed < seq.num_tokens and seq.request_id not in busy
            if (seq.in_prefill or orphan) and budget > 0:
                n = min(budget, seq.num_tokens - seq.num_computed)
                chunks.append(ScheduledChunk(seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.popleft()
            seq.num_computed = seq.num_cached_prefix
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(budget, seq.num_tokens - seq.num_computed)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return chunks

    def _admit(self, seq: Sequence) -> bool:
        """Allocate seq's pages and set its cached prefix, if the pages it needs are free."""
        offered = self.states.match(seq) if self.states is not None else None
        if not self.blocks.can_allocate(seq.token_ids, offered):
            return False
        hit = self.blocks.allocate(seq.request_id, seq.token_ids, seq.conversation, offered)
        seq.num_cached_prefix = hit if self.states is None else self.states.adopt(seq, offered, hit)
        return True

    def make_room(self, seq: Sequence) -> bool:
        """Ensure seq's block table covers its newest token, preempting later requests if needed."""
        while self.blocks.num_tokens(seq.request_id) < seq.num_tokens:
            missing = seq.token_slice(self.blocks.num_tokens(seq.request_id), seq.num_tokens)
            if self.blocks.can_append(seq.request_id, len(missing)):
                self.blocks.append(seq.request_id, missing)
                return True
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free seq's pages and put it back at the head of the queue; it recomputes later. The
        callbacks see seq's ``num_computed`` before it is reset (what its kept state covers)."""
        self.blocks.free(seq.request_id)
        self.running.remove(seq)
        seq.status = Status.WAITING
        for callback in self.on_preempt:
            callback(seq)
        seq.num_computed = 0
        self.waiting.appendleft(seq)

    def after_step(self, chunks: list[ScheduledChunk]) -> None:
        """Record what the step computed (so full pages become reusable prefixes)."""
        for chunk in chunks:
            chunk.seq.num_computed += chunk.num_tokens
            if chunk.seq.status is Status.RUNNING:
                self.blocks.mark_computed(chunk.seq.request_id, chunk.seq.num_computed)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.request_id)
        seq.status = Status.FINISHED
