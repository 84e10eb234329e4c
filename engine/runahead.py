"""Runahead decoding: requests whose experts are resident run ahead to later layers while others
wait for their expert fetches.

Each decoding request has one token "in flight" at some (layer, phase). A micro-step runs one of:
- *attention* at a layer, as one batch, for the requests waiting there that may start it (input norm +
  attention (+ indexer) + residual, post-attention norm; a dense layer's MLP runs right away, an MoE
  layer routes and computes its shared experts, and the request's (token, k) pairs wait for their
  routed experts);
- *experts* at a layer: every waiting pair of that layer whose expert is on the GPU now, whichever
  request it belongs to, in one routed-experts call. Each pair gets its own fp32 row; a request whose
  last pair is done sums its rows over k in order 0..K-1 (as the layer-synchronous backend does, so
  greedy tokens do not depend on when each expert arrived), adds the shared experts and the residual
  and moves to the next layer.
So a request whose experts are partly resident computes the resident part at once and each fetched
expert when its copy lands, one fetched expert serves every waiting request of that layer that needs
it, and a request whose experts are all resident runs ahead. A request that finishes its last layer
gets logits; the engine samples and starts its next token at layer 0 at once.

The flights' tensors (residual stream, MoE input, routing weights, shared experts' output, each
pair's output) are rows of decoder-wide buffers (:class:`FlightRows`), so a micro-step gathers and
scatters its requests in one launch each whatever their number. Attention micro-steps run the
runner's per-layer pieces (CUDA graphs where captured); an expert micro-step is one (4, P) index plan
uploaded and a fixed sequence of launches over it (gather, the fused MoE over the pairs' cache slots,
scatter, the finished requests' sum over k + shared experts + residual), captured as one CUDA graph
per pair bucket where the residency's compute can be (the fused kernel on the GPU).

Progress is counted in *rounds* (the decoder's own token count, shared by all requests: a request
joins at the round of the most lagging one) times layers plus the layer.

*Lock-step rounds*: when every request is about to start the same round at layer 0 and it is alone,
or the link carried no expert since the last round boundary (every expert was resident: running ahead
has no copies to overlap), the whole round runs as one call of the layer-synchronous step (the sync
scheduler's code path: its pieces, graphs and fetch plan), so runahead costs what sync costs there.
(With offloaded experts the engine does not start the decoder at all while every layer's pool holds
all the requests' experts at once: ``api.auto_scheduler``.)

Choice of micro-step: the one holding the most lagging request (experts before attention at equal
progress), which bounds every request's wait. *Coalescing*: a layer's landed pairs wait until every
copy the layer's pairs wait for has landed, so its requests are computed in one call and go on
together as sync's lock-step runs them, unless computing part of them pays: the layer's pool has no
room for an expert a pair needs (computing frees slots), or the link has fewer than ``fetch_depth``
copies to carry (requests that finish the layer early reveal their next layer's experts, which keeps
the link busy: the only reason to run ahead). A wait blocks until the first copy whose landing lets
something run, not the next copy. Attention batches every request that may start that
layer, so shared weights are read once per batch; with every expert resident this is plain
layer-by-layer batching. *Self-balancing*: attention of requests that ran ahead is held back while
requests behind them are still coming and the link has at least ``fetch_depth`` copies of known needs
to carry (starting the layer early would reveal nothing the link could use sooner), because one
attention per request costs about a whole batch's weight reads and kernel launches.

Cache cooperation:
- *Holding*: an expert a waiting pair needs is held (reference-counted in the cache, so never
  evicted) from when it is resident or its copy is queued until the last pair needing it at that
  layer is computed; then it is released at once, which frees room for the next fetches.
- *Fetch order and depth*: experts that are resident or already in flight are held as soon as a
  request routes to them. Missing ones are fetched in the scheduler's order (most lagging request
  first, then most waiting pairs first). The most lagging requests' copies are queued all at once (as
  sync queues a layer's: nobody is behind them); copies for requests ahead only while fewer than
  ``fetch_depth`` are queued: the copy stream is first-in first-out, so a deeper queue would let
  requests that ran ahead put their copies in front of a lagging request's.
- *Lead bound*: a request may start a layer only while it is fewer than ``max_lead`` layers ahead of
  the most lagging request (default: one token), so a request running ahead cannot evict the
  experts a lagging one is about to use for the same token.
- *Eviction plan*: before fetching at a layer, the residency is told which experts of that layer
  requests still expect there: tier 2 for experts that routed requests wait for, tier 1 for the
  experts each request that has not reached the layer yet used there on its previous token. When the
  decoder has no flight left its plans are cleared, so the sync steps after it evict by the cache's
  own policy (a stale plan protected experts of finished requests: a lone request after several
  fetched more than under sync).
- *Room*: a copy is queued only when the layer's pool has a slot nobody holds; otherwise the expert
  waits until pairs computed at that layer release theirs. Every held expert belongs to a waiting pair
  that can be computed once its copy lands, so holds always drain and the most lagging request's
  missing experts are the first fetched when room appears. The engine's prompt steps share the pool:
  before one runs, :meth:`RunaheadDecoder.release_holds` lets every hold go (resident experts stay
  cached, queued copies still land) and the next micro-step holds again what its pairs need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import Protocol

import torch

from hearth.engine.kv_cache import ForwardContext, PagedCache, SeqSlice, slots_for
from hearth.engine.models.deepseek import DeepseekForCausalLM
from hearth.engine.piecewise import Piece, PiecewiseDecode, Row
from hearth.engine.runner import StepInput
from hearth.engine.tiers import DecodeTiers

# A decode step of the layer-synchronous scheduler: (requests, one token each) -> logits (n, vocab) fp32.
SyncStep = Callable[[list[StepInput]], torch.Tensor]

NEEDED, PREDICTED = 2, 1  # eviction-plan tiers (0: nobody expects the expert)


class Residency(Protocol):
    """What runahead needs from an expert cache, one expert at a time. A *handle* holds one expert of
    one layer in the cache until released."""

    def plan(self, layer: int, tiers: dict[int, int]) -> None:
        """Experts of ``layer`` that requests still expect to use there, expert -> tier (1 or 2);
        eviction in that layer takes unlisted experts first, then tier 1, then tier 2. Replaces the
        layer's previous plan; called before fetching in the layer."""

    def fetch_depth(self) -> int:
        """How many copies to keep queued on the link: enough to cover one micro-step."""

    def copies(self) -> int:
        """Experts copied over the link so far, by anyone (only differences are read: did the link carry
        anything between two moments?)."""

    def is_free(self, layer: int, experts: list[int]) -> list[bool]:
        """For each expert: can it be held without a new copy (resident, or its copy already queued)?"""

    def acquire(self, layer: int, experts: list[int]) -> list:
        """One handle per expert, copies of missing ones queued in the given order; raises RuntimeError
        (and holds nothing) when the layer's pool has no room."""

    def has_landed(self, handle) -> bool:
        """Is the expert on the device now (its copy done)? Never blocks."""

    def wait_any(self, handles: list) -> None:
        """Block until the first of ``handles`` (in the order their copies were queued) may have landed."""

    def release(self, handle) -> None: ...

    def compute(self, layer: int, x: torch.Tensor, handles: list, weights: torch.Tensor) -> torch.Tensor:
        """Pair rows: x (P, D), the expert of each row, weights (P,) fp32 -> (P, D) fp32, row p =
        weights[p] * expert_p(x[p]) (each row independent of the others)."""


@dataclass
class Flight:
    """One request's current token on its way through the layers."""

    request_id: str
    position: int
    block_table: list[int]
    token: int  # the token in flight (embedded by its first attention micro-step)
    round: int  # the decoder's token round of this token (comparable across requests)
    row: int  # its row in the decoder's FlightRows (residual stream, MoE input, routing weights, pair outputs)
    embedded: bool = False  # the token's embedding is in its hidden row (from its first attention micro-step)
    layer: int = 0
    phase: str = "attn"  # "attn": waits to start the layer; "moe": routed, waits for its experts
    experts: list[int] | None = None  # (K,) routed experts of the current layer, once routed
    todo: list[int] | None = None  # k of the pairs not computed yet
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
    layer (None: one token, ``num_hidden_layers``). ``fetch_depth``: copies kept queued on the link
    (None: the residency's choice). ``pieces``: the runner's piecewise decode (its per-layer pieces,
    CUDA graphs where captured, run the attention micro-steps). ``sync_step``: the layer-synchronous
    decode step; a request alone in the decoder runs its whole token through it (nothing to run
    ahead of: the same graphs and fetch plan as the sync scheduler, so one request costs what sync costs).
    """

    def __init__(self, model: DeepseekForCausalLM, cache: PagedCache, residency: Residency | None,
                 device: torch.device, max_lead: int | None = None, fetch_depth: int | None = None,
                 pieces: PiecewiseDecode | None = None, sync_step: SyncStep | None = None,
                 tiers: DecodeTiers | None = None) -> None:
        self.model = model
        self.tiers = tiers  # the kernel path's tiered decode tokens: reserved when they start
        self.pieces = pieces
        self.sync_step = sync_step
        self.cache = cache
        self.residency = residency
        self.device = device
        self.flights: dict[str, Flight] = {}
        self.num_layers = model.config.num_hidden_layers
        self.max_lead = max_lead or self.num_layers
        if self.max_lead < 1:
            raise ValueError(f"max_lead must be at least 1 layer, got {max_lead}")
        self.fetch_depth = fetch_depth
        self.micro_steps = self.expert_steps = self.waits = self.deferred = self.sync_steps = 0
        self.rows = 0  # requests' tokens the micro-steps ran, summed (rows per call = rows / micro_steps)
        self.sync_rows = 0  # of them, in sync steps
        # Where the decoder's wall time went, in seconds: micro-steps by kind ("attn", "experts", "sync"),
        # blocking waits for copies ("wait"), and of the micro-steps' time, how much ran while the link had
        # no copy queued (bench_runahead prints it): "starved_room" (needs known, no slot free: computing is
        # behind) and "starved_need" (no request has routed to a missing expert: nothing known to fetch).
        self.seconds = dict.fromkeys(("attn", "experts", "sync", "wait", "starved_room", "starved_need"), 0.0)
        self._unfetched = 0  # experts waiting pairs need that are neither held nor queued
        self._blocked: set[int] = set()  # layers whose pool had no room for an expert a waiting pair needs
        self._planned: set[int] = set()  # layers whose eviction plan this decoder set
        self._copies_mark = -1  # the residency's copy count at the last round boundary (-1: none yet)
        self.max_lead_seen = 0  # the largest lead (in layers) a request started a layer with
        self._next_round: dict[str, int] = {}  # request -> round of its next token
        self._used: dict[str, dict[int, list[int]]] = {}  # request -> layer -> experts of its last token
        self._held: dict[int, dict[int, object]] = {}  # layer -> expert -> handle
        self._landed: set[tuple[int, int]] = set()  # (layer, expert) held and on the device
        self._queued: list[tuple[int, int]] = []  # held, not landed yet, in the order copies were queued
        config = model.config
        self.slab = FlightRows(config.hidden_size, config.num_experts_per_tok or 1,
                               model.model.embed_tokens.weight.dtype, device)

    def start(self, request_id: str, token_id: int, position: int, block_table: list[int],
              tokens_done: int = 0) -> None:
        """Put a request's next token in flight at layer 0. A request new to the decoder joins at the
        round of the most lagging flight (``tokens_done`` is informational: rounds order the work)."""
        del tokens_done
        joined = min((f.round for f in self.flights.values()), default=0)
        round_ = self._next_round.pop(request_id, joined)
        if self.tiers is not None:  # every layer's tiers count the token before its first launch
            self.tiers.prepare([(request_id, position)])
        old = self.flights.get(request_id)
        row = old.row if old is not None else self.slab.take()
        self.flights[request_id] = Flight(request_id, position, block_table, token_id, round_, row)

    def drop(self, request_id: str) -> None:
        """Forget a request (finished, aborted or preempted), releasing experts only it was waiting for."""
        self._next_round.pop(request_id, None)
        self._used.pop(request_id, None)
        flight = self.flights.pop(request_id, None)
        if flight is not None:
            self.slab.give(flight.row)
            if flight.phase == "moe":
                self._release_unneeded(flight.layer)
        if not self.flights:
            self._clear_plans()

    def __len__(self) -> int:
        return len(self.flights)

    def release_holds(self) -> None:
        """Release every held expert, so that a step outside the decoder (a prompt chunk) may use the
        whole expert cache; the next micro-step holds again what waiting pairs need."""
        if self.residency is None:
            return
        for held in self._held.values():
            for handle in held.values():
                self.residency.release(handle)
        self._held.clear()
        self._landed.clear()
        self._queued.clear()

    def warm_up(self, max_requests: int) -> int:
        """Before any user request: room for ``max_requests`` flights, and the expert micro-step captured
        at every pair bucket that many requests can reach (``FlightRows.warm``), so the decoder's first
        rounds (a runahead gate's trial) compile and capture nothing the sync steps before them did not.
        Returns the graphs captured."""
        if self.residency is None:
            return 0
        self.slab.reserve(max_requests)
        shared = {getattr(layer.mlp, "shared_experts", None) is not None for layer in self.model.layers if layer.is_moe}
        return self.slab.warm(self.residency, self.pieces, max_requests * self.slab.k, shared)

    @property
    def num_held(self) -> int:
        """Experts held in the cache for waiting pairs (0 when nothing waits)."""
        return sum(len(held) for held in self._held.values())

    @torch.inference_mode()
    def step(self) -> list[tuple[str, torch.Tensor]]:
        """One micro-step; returns (request_id, logits (vocab,)) of requests that finished a token."""
        start = perf_counter()
        lockstep = self._lockstep()
        if lockstep:
            out = self._run_sync(lockstep)
            self.seconds["sync"] += perf_counter() - start
            return out
        self._hold_and_fetch()
        starved = None if self._queued or self.residency is None else \
            ("starved_room" if self._unfetched else "starved_need")
        kind, layer, group = self._pick()
        if kind is None:
            self._wait()
            self.seconds["wait"] += perf_counter() - start
            return []
        self.micro_steps += 1
        if kind == "attn":
            self.max_lead_seen = max(self.max_lead_seen, max(self._lead(f) for f in group))
            self.rows += len(group)
            self._run_attention(group)
            out = self._finish_tokens(group)
        else:
            self.expert_steps += 1
            out = self._finish_tokens(self._run_experts(layer))
        elapsed = perf_counter() - start
        self.seconds["attn" if kind == "attn" else "experts"] += elapsed
        if starved is not None:
            self.seconds[starved] += elapsed
        return out

    def _lockstep(self) -> list[Flight]:
        """The flights, when the sync step should run their whole token round as one call: every flight
        is about to start the same round at layer 0, and either it is alone (nothing to run ahead of) or
        the link carried no expert since the last round boundary (every expert was resident: running
        ahead would only split the round into more, smaller calls). [] otherwise."""
        if self.sync_step is None or not self.flights:
            return []
        flights = list(self.flights.values())
        first = flights[0]
        if any(f.layer != 0 or f.phase != "attn" or f.round != first.round for f in flights):
            return []
        copies = self.residency.copies() if self.residency is not None else 0
        idle, self._copies_mark = copies == self._copies_mark, copies
        return flights if len(flights) == 1 or idle else []

    def _run_sync(self, flights: list[Flight]) -> list[tuple[str, torch.Tensor]]:
        self.release_holds()  # (none of their own: they have not routed yet) the sync step may need every slot
        self.micro_steps += 1
        self.sync_steps += 1
        self.rows += len(flights)
        self.sync_rows += len(flights)
        logits = self.sync_step([StepInput(f.block_table, f.position, [f.token], f.request_id) for f in flights])
        for flight in flights:
            del self.flights[flight.request_id]
            self.slab.give(flight.row)
            self._next_round[flight.request_id] = flight.round + 1
            self._used.pop(flight.request_id, None)  # its experts were not recorded: predict nothing from them
        self._clear_plans()
        return [(f.request_id, logits[i]) for i, f in enumerate(flights)]

    # ---- choosing ---------------------------------------------------------------------------

    def _floor(self) -> int:
        return min((f.progress(self.num_layers) for f in self.flights.values()), default=0)

    def _lead(self, flight: Flight) -> int:
        return flight.progress(self.num_layers) - self._floor()

    def _waiting(self, layer: int | None = None) -> list[Flight]:
        """Routed flights with pairs left (at ``layer``, or anywhere)."""
        return [f for f in self.flights.values() if f.phase == "moe" and (layer is None or f.layer == layer)]

    def _computable(self, flight: Flight) -> list[int]:
        return [k for k in flight.todo if (flight.layer, flight.experts[k]) in self._landed]

    def _pick(self) -> tuple[str | None, int, list[Flight]]:
        """The micro-step holding the most lagging request that can run now."""
        floor = self._floor()
        ready = self._expert_layers()
        best: tuple[int, int] | None = None
        choice: tuple[str | None, int, list[Flight]] = (None, -1, [])
        for flight in self.flights.values():
            if flight.phase == "attn":
                if flight.progress(self.num_layers) - floor >= self.max_lead:
                    continue  # NOTE: only starting a layer is bounded; held experts are always computed
                key = (flight.progress(self.num_layers), 1)
            elif flight.layer in ready and self._computable(flight):
                key = (flight.progress(self.num_layers), 0)
            else:
                continue
            if best is None or key < best:
                best, choice = key, (flight.phase, flight.layer, [])
        kind, layer, _ = choice
        if kind != "attn":
            return choice
        group = [f for f in self.flights.values() if f.phase == "attn" and f.layer == layer
                 and f.progress(self.num_layers) - floor < self.max_lead]
        if self._should_batch(group):
            self.deferred += 1
            moe = [f for f in self.flights.values() if f.phase == "moe" and f.layer in ready and self._computable(f)]
            if not moe:
                return None, -1, []
            lagging = min(moe, key=lambda f: f.progress(self.num_layers))
            return "moe", lagging.layer, []
        return kind, layer, group

    def _should_batch(self, group: list[Flight]) -> bool:
        """Hold ``group``'s attention back for requests behind it that will reach the same layer?
        Only while the link has at least ``fetch_depth`` copies of known needs to carry: then starting
        the layer early reveals nothing the link could use sooner, and one batch reads the layer's
        weights (and launches its kernels) once instead of once per request."""
        if self.residency is None:
            return False
        start = min(f.progress(self.num_layers) for f in group)
        if not any(f.progress(self.num_layers) < start for f in self.flights.values()):
            return False  # nobody is behind: the group is the most lagging
        return self._link_fed()

    def _depth(self) -> int:
        return self.fetch_depth or self.residency.fetch_depth()

    def _link_fed(self) -> bool:
        """Does the link have at least ``fetch_depth`` copies of known needs to carry (queued or waiting
        for room)? Then nothing a micro-step could reveal now would reach the link sooner."""
        return bool(self._queued) and len(self._queued) + self._unfetched >= self._depth()

    def _expert_layers(self) -> set[int]:
        """Layers whose landed pairs may be computed now. *Coalescing*: a layer's pairs wait until every
        copy they wait for has landed, so the layer's requests are computed in one call and go on
        together (as sync's lock-step runs them), unless computing part of them pays: the layer's pool has
        no room for an expert a pair needs (computing frees slots), or the link has fewer than
        ``fetch_depth`` copies to carry (requests that finish the layer early reveal their next layer's
        experts, which keeps the link busy)."""
        landed = {layer for layer, _ in self._landed}
        if not self._link_fed():
            return landed
        pending = {layer for layer, _ in self._queued}
        return {layer for layer in landed if layer not in pending or layer in self._blocked}

    def _wait(self) -> None:
        """Nothing can run: block until the first queued copy whose landing lets something run (copies
        land in queue order): the last one of a layer (its pairs are then whole), the first one of a
        layer short of room, or the one after which the link has fewer than ``fetch_depth`` to carry."""
        self._queued = [key for key in self._queued if key[1] in self._held.get(key[0], {})]
        if self.residency is None or not self._queued:
            return
        self.waits += 1
        wake = max(0, len(self._queued) + self._unfetched - self._depth())
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, (layer, _) in enumerate(self._queued):
            first.setdefault(layer, i)
            last[layer] = i
        wake = min([wake, *last.values(), *(first[layer] for layer in self._blocked if layer in first)])
        self.residency.wait_any([self._held[layer][expert] for layer, expert in self._queued[wake:]])

    # ---- expert residency ---------------------------------------------------------------------

    def _plan(self, layer: int) -> dict[int, int]:
        """Eviction plan of ``layer`` (see the module docstring)."""
        tiers: dict[int, int] = {}
        for flight in self.flights.values():
            if flight.before(layer):
                for expert in self._used.get(flight.request_id, {}).get(layer, ()):
                    tiers[expert] = PREDICTED
        for flight in self._waiting(layer):
            for k in flight.todo:
                tiers[flight.experts[k]] = NEEDED
        return tiers

    def _hold_and_fetch(self) -> None:
        """Hold the experts waiting pairs need: free ones (resident or in flight) at once, then missing
        ones in priority order while fewer than ``fetch_depth`` copies are queued."""
        if self.residency is None:
            return
        self._refresh_landed()
        wanted: dict[tuple[int, int], tuple[int, int]] = {}  # (layer, expert) -> (lagging progress, -pairs)
        for flight in self._waiting():
            held = self._held.setdefault(flight.layer, {})
            for k in flight.todo:
                expert = flight.experts[k]
                if expert in held:
                    continue
                progress, pairs = wanted.get((flight.layer, expert), (flight.progress(self.num_layers), 0))
                wanted[(flight.layer, expert)] = (min(progress, flight.progress(self.num_layers)), pairs - 1)
        self._unfetched = len(wanted)
        self._blocked = set()
        if not wanted:
            return
        order = sorted(wanted, key=lambda key: (wanted[key], key))
        layers = list(dict.fromkeys(layer for layer, _ in order))
        for layer in layers:
            self.residency.plan(layer, self._plan(layer))
            self._planned.add(layer)
            experts = [e for l, e in order if l == layer]
            free = [e for e, is_free in zip(experts, self.residency.is_free(layer, experts)) if is_free]
            if free and self._take(layer, free):  # no copy needed, so no room beyond their own slots
                self._unfetched -= len(free)
        depth, floor = self._depth(), self._floor()
        for layer, expert in order:
            # The most lagging requests' copies all go at once, as sync queues a layer's: nobody is behind
            # them to overtake. Only copies for requests ahead are kept ``depth`` deep.
            if len(self._queued) >= depth and wanted[(layer, expert)][0] > floor:
                break
            if layer in self._blocked or expert in self._held[layer]:
                continue
            if self._take(layer, [expert]):
                self._unfetched -= 1
            else:
                self._blocked.add(layer)  # the pool is held by waiting pairs: retry after some are computed

    def _take(self, layer: int, experts: list[int]) -> bool:
        try:
            handles = self.residency.acquire(layer, experts)
        except RuntimeError:
            return False
        for expert, handle in zip(experts, handles):
            self._held[layer][expert] = handle
            if self.residency.has_landed(handle):
                self._landed.add((layer, expert))
            else:
                self._queued.append((layer, expert))
        return True

    def _refresh_landed(self) -> None:
        still = []
        for layer, expert in self._queued:
            handle = self._held.get(layer, {}).get(expert)
            if handle is None:
                continue
            if self.residency.has_landed(handle):
                self._landed.add((layer, expert))
            else:
                still.append((layer, expert))
        self._queued = still

    def _clear_plans(self) -> None:
        """No flight left: the eviction plans it set would outlive their requests (a later sync step
        would keep experts nobody expects any more), so every layer goes back to the base policy."""
        for layer in self._planned:
            self.residency.plan(layer, {})
        self._planned.clear()

    def _release_unneeded(self, layer: int) -> None:
        if self.residency is None:
            return
        needed = {f.experts[k] for f in self._waiting(layer) for k in f.todo}
        held = self._held.get(layer, {})
        gone = [e for e in held if e not in needed]
        for expert in gone:
            self.residency.release(held.pop(expert))
            self._landed.discard((layer, expert))
        if gone:
            self._queued = [key for key in self._queued if key[0] != layer or key[1] in held]

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

    def _hidden(self, group: list[Flight], rows: torch.Tensor) -> torch.Tensor:
        """(T, D) residual rows of ``group`` (its FlightRows ``rows``), embedding the tokens of flights at
        their first layer."""
        fresh = [f for f in group if not f.embedded]
        if fresh:
            ids = _to_device([[f.token for f in fresh], [f.row for f in fresh]], self.device)
            self.slab.hidden[ids[1]] = self.model.embed(ids[0])
            for flight in fresh:
                flight.embedded = True
        return self.slab.hidden[rows]

    def _attend(self, group: list[Flight], rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                         tuple | None, torch.Tensor | None]:
        """Attention of ``group`` (its FlightRows ``rows``) at its layer: (hidden, normed, routing, shared);
        routing None when the layer is done (a dense layer, or experts computed in place)."""
        index = group[0].layer
        layer = self.model.layers[index]
        pieces = self.pieces
        if pieces is not None and pieces.fits(len(group), [f.block_table for f in group]):
            selections = [f.selection for f in group] if all(f.selection is not None for f in group) else None
            ids = [f.request_id for f in group]  # tiered requests: their tokens were reserved by ``start``
            tiers = None if self.tiers is None else (ids, self.tiers.layout(ids))
            out, chosen = pieces.attend_rows(index, [Row(f.block_table, f.position) for f in group],
                                             self._hidden(group, rows), selections, tiers)
            for i, flight in enumerate(group):
                flight.selection = chosen[i] if chosen is not None else flight.selection
            if "ids" not in out:
                return out["hidden"], None, None, None
            return out["hidden"], out["normed"], (out["ids"], out["weights"]), out.get("shared")
        ctx = self._context(group)
        hidden = layer.attend(self._hidden(group, rows), ctx)  # (T, D)
        normed = layer.ffn_input(hidden)
        routing = layer.route(normed)
        for i, flight in enumerate(group):
            flight.selection = ctx.selections.get(i, flight.selection)
        if routing is None or self.residency is None:  # dense layer, or every expert resident
            return layer.ffn(hidden, normed, routing), None, None, None
        shared = layer.mlp.shared_experts(normed) if layer.mlp.shared_experts is not None else None
        return hidden, normed, routing, shared

    def _run_attention(self, group: list[Flight]) -> None:
        rows = _to_device([[f.row for f in group]], self.device)[0]
        hidden, normed, routing, shared = self._attend(group, rows)
        slab = self.slab
        slab.hidden[rows] = hidden
        if routing is None:
            for flight in group:
                self._advance(flight)
            return
        # NOTE: the one host sync of the layer: which experts to fetch is a scheduling decision.
        slab.normed[rows] = normed
        slab.weights[rows] = routing[1].float()
        if shared is not None:
            slab.shared[rows] = shared
        chosen = routing[0].tolist()
        k = len(chosen[0])
        for i, flight in enumerate(group):
            flight.experts = chosen[i]
            flight.todo = list(range(k))
            flight.phase = "moe"
            self._used.setdefault(flight.request_id, {})[flight.layer] = list(dict.fromkeys(chosen[i]))

    def _run_experts(self, layer_idx: int) -> list[Flight]:
        """Every waiting pair of the layer whose expert has landed; returns the flights that advanced."""
        flights = [(f, ks) for f in self._waiting(layer_idx) if (ks := self._computable(f))]
        rows, ks_all, handles = [], [], []
        for flight, ks in flights:
            rows += [flight.row] * len(ks)
            ks_all += ks
            handles += [self._held[layer_idx][flight.experts[k]] for k in ks]
            flight.todo = [k for k in flight.todo if k not in ks]
        self.rows += len(flights)
        done = [f for f, _ in flights if not f.todo]
        shared = self.model.layers[layer_idx].mlp.shared_experts is not None
        self.slab.run_pairs(self.residency, layer_idx, rows, ks_all, handles, [f.row for f in done], shared,
                            self.pieces)
        self._release_unneeded(layer_idx)  # after the compute is queued: a freed slot is refilled behind it
        for flight in done:
            self._advance(flight)
        return done

    def _advance(self, flight: Flight) -> None:
        flight.layer += 1
        flight.phase = "attn"
        flight.experts = flight.todo = None

    def _finish_tokens(self, group: list[Flight]) -> list[tuple[str, torch.Tensor]]:
        done = [f for f in group if f.layer == self.num_layers]
        if not done:
            return []
        logits = self.model.logits(self.slab.hidden[_to_device([[f.row for f in done]], self.device)[0]])
        for flight in done:
            del self.flights[flight.request_id]
            self.slab.give(flight.row)
            self._next_round[flight.request_id] = flight.round + 1
        if not self.flights:
            self._clear_plans()
        return [(f.request_id, logits[i]) for i, f in enumerate(done)]


class FlightRows:
    """The flights' tensors, one row per flight in decoder-wide buffers: residual stream ``hidden``, MoE
    input ``normed`` and shared experts' output ``shared`` (dtype, (R, D)), routing ``weights`` (fp32,
    (R, K)) and each pair's weighted expert output ``rows`` (fp32, (R, K, D)). Row R is scratch: padding
    indices point there. So a micro-step gathers and scatters all its requests in one launch each, and
    an expert micro-step is a fixed sequence of launches over a (4, P) index plan, captured as one CUDA
    graph per pair bucket where the residency's compute is capturable (the fused kernel on the GPU)."""

    def __init__(self, hidden_size: int, k: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 16) -> None:
        self.hidden_size, self.k, self.dtype, self.device = hidden_size, k, dtype, device
        self.capacity = 0
        self.free: list[int] = []
        self.graphs: dict[tuple[int, bool, int], Piece] = {}  # (pair bucket, shared experts, residency) -> Piece
        self.replays = 0
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        d, k, dev, old = self.hidden_size, self.k, self.device, self.capacity
        buffers = {"hidden": ((d,), self.dtype), "normed": ((d,), self.dtype), "shared": ((d,), self.dtype),
                   "weights": ((k,), torch.float32), "rows": ((k, d), torch.float32)}
        for name, (shape, dtype) in buffers.items():
            new = torch.zeros((capacity + 1, *shape), dtype=dtype, device=dev)
            if old:
                new[:old].copy_(getattr(self, name)[:old])
            setattr(self, name, new)
        self.plan = torch.zeros((4, k * capacity), dtype=torch.long, device=dev)  # grows with the pair buckets
        self.free += range(capacity - 1, old - 1, -1)  # taken lowest first (pop from the end)
        self.capacity = self.scratch = capacity
        self.graphs = {}  # they read the old buffers

    def take(self) -> int:
        if not self.free:
            self._grow(2 * self.capacity)
        return self.free.pop()

    def reserve(self, flights: int) -> None:
        """Room for ``flights`` rows at once, so that no later ``take`` grows the buffers (which drops the
        captured graphs: they read the old ones)."""
        if flights > self.capacity:
            self._grow(flights)

    @staticmethod
    def pair_bucket(n: int, pieces: PiecewiseDecode) -> int:
        """The padded size of an expert micro-step of ``n`` pairs: the decode batch buckets, then multiples
        of the largest."""
        return pieces.bucket(n) if n <= pieces.max_batch else -(-n // pieces.max_batch) * pieces.max_batch

    def give(self, row: int) -> None:
        self.free.append(row)

    def run_pairs(self, residency: Residency, layer: int, rows: list[int], ks: list[int], handles: list,
                  done: list[int], shared: bool, pieces: PiecewiseDecode | None) -> None:
        """Pair p (flight row ``rows[p]``, its k ``ks[p]``, the expert ``handles[p]`` holds) into
        ``self.rows``; then the ``done`` rows' routed output (summed over k in order, in the activation
        dtype, + shared experts when ``shared``) into their residual stream, as the layer-synchronous
        MoE adds it."""
        n = len(rows)
        capture = pieces is not None and pieces.capture and getattr(residency, "capturable", False)
        if not capture:
            plan = _to_device([rows, ks], self.device)
            x, w = self.normed[plan[0]], self.weights[plan[0], plan[1]]
            self.rows[plan[0], plan[1]] = residency.compute(layer, x, handles, w)
            if done:
                self._finish(_to_device([done], self.device)[0], shared)
            return
        b = self.pair_bucket(n, pieces)
        self._plan_width(b)
        pad = b - n
        host = torch.tensor([rows + [self.scratch] * pad, ks + [0] * pad,
                             residency.slots(handles) + [-1] * pad, done + [self.scratch] * (b - len(done))],
                            dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.plan[:, :b].copy_(host, non_blocking=True)
        residency.wait_landed(handles)  # the compute stream waits for the copies the graph reads
        piece = self._piece(residency, b, shared, pieces)
        self.replays += piece.graph is not None
        piece()

    def warm(self, residency: Residency, pieces: PiecewiseDecode | None, max_pairs: int,
             shared: set[bool]) -> int:
        """Capture the expert micro-step at every pair bucket up to ``max_pairs`` pairs (for each of
        ``shared``: whether a layer adds shared experts) on a plan of padding rows only, which computes
        nothing and writes only the scratch row; returns how many graphs were captured. A user's first
        micro-steps at each size then replay instead of compiling the fused kernel's tile configs and
        capturing mid-request (what the runahead gate's first trial rounds paid). Nothing where the
        micro-step is not captured (the CPU, the reference MoE)."""
        if pieces is None or not pieces.capture or not getattr(residency, "capturable", False) or max_pairs < 1:
            return 0
        buckets = sorted({self.pair_bucket(n, pieces) for n in range(1, max_pairs + 1)})
        self._plan_width(buckets[-1])  # (a wider plan later would drop the graphs: they read this one)
        before = len(self.graphs)
        for b in buckets:
            self.plan[:, :b].copy_(torch.tensor([[self.scratch] * b, [0] * b, [-1] * b, [self.scratch] * b]))
            for kind in sorted(shared):
                self._piece(residency, b, kind, pieces)()
        return len(self.graphs) - before

    def _plan_width(self, b: int) -> None:
        if b > self.plan.shape[1]:
            self.plan = torch.zeros((4, b), dtype=torch.long, device=self.device)
            self.graphs = {}  # they read the old plan

    def _piece(self, residency: Residency, b: int, shared: bool, pieces: PiecewiseDecode) -> Piece:
        key = (b, shared, id(residency))
        piece = self.graphs.get(key)
        if piece is None:
            piece = self.graphs[key] = Piece(lambda: self._pairs(residency, b, shared), pieces, True)
        return piece

    def _pairs(self, residency: Residency, b: int, shared: bool) -> dict:
        plan = self.plan[:, :b]
        out = residency.compute_slots(self.normed[plan[0]], plan[2], self.weights[plan[0], plan[1]])
        self.rows[plan[0], plan[1]] = out
        self._finish(plan[3], shared)
        return {}

    def _finish(self, done: torch.Tensor, shared: bool) -> None:
        routed = self.rows[done].sum(1).to(self.dtype)  # (T, K, D) -> (T, D)
        if shared:
            routed = routed + self.shared[done]
        self.hidden[done] = self.hidden[done] + routed


def _to_device(values: list[list[int]], device: torch.device) -> torch.Tensor:
    """Small int64 host lists on ``device`` without a stream sync (pinned staging on CUDA)."""
    host = torch.tensor(values, dtype=torch.long, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
