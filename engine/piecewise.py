"""Piecewise decode steps: CUDA graphs between the routed-expert calls of offloaded experts (and MLI).

A whole decode step cannot be one CUDA graph when routed experts live in host RAM: which experts to
fetch is a host decision made from the router's output. So a decode step runs as pieces, each a
function of static buffers only, captured once per (piece, batch bucket) and replayed:

- ``embed``: the token ids -> the static hidden rows;
- ``attn`` of layer L: input norm, attention (MLA + the DSA kernels, MLI's side stream inside),
  residual, post-attention norm; a dense or resident-MoE layer's MLP too; an offloaded MoE layer's
  router and shared experts, its routed experts left for the next piece;
- ``experts`` of layer L: expert ids -> cache slots through the device slot table of the layer,
  one fused MoE launch over the expert cache's slot pool (padding rows skipped), + shared experts +
  residual into the static hidden rows;
- ``logits``: final norm + lm_head.

Between ``attn`` and ``experts`` of an offloaded layer the host reads the router's ids (the one small
device-to-host copy of the layer), acquires the experts in the cache (copies of missing ones go on the
copy stream), writes the layer's expert -> slot table and makes the compute stream wait for the
copies. A layer whose experts do not fit the pool's free room at once (or that the host-experts policy
sends partly to the CPU) runs the streaming backend eagerly instead (``OffloadedExperts``).

A step of ``n`` requests runs in the smallest bucket ``b >= n`` (``cuda_graphs.batch_buckets``); rows
``n..b-1`` are padding requests that read and write only a scratch page and route to no expert. The
same pieces serve the runahead decoder (``hearth.engine.runahead``), which stages any subset of its
requests into a bucket, one layer at a time.

Requests with tiered keys or latents (``hearth.engine.tiers``, the kernel path's planned tiers) are
read through their own tier buffers, so their ``attn`` pieces are captured per *tier key*: the
requests in row order and the step's tier layout (``DecodeTiers.layout``), without padding rows (a
padding row has no tiers), as ``cuda_graphs.DecodeGraphs`` captures whole tiered steps. The tiers'
host phase (``DecodeTiers.prepare``) runs before the step; a new layout (a host pool grew, a request
left) makes new pieces, the last ``TIER_GRAPHS`` tier keys' kept. The other pieces read no tiers and
stay keyed by (piece, layer, rows).

With the DSA kernels (``ForwardContext.decode``) the pieces read one static context per bucket and
pass selections between layers (IndexCache shared layers, MLI) through a static buffer, so each piece
can be captured. Elsewhere (the plain-PyTorch path, the CPU) the same pieces run eagerly ("eager
pieces") over a context built per step; the bookkeeping (buckets, padding, slot tables, fallbacks) is
the same, which is how the CPU tests check it token for token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from hearth.engine.cuda_graphs import TIER_GRAPHS, batch_buckets, capturing
from hearth.engine.kv_cache import DecodeMeta, ForwardContext, PagedCache, SeqSlice, build_context, decode_table_width
from hearth.engine.models.deepseek import DeepseekForCausalLM
from hearth.engine.models.dsa_kernels import stacked_selections
from hearth.offload.experts import OffloadedExperts


@dataclass(frozen=True)
class Row:
    """One request's token in a piecewise step: at ``position`` of the request whose pages are ``table``."""

    table: list[int]
    position: int
    token: int = 0  # read by the ``embed`` piece only


# A step's tiered requests: (their ids in row order, their tier layout from DecodeTiers.prepare / layout)
Tiers = tuple[Sequence[str | None], tuple[int, ...]]
TierKey = tuple[tuple[str | None, ...], tuple[int, ...]]
Outputs = dict[str, torch.Tensor]


class Piece:
    """One function of static buffers, run eagerly or captured on first use and replayed after."""

    def __init__(self, fn: Callable[[], Outputs], owner: PiecewiseDecode, capture: bool) -> None:
        self.fn, self.owner, self.capture = fn, owner, capture
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Outputs = {}

    def __call__(self) -> Outputs:
        owner = self.owner
        if self.graph is not None:
            self.graph.replay()
            owner.replays += 1
            return self.out
        owner.eager_pieces += 1
        if not self.capture:
            return self.fn()
        out, self.graph, self.out = owner.record(self.fn)
        return out


@dataclass
class TierPieces:
    """The ``attn`` pieces of one tier key and the static context they read (its rows name the requests)."""

    ctx: ForwardContext
    pieces: dict[tuple[str, int, int], Piece] = field(default_factory=dict)


class PiecewiseDecode:
    """Decode steps of ``model`` as pieces (see the module doc). ``capture``: CUDA graphs (needs the
    DSA kernel path, ``model.attention.use_kernels``); otherwise the pieces run eagerly."""

    def __init__(self, model: DeepseekForCausalLM, cache: PagedCache, max_batch: int, max_model_len: int,
                 scratch_block: int, device: torch.device, capture: bool) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.static = model.attention.use_kernels  # one static context per bucket (the kernels' decode path)
        self.capture = capture and self.static
        self.block_size = cache.block_size
        self.max_context = max_model_len
        self.max_blocks = decode_table_width(max_model_len, self.block_size)
        self.scratch_block = scratch_block
        self.sizes = batch_buckets(max_batch)
        b = self.max_batch = self.sizes[-1]
        config = model.config
        self.ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slots = torch.zeros(b, dtype=torch.long, device=device)
        self.tables = torch.zeros(b, self.max_blocks, dtype=torch.int32, device=device)
        self.lens = torch.ones(b, dtype=torch.int32, device=device)
        self.valid = torch.zeros(1, dtype=torch.long, device=device)  # rows of the step that are requests
        dtype = model.model.embed_tokens.weight.dtype
        self.hidden = torch.zeros(b, config.hidden_size, dtype=dtype, device=device)  # the residual stream
        # An offloaded MoE layer's attention piece leaves its routed experts' inputs here.
        k = config.num_experts_per_tok
        self.normed = torch.zeros(b, config.hidden_size, dtype=dtype, device=device)
        self.expert_ids = torch.zeros(b, k, dtype=torch.long, device=device)
        self.expert_weights = torch.zeros(b, k, dtype=torch.float32, device=device)
        self.shared = torch.zeros(b, config.hidden_size, dtype=dtype, device=device)
        topk = getattr(config, "index_topk", None) or 1
        self.selection = torch.full((b, 1, topk), -1, dtype=torch.int32, device=device)  # last indexer's top-k
        self.offloaded: dict[int, OffloadedExperts] = {}  # MoE layer -> the cache behind it
        self.prefetchers: dict[int, object] = {}
        for layer in model.layers:
            backend = getattr(layer.mlp, "backend", None) if layer.is_moe else None
            base = getattr(backend, "backend", backend)  # the prediction prefetcher wraps the plain backend
            if isinstance(base, OffloadedExperts):
                self.offloaded[layer.layer] = base
                if base is not backend:
                    self.prefetchers[layer.layer] = backend
        self.slot_tables = {i: torch.full((config.n_routed_experts,), -1, dtype=torch.int32, device=device)
                            for i in self.offloaded}
        self._pieces: dict[tuple[str, int, int], Piece] = {}
        self._contexts: dict[int, ForwardContext] = {}
        self._tiered: OrderedDict[TierKey, TierPieces] = OrderedDict()
        self._tier: TierPieces | None = None  # the step's, when its requests keep tiers
        self._ctx: ForwardContext | None = None  # the step's context (eager pieces on the plain path)
        self.pool = None
        self.replays = self.eager_pieces = self.fallbacks = 0
        self._first_indexer = next((i for i in range(config.num_hidden_layers) if config.runs_indexer(i)), None) \
            if config.has_indexer else None

    # ---- sizes ------------------------------------------------------------------------------

    def fits(self, num_requests: int, block_tables: list[list[int]]) -> bool:
        return num_requests <= self.max_batch and all(len(t) <= self.max_blocks for t in block_tables)

    def bucket(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    # ---- the sync step ----------------------------------------------------------------------

    def run(self, rows: list[Row], input_ids: torch.Tensor | None = None, tiers: Tiers | None = None) -> torch.Tensor:
        """One decode step, every request one token: logits (n, vocab) fp32 (a view, valid until the next step).
        ``input_ids`` (n,) on the device replace the rows' ``token`` values (overlapped decode). ``tiers``:
        the rows' requests keep tiers (see the module doc; their host phase is done)."""
        n = len(rows)
        b = self.enter(n, tiers, pad=True)
        self.stage(rows, b)
        if input_ids is not None:
            self.ids[:n].copy_(input_ids)
        self.piece("embed", 0, b)()
        for layer in self.model.layers:
            self.layer_step(layer.layer, b, n)
        return self.piece("logits", 0, b)()["logits"][:n]

    def layer_step(self, layer: int, b: int, n: int) -> None:
        """Layer ``layer`` for the staged rows: attention, then the routed experts if offloaded."""
        self.piece("attn", layer, b)()
        if layer in self.offloaded:
            self.routed_experts(layer, b, n)

    def routed_experts(self, layer: int, b: int, n: int) -> None:
        """The experts of ``layer`` for the first ``n`` rows: through the slot table and the ``experts``
        piece when the pool has room for all of them at once, else by the streaming backend."""
        backend = self.offloaded[layer]
        ids = self.expert_ids[:n].reshape(-1).tolist()  # NOTE: the layer's one host sync: what to fetch
        lease = backend.acquire_all(layer, ids)
        if lease is None:
            self.fallbacks += 1
            self._stream_experts(layer, n)
        else:
            table = [-1] * len(self.slot_tables[layer])
            for expert, slot in zip(lease.experts, lease.slots):
                table[expert] = slot
            host = torch.tensor(table, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self.slot_tables[layer].copy_(host, non_blocking=True)
            if backend.cache.is_cuda:
                lease.wait()  # the compute stream waits for this lease's copies
            self.piece("experts", layer, b)()
            backend.cache.release(lease)
        prefetcher = self.prefetchers.get(layer)
        if prefetcher is not None:
            prefetcher.predict(layer, self.normed[:n])

    def _stream_experts(self, layer: int, n: int) -> None:
        routed = self.offloaded[layer](layer, self.normed[:n], self.expert_ids[:n], self.expert_weights[:n])
        if self.model.layers[layer].mlp.shared_experts is not None:
            routed = routed + self.shared[:n]
        self.hidden[:n] += routed

    # ---- the runahead decoder's micro-steps --------------------------------------------------

    def attend_rows(self, layer: int, rows: list[Row], hidden: torch.Tensor, selections: list[torch.Tensor] | None,
                    tiers: Tiers | None = None) -> tuple[Outputs, list[torch.Tensor] | None]:
        """The ``attn`` piece of ``layer`` for any requests: ``rows`` with their residual rows ``hidden``
        (n, D) and, where the layer reads one, the top-k each request's last indexer layer chose; ``tiers``
        as in ``run``. Returns this step's rows (own tensors: ``hidden``, and for an offloaded MoE layer
        ``normed``, ``ids``, ``weights`` and ``shared`` when it has shared experts) and each request's
        top-k after the layer."""
        n = len(rows)
        b = self.enter(n, tiers, pad=self.static)  # eager pieces gain nothing from padding rows
        self.stage(rows, b)
        self.hidden[:n].copy_(hidden)
        reads = self.reads_selection(layer)
        if self.static and reads and selections is not None:
            self.selection[:n].copy_(torch.stack([s.view(1, -1) for s in selections]))
            self.selection[n:b] = -1  # padding rows select nothing but their own token
            self.selection[n:b, :, 0] = 0
        if not self.static:
            self._ctx.selections = dict(enumerate(selections)) if selections is not None else {}
        self.piece("attn", layer, b)()
        out = {"hidden": self.hidden[:n].clone()}
        if layer in self.offloaded:
            out.update(normed=self.normed[:n].clone(), ids=self.expert_ids[:n].clone(),
                       weights=self.expert_weights[:n].clone())
            if self.model.layers[layer].mlp.shared_experts is not None:
                out["shared"] = self.shared[:n].clone()
        if not self.static:
            chosen = self._ctx.selections
            return out, [chosen[i] for i in range(n)] if len(chosen) >= n else selections
        if getattr(self.model.layers[layer].self_attn, "indexer", None) is not None:
            return out, list(self.selection[:n].clone().unbind(0))
        return out, selections

    # ---- staging ----------------------------------------------------------------------------

    def enter(self, n: int, tiers: Tiers | None, pad: bool) -> int:
        """Start a step (or micro-step) of ``n`` rows: the rows it runs (the bucket with ``pad``, ``n``
        for tiered requests: a padding row has no tiers) and, with ``tiers``, the tier key's pieces."""
        if tiers is None:
            self._tier = None
            return self.bucket(n) if pad else n
        if not self.static:
            raise ValueError("tiered requests run in pieces on the kernel path only (the planned tiers)")
        key: TierKey = (tuple(tiers[0]), tuple(tiers[1]))
        entry = self._tiered.get(key)
        if entry is None:
            for stale in [k for k in self._tiered if k[1][0] != key[1][0]]:  # a request's tiers were dropped since
                del self._tiered[stale]
            while len(self._tiered) >= TIER_GRAPHS:
                self._tiered.popitem(last=False)
            if not any(piece.graph is not None for piece in self._all_pieces()):
                self.pool = None  # NOTE: as DecodeGraphs.run: a pool no graph lives in cannot be captured into
            entry = self._tiered[key] = TierPieces(self._static_context(n, key[0]))
        self._tiered.move_to_end(key)
        self._tier = entry
        return n

    def _all_pieces(self) -> list[Piece]:
        return [*self._pieces.values(), *(p for entry in self._tiered.values() for p in entry.pieces.values())]

    def stage(self, rows: list[Row], b: int) -> None:
        """Rows 0..n-1 of bucket ``b`` are ``rows``; the others pad (token 0 at position 0 of the scratch page)."""
        bs, scratch, n = self.block_size, self.scratch_block, len(rows)
        host = torch.zeros(b, 5 + self.max_blocks, dtype=torch.long, pin_memory=self.device.type == "cuda")
        host[:, 2] = scratch * bs
        host[:, 3] = 1
        host[:, 5:] = scratch
        host[0, 4] = n
        for i, row in enumerate(rows):
            pos = row.position
            host[i, :4] = torch.tensor([row.token, pos, row.table[pos // bs] * bs + pos % bs, pos + 1])
            host[i, 5:5 + len(row.table)] = torch.tensor(row.table, dtype=torch.long)
        staged = host.to(self.device, non_blocking=True)
        self.ids[:b].copy_(staged[:, 0])
        self.positions[:b].copy_(staged[:, 1])
        self.slots[:b].copy_(staged[:, 2])
        self.lens[:b].copy_(staged[:, 3])
        self.valid.copy_(staged[0, 4:5])
        self.tables[:b].copy_(staged[:, 5:])
        if not self.static:  # the plain path reads per-request slices: built per step
            padding = [([scratch], 0, 1)] * (b - n)
            self._ctx = build_context(self.cache, [(r.table, r.position, 1) for r in rows] + padding, self.device)

    def context(self, b: int) -> ForwardContext:
        if self._tier is not None:
            return self._tier.ctx
        if not self.static:
            return self._ctx
        ctx = self._contexts.get(b)
        if ctx is None:
            ctx = self._contexts[b] = self._static_context(b)
        return ctx

    def _static_context(self, b: int, seq_ids: Sequence[str | None] = ()) -> ForwardContext:
        """The context of rows [0, b) over the static buffers; ``seq_ids`` name the tiered requests' rows."""
        ids = list(seq_ids) + [None] * (b - len(seq_ids))
        seqs = [SeqSlice(start=i, q_len=1, context_len=1, slots=self.slots[i:i + 1], seq_id=ids[i]) for i in range(b)]
        return ForwardContext(positions=self.positions[:b], slot_mapping=self.slots[:b], seqs=seqs, cache=self.cache,
                              decode=DecodeMeta(self.tables[:b], self.lens[:b], self.max_context))

    # ---- the pieces -------------------------------------------------------------------------

    def piece(self, kind: str, layer: int, b: int) -> Piece:
        # attention reads the tiered requests' own buffers: the tier key's piece
        pieces = self._tier.pieces if kind == "attn" and self._tier is not None else self._pieces
        key = (kind, layer, b)
        piece = pieces.get(key)
        if piece is None:
            fn = {"embed": self._embed, "attn": self._attn, "experts": self._experts, "logits": self._logits}[kind]
            capture = self.capture and (kind != "experts" or self.offloaded[layer].capturable)
            piece = pieces[key] = Piece(lambda: fn(layer, b), self, capture)
        return piece

    def record(self, fn: Callable[[], Outputs]) -> tuple[Outputs, torch.cuda.CUDAGraph, Outputs]:
        """Run a piece's ``fn`` and capture it: (this run's outputs, the graph, the outputs its replays fill).

        The run is this step's real work, on a side stream (Triton compiles, cuBLAS picks its
        algorithms); the capture after it only records, so nothing runs twice. Pieces talk through
        static buffers only, so the capture's outputs are the ones later replays fill."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            out = fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self.pool):
            captured = fn()
        self.pool = graph.pool()
        return out, graph, captured

    def _embed(self, layer: int, b: int) -> Outputs:
        del layer
        self.hidden[:b].copy_(self.model.embed(self.ids[:b]))
        return {}

    def reads_selection(self, layer: int) -> bool:
        """Does ``layer``'s attention read an earlier indexer layer's top-k (IndexCache shared layers, MLI)?"""
        attn = self.model.layers[layer].self_attn
        if not getattr(attn, "uses_dsa", False):
            return False
        return attn.indexer is None or (attn.mli and layer != self._first_indexer)

    def _attn(self, layer: int, b: int) -> Outputs:
        block = self.model.layers[layer]
        ctx = self.context(b)
        if self.static:  # selections pass between pieces through the static buffer only
            ctx.selections = dict(enumerate(self.selection[:b].unbind(0))) if self.reads_selection(layer) else {}
        hidden = block.attend(self.hidden[:b], ctx)
        normed = block.ffn_input(hidden)
        if self.static and getattr(block.self_attn, "indexer", None) is not None:
            self.selection[:b].copy_(stacked_selections(list(ctx.selections.values())).view(b, 1, -1))
        routing = block.route(normed)
        if layer not in self.offloaded:
            self.hidden[:b].copy_(block.ffn(hidden, normed, routing))
            return {}
        self.hidden[:b].copy_(hidden)
        self.normed[:b].copy_(normed)
        self.expert_ids[:b].copy_(routing[0])
        self.expert_weights[:b].copy_(routing[1])
        shared = block.mlp.shared_experts
        if shared is not None:
            self.shared[:b].copy_(shared(normed))
        return {}

    def _experts(self, layer: int, b: int) -> Outputs:
        backend = self.offloaded[layer]
        rows = torch.arange(b, device=self.device) < self.valid  # (b,): padding rows route nowhere
        slots = torch.where(rows[:, None], self.slot_tables[layer][self.expert_ids[:b]], -1)  # (b, K) int32
        routed = torch.zeros(self.hidden[:b].shape, dtype=torch.float32, device=self.device)
        backend.compute_slots(routed, self.normed[:b], slots, self.expert_weights[:b])
        y = routed.to(self.hidden.dtype)  # as MoE.forward: routed in the activation dtype, + shared
        if self.model.layers[layer].mlp.shared_experts is not None:
            y = y + self.shared[:b]
        self.hidden[:b].add_(y)
        return {}

    def _logits(self, layer: int, b: int) -> Outputs:
        del layer
        return {"logits": self.model.logits(self.hidden[:b])}
