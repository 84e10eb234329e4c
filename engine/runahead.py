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

Progress is counted in *rounds* (the decoder's own token count, shared by all requests: a request
joins at the round of the most lagging one) times layers plus the layer, so a request that joined
late is not treated as lagging for its whole life.

Choice of group: the group holding the most lagging ready request, which bounds every request's
wait: nothing overtakes a ready request forever. All requests ready at that (layer, phase) join the
batch, so shared weights are read once. With every expert resident this is plain layer-by-layer
batching.

Cache cooperation:
- *Lead bound*: a request may start a layer only while it is fewer than ``max_lead`` layers ahead of
  the most lagging request (default: one token). With the default, every layer's expert pool sees
  the requests' tokens in round order, as the layer-synchronous scheduler does, so a request running
  ahead cannot evict the experts a lagging one is about to use for the same token.
- *Eviction plan*: before any acquisition at a layer, the residency is told which experts of that
  layer requests still expect to use there: tier 2 for experts of requests that routed and wait for
  cache room (leased experts are pinned by their reference counts anyway), tier 1 for the experts
  each request that has not reached the layer yet used there on its previous token (a sequence
  reuses experts across nearby tokens). Eviction takes tier 0 first, then 1, then 2.
- *Fetch order*: acquisitions go lagging-first, so the copy stream carries the most lagging
  request's experts first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from hearth.engine.kv_cache import ForwardContext, PagedCache, SeqSlice, slots_for
from hearth.engine.models.deepseek import DeepseekForCausalLM

NEEDED, PREDICTED = 2, 1  # eviction-plan tiers (0: nobody expects the expert)


class Residency(Protocol):
    """What runahead needs from an expert cache."""

    def plan(self, layer: int, tiers: dict[int, int]) -> None:
        """Experts of ``layer`` that requests still expect to use there, expert -> tier (1 or 2);
        eviction in that layer takes unlisted experts first, then tier 1, then tier 2. Replaces the
        layer's previous plan; called before every acquisition in the layer."""

    def acquire(self, layer: int, experts: list[int]):  # -> lease, or raises when the pool is full
        ...

    def is_ready(self, lease) -> bool: ...

    def wait_any(self, leases: list) -> None:
        """Block until at least one of the leases (the first ones matter most) may have become ready."""

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
    round: int  # the decoder's token round of this token (comparable across requests)
    layer: int = 0
    phase: str = "attn"
    normed: torch.Tensor | None = None
    routing: tuple[torch.Tensor, torch.Tensor] | None = None
    experts: list[int] | None = None  # distinct routed experts of the current layer, once routed
    lease: object | None = None
    selection: torch.Tensor | None = None  # last full indexer layer's top-k, for shared layers
    seq_slice: SeqSlice | None = None  # the token's cache slots, built once and reused by every layer

    def progress(self, num_layers: int) -> int:
        return self.round * num_layers + self.layer

    def before(self, layer: int) -> bool:
        """Has this token not yet used ``layer``'s experts?"""
        return self.layer < layer or (self.layer == layer and self.phase == "attn")


class RunaheadDecoder:
    """Holds the flights and runs one micro-step at a time (see the module docstring).

    ``max_lead``: how many layers a request may be ahead of the most lagging one when it starts a
    layer (None: one token, ``num_hidden_layers``). Smaller keeps requests closer together; larger
    lets them run further ahead at the risk of evicting experts lagging requests still need.
    """

    def __init__(self, model: DeepseekForCausalLM, cache: PagedCache, residency: Residency | None,
                 device: torch.device, max_lead: int | None = None) -> None:
        self.model = model
        self.cache = cache
        self.residency = residency
        self.device = device
        self.flights: dict[str, Flight] = {}
        self.num_layers = model.config.num_hidden_layers
        self.max_lead = max_lead or self.num_layers
        if self.max_lead < 1:
            raise ValueError(f"max_lead must be at least 1 layer, got {max_lead}")
        self.micro_steps = 0
        self.max_lead_seen = 0  # the largest lead (in layers) a request started a layer with
        self._next_round: dict[str, int] = {}  # request -> round of its next token
        self._used: dict[str, dict[int, list[int]]] = {}  # request -> layer -> experts of its last token

    def start(self, request_id: str, token_id: int, position: int, block_table: list[int],
              tokens_done: int = 0) -> None:
        """Put a request's next token in flight at layer 0. A request new to the decoder joins at the
        round of the most lagging flight (``tokens_done`` is informational: rounds order the work)."""
        del tokens_done
        ids = torch.tensor([token_id], dtype=torch.long, device=self.device)
        joined = min((f.round for f in self.flights.values()), default=0)
        round_ = self._next_round.pop(request_id, joined)
        self.flights[request_id] = Flight(request_id, position, block_table, self.model.embed(ids), round_)

    def drop(self, request_id: str) -> None:
        """Forget a request (finished, aborted or preempted), releasing any expert lease it holds."""
        self._next_round.pop(request_id, None)
        self._used.pop(request_id, None)
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
            waiting = [f.lease for f in self._lagging_first(self.flights.values()) if f.lease is not None]
            if self.residency is not None and waiting:
                self.residency.wait_any(waiting)
            return []
        self.micro_steps += 1
        if group[0].phase == "attn":
            self.max_lead_seen = max(self.max_lead_seen, max(self._lead(f) for f in group))
            self._run_attention(group)
        else:
            self._run_moe(group)
        return self._finish_tokens(group)

    # ---- choosing ---------------------------------------------------------------------------

    def _lagging_first(self, flights) -> list[Flight]:
        return sorted(flights, key=lambda f: f.progress(self.num_layers))

    def _lead(self, flight: Flight) -> int:
        floor = min(f.progress(self.num_layers) for f in self.flights.values())
        return flight.progress(self.num_layers) - floor

    def _is_ready(self, flight: Flight, floor: int) -> bool:
        if flight.phase == "attn":
            # NOTE: only starting a layer is bounded; a routed request holding a lease always runs,
            # so the experts it pins are released and the most lagging request can get cache room.
            return flight.progress(self.num_layers) - floor < self.max_lead
        if self.residency is None:
            return True
        return flight.lease is not None and self.residency.is_ready(flight.lease)

    def _pick_group(self) -> list[Flight]:
        floor = min((f.progress(self.num_layers) for f in self.flights.values()), default=0)
        ready = [f for f in self.flights.values() if self._is_ready(f, floor)]
        if not ready:
            return []
        lagging = min(ready, key=lambda f: (f.progress(self.num_layers), f.phase != "moe"))
        return [f for f in ready if f.layer == lagging.layer and f.phase == lagging.phase]

    def _try_acquire(self) -> None:
        """Ask the cache for experts of requests that routed but could not get slots yet."""
        if self.residency is None:
            return
        waiting = [f for f in self.flights.values() if f.phase == "moe" and f.lease is None]
        for layer in sorted({f.layer for f in waiting}):
            self._acquire_all([f for f in waiting if f.layer == layer])

    def _plan(self, layer: int) -> dict[int, int]:
        """Eviction plan of ``layer`` (see the module docstring)."""
        tiers: dict[int, int] = {}
        for flight in self.flights.values():
            if flight.before(layer):
                for expert in self._used.get(flight.request_id, {}).get(layer, ()):
                    tiers[expert] = PREDICTED
        for flight in self.flights.values():
            if flight.layer == layer and flight.phase == "moe" and flight.lease is None:
                for expert in flight.experts:
                    tiers[expert] = NEEDED
        return tiers

    def _acquire_all(self, flights: list[Flight]) -> None:
        """Leases for routed flights of one layer, most lagging first (that is the copy order)."""
        layer = flights[0].layer
        self.residency.plan(layer, self._plan(layer))
        for flight in self._lagging_first(flights):
            try:
                flight.lease = self.residency.acquire(layer, flight.experts)
            except RuntimeError:  # pool full of experts other requests hold: retry after they run
                flight.lease = None

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
        # NOTE: the one host sync of the layer: which experts to fetch is a scheduling decision.
        chosen = routing[0].tolist() if routing is not None else None
        for i, flight in enumerate(group):
            flight.selection = ctx.selections.get(i, flight.selection)
            flight.hidden = hidden[i:i + 1]
            if routing is None:
                flight.hidden = layer.ffn(flight.hidden, normed[i:i + 1], None)
                self._advance(flight)
                continue
            flight.normed = normed[i:i + 1]
            flight.routing = (routing[0][i:i + 1], routing[1][i:i + 1])
            flight.experts = list(dict.fromkeys(chosen[i]))
            flight.phase = "moe"
            self._used.setdefault(flight.request_id, {})[flight.layer] = flight.experts
        if routing is not None and self.residency is not None:
            self._acquire_all(group)

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
        flight.normed = flight.routing = flight.experts = flight.lease = None

    def _finish_tokens(self, group: list[Flight]) -> list[tuple[str, torch.Tensor]]:
        done = [f for f in group if f.layer == self.num_layers]
        if not done:
            return []
        logits = self.model.logits(torch.cat([f.hidden for f in done]))
        for flight in done:
            del self.flights[flight.request_id]
            self._next_round[flight.request_id] = flight.round + 1
        return [(f.request_id, logits[i]) for i, f in enumerate(done)]
