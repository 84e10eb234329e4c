"""Runahead decoding: requests whose experts are resident run ahead to later layers while others
wait for their expert fetches.

Each decoding request has one token "in flight" at some (layer, phase). A micro-step picks one
(layer, phase) group and runs, as one batch, the requests waiting there that are ready:
- phase "attn": input norm + attention (+ indexer) + residual, post-attention norm; a dense layer's
  MLP runs right away, an MoE layer routes and asks the expert cache for the chosen experts
  (fetches start on the copy stream; the lease keeps them from being evicted until used);
- phase "moe": routed experts from the leased cache slots + shared experts + residual, for the
  requests whose fetches have landed.
A request that finishes its last layer gets logits; the engine samples and starts its next token at
layer 0 at once, without waiting for the others. So the link only carries experts that requests
really need, while the GPU computes the requests that are ready.

Choice of group: the group holding the most lagging ready request (fewest layers done in total),
which bounds every request's wait: nothing overtakes a ready request forever. All requests ready
at that (layer, phase) join the batch, so shared weights are read once. With every expert resident
this is plain layer-by-layer batching.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from hearth.engine.kv_cache import ForwardContext, PagedCache, SeqSlice, slots_for
from hearth.engine.models.deepseek import DeepseekForCausalLM


class Residency(Protocol):
    """What runahead needs from an expert cache."""

    def acquire(self, layer: int, experts: list[int]):  # -> lease, or raises when the pool is full
        ...

    def is_ready(self, lease) -> bool: ...

    def wait_any(self, leases: list) -> None:
        """Block until at least one of the leases may have become ready."""

    def release(self, lease) -> None: ...

    def compute(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                leases: list) -> torch.Tensor:
        """Routed experts of x (T, D) given (T, K) ids/weights, row t served from leases[t]."""


@dataclass
class Flight:
    """One request's current token on its way through the layers."""

    request_id: str
    position: int
    block_table: list[int]
    hidden: torch.Tensor  # (1, D) residual stream
    layer: int = 0
    phase: str = "attn"
    normed: torch.Tensor | None = None
    routing: tuple[torch.Tensor, torch.Tensor] | None = None
    lease: object | None = None
    selection: torch.Tensor | None = None  # last full indexer layer's top-k, for shared layers
    tokens_done: int = 0  # tokens this request finished before (for lagging-first priority)
    seq_slice: SeqSlice | None = None  # the token's cache slots, built once and reused by every layer

    def progress(self, num_layers: int) -> int:
        return self.tokens_done * num_layers + self.layer


class RunaheadDecoder:
    """Holds the flights and runs one micro-step at a time (see the module docstring)."""

    def __init__(self, model: DeepseekForCausalLM, cache: PagedCache, residency: Residency | None,
                 device: torch.device) -> None:
        self.model = model
        self.cache = cache
        self.residency = residency
        self.device = device
        self.flights: dict[str, Flight] = {}
        self.num_layers = model.config.num_hidden_layers
        self.micro_steps = 0

    def start(self, request_id: str, token_id: int, position: int, block_table: list[int], tokens_done: int) -> None:
        """Put a request's next token in flight at layer 0."""
        ids = torch.tensor([token_id], dtype=torch.long, device=self.device)
        self.flights[request_id] = Flight(request_id, position, block_table, self.model.embed(ids),
                                          tokens_done=tokens_done)

    def drop(self, request_id: str) -> None:
        """Forget a request (finished, aborted or preempted), releasing any expert lease it holds."""
        flight = self.flights.pop(request_id, None)
        if flight is not None and flight.lease is not None and self.residency is not None:
            self.residency.release(flight.lease)

    def __len__(self) -> int:
        return len(self.flights)

    @torch.inference_mode()
    def step(self) -> list[tuple[str, torch.Tensor]]:
        """One micro-step; returns (request_id, logits (vocab,)) of requests that finished a token."""
        self._try_acquire()
        group = self._pick_group()
        if not group:
            waiting = [f.lease for f in self.flights.values() if f.lease is not None]
            if self.residency is not None and waiting:
                self.residency.wait_any(waiting)
            return []
        self.micro_steps += 1
        if group[0].phase == "attn":
            self._run_attention(group)
        else:
            self._run_moe(group)
        return self._finish_tokens(group)

    # ---- choosing ---------------------------------------------------------------------------

    def _is_ready(self, flight: Flight) -> bool:
        if flight.phase == "attn" or self.residency is None:
            return True
        return flight.lease is not None and self.residency.is_ready(flight.lease)

    def _pick_group(self) -> list[Flight]:
        ready = [f for f in self.flights.values() if self._is_ready(f)]
        if not ready:
            return []
        lagging = min(ready, key=lambda f: (f.progress(self.num_layers), f.phase != "moe"))
        return [f for f in ready if f.layer == lagging.layer and f.phase == lagging.phase]

    def _try_acquire(self) -> None:
        """Ask the cache for experts of requests that routed but could not get slots yet."""
        if self.residency is None:
            return
        # Fetch order follows the plan: the most lagging request's experts go on the link first.
        waiting = [f for f in self.flights.values() if f.phase == "moe" and f.lease is None]
        for flight in sorted(waiting, key=lambda f: f.progress(self.num_layers)):
            flight.lease = self._acquire(flight)

    def _acquire(self, flight: Flight):
        experts = list(dict.fromkeys(flight.routing[0].flatten().tolist()))
        try:
            return self.residency.acquire(flight.layer, experts)
        except RuntimeError:  # pool full of experts other requests hold: retry after they run
            return None

    # ---- running ----------------------------------------------------------------------------

    def _slice(self, flight: Flight, start: int) -> SeqSlice:
        if flight.seq_slice is None:
            slots = slots_for(flight.block_table, flight.position + 1, self.cache.block_size, self.device)
            table = torch.tensor(flight.block_table, dtype=torch.int32, device=self.device)
            flight.seq_slice = SeqSlice(start=0, q_len=1, context_len=flight.position + 1, slots=slots,
                                        block_table=table, seq_id=flight.request_id)
        return dataclasses.replace(flight.seq_slice, start=start)

    def _context(self, group: list[Flight]) -> ForwardContext:
        seqs = [self._slice(flight, i) for i, flight in enumerate(group)]
        positions = [flight.position for flight in group]
        positions_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        slot_mapping = torch.stack([s.slots[-1] for s in seqs])
        ctx = ForwardContext(positions=positions_t, slot_mapping=slot_mapping, seqs=seqs, cache=self.cache)
        if all(f.selection is not None for f in group):
            ctx.selections = {i: f.selection for i, f in enumerate(group)}
        return ctx

    def _run_attention(self, group: list[Flight]) -> None:
        layer = self.model.layers[group[0].layer]
        ctx = self._context(group)
        hidden = layer.attend(torch.cat([f.hidden for f in group]), ctx)
        normed = layer.ffn_input(hidden)
        routing = layer.route(normed)
        for i, flight in enumerate(group):
            flight.selection = ctx.selections.get(i, flight.selection)
            flight.hidden = hidden[i:i + 1]
            if routing is None:
                flight.hidden = layer.ffn(flight.hidden, normed[i:i + 1], None)
                self._advance(flight)
                continue
            flight.normed = normed[i:i + 1]
            flight.routing = (routing[0][i:i + 1], routing[1][i:i + 1])
            flight.phase = "moe"
            if self.residency is not None:
                flight.lease = self._acquire(flight)

    def _run_moe(self, group: list[Flight]) -> None:
        layer = self.model.layers[group[0].layer]
        x = torch.cat([f.normed for f in group])
        ids = torch.cat([f.routing[0] for f in group])
        weights = torch.cat([f.routing[1] for f in group])
        if self.residency is None:
            out = layer.mlp(x, ids, weights)
        else:
            out = self.residency.compute(layer.layer, x, ids, weights, [f.lease for f in group])
            if layer.mlp.shared_experts is not None:
                out = out + layer.mlp.shared_experts(x)
            for flight in group:
                self.residency.release(flight.lease)
        for i, flight in enumerate(group):
            flight.hidden = flight.hidden + out[i:i + 1]
            self._advance(flight)

    def _advance(self, flight: Flight) -> None:
        flight.layer += 1
        flight.phase = "attn"
        flight.normed = flight.routing = flight.lease = None

    def _finish_tokens(self, group: list[Flight]) -> list[tuple[str, torch.Tensor]]:
        done = [f for f in group if f.layer == self.num_layers]
        if not done:
            return []
        logits = self.model.logits(torch.cat([f.hidden for f in done]))
        for flight in done:
            del self.flights[flight.request_id]
        return [(f.request_id, logits[i]) for i, f in enumerate(done)]

