"""A long chat with tiered keys / latents keeps its cache across turns: finished requests' tiers are
parked in host RAM and the chat's next turn adopts them instead of computing the conversation again.

Tiered indexer keys and latents (``hearth.engine.tiers``) live per request outside the paged cache,
their bulk already in (pinned) host RAM. When a tiered request ends (finished, aborted or preempted;
not failed: an error may have left a layer half-written), ``TierCache.park`` keeps each layer's
host pool as it is and copies the small device-only summaries to the host
(``hearth.offload.parked``), covering the tokens whose keys and latents every layer has written:
the prompt and answer minus the last sampled token (it was never fed back), cut to whole pages. A
new request whose prompt starts with a parked chat's tokens adopts that state (``adopt``): its
tiers resume at that many tokens and only the rest of the prompt is prefilled, reported as cached
prompt tokens like a prefix-cache hit.

- Matching: the longest whole-page common prefix of the prompt and a parked chat's tokens (at least
  one prompt token is left to compute). A prompt that diverges mid-way (an edited message) adopts
  the state cut to the whole pages before the divergence: those tokens' keys and latents do not
  depend on anything after them. A request naming its conversation only looks at that
  conversation's parked chats.
- Ownership: adopting takes the state out of the cache (its host pools become the request's), so a
  state serves one request at a time; a second request with the same prefix meanwhile prefills it.
- Latents in the pages: with tiered keys only, the latents live in the paged cache, whose pages a
  request frees when it ends. The engine then keeps the prefix cache on for those pages (they are
  latents only) and caps each request's page hits at what its adopted keys cover
  (``BlockManager.allocate(max_cached=...)``), and the adopted keys are cut to the page hits: the
  two always cover the same tokens, and pages the GPU reused in between only shorten the hit.
  With tiered latents the prefix cache stays off: the parked state is all a request needs.
- Budget: at most ``budget_bytes`` of parked host memory; parking evicts the least recently parked
  chats beyond it, and a chat larger than the whole budget is not parked. A parked chat whose tokens
  a newer one of the same conversation extends is dropped (the newer serves every prompt it would).
- RAM only: parked chats do not survive the engine (no disk files, unlike the prefix cache's pages).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hearth.engine.block_manager import common_pages
from hearth.engine.config import ModelConfig
from hearth.engine.scheduler import Sequence
from hearth.engine.tiers import KeyTiers, LatentTiers


@dataclass(frozen=True)
class _Parked:
    token_ids: list[int]  # the tokens the state covers (whole pages)
    conversation: str | None
    keys: dict[int, Any]  # layer -> hearth.offload.parked.ParkedPages
    latents: dict[int, Any]  # layer -> hearth.offload.parked.ParkedRows
    nbytes: int


class TierCache:
    """Parked tiers of finished requests, least recently parked first (see the module doc)."""

    def __init__(self, model_config: ModelConfig, key_tiers: KeyTiers | None, latent_tiers: LatentTiers | None,
                 page_size: int, budget_bytes: int) -> None:
        self.key_tiers, self.latent_tiers = key_tiers, latent_tiers
        self.page_size = page_size
        self.budget_bytes = budget_bytes
        # the layers a request's tiers must all hold for its state to be whole
        self._key_layers = {layer for layer in range(model_config.num_hidden_layers)
                            if model_config.runs_indexer(layer)} if key_tiers is not None else set()
        self._latent_layers = set(range(model_config.num_hidden_layers)) if latent_tiers is not None else set()
        self._parked: OrderedDict[int, _Parked] = OrderedDict()
        self._next_key = 0
        self.nbytes = 0
        self.hit_tokens = 0  # prompt tokens served from parked states
        self.evictions = 0

    @property
    def needs_pages(self) -> bool:
        """Whether the latents live in the paged cache (tiered keys only): see the module doc."""
        return self.latent_tiers is None

    # ---- parking --------------------------------------------------------------------------------
    def park(self, seq: Sequence) -> None:
        """Keep the tiers of a request that ends (then the caller drops what is left of them)."""
        covered = self._covered(seq)
        if covered == 0 or self.budget_bytes <= 0:
            return
        keys = self.key_tiers.park(seq.request_id, covered) if self.key_tiers is not None else {}
        latents = self.latent_tiers.park(seq.request_id, covered) if self.latent_tiers is not None else {}
        nbytes = sum(state.nbytes for state in (*keys.values(), *latents.values()))
        if nbytes > self.budget_bytes:
            return
        parked = _Parked(seq.token_slice(0, covered), seq.conversation, keys, latents, nbytes)
        self._drop_where(lambda old: old.conversation == parked.conversation
                         and parked.token_ids[:len(old.token_ids)] == old.token_ids)
        self._parked[self._next_key] = parked
        self._next_key += 1
        self.nbytes += nbytes
        while self.nbytes > self.budget_bytes:
            self._remove(next(iter(self._parked)))
            self.evictions += 1

    def _covered(self, seq: Sequence) -> int:
        """Tokens (whole pages) whose keys and latents every layer of seq has written: not its last
        sampled token, nor a token whose step was cut short (the fewest any layer holds)."""
        held: list[int] = []
        for tiers, layers in ((self.key_tiers, self._key_layers), (self.latent_tiers, self._latent_layers)):
            if tiers is None:
                continue
            counts = tiers.held(seq.request_id)
            if set(counts) != layers:
                return 0  # a layer never ran for it: nothing whole to keep
            held.extend(counts.values())
        tokens = min([seq.num_computed, seq.num_tokens - 1, *held])
        return tokens // self.page_size * self.page_size

    # ---- adopting (hearth.engine.scheduler.PrefixStates) -------------------------------------------
    def match(self, seq: Sequence) -> int:
        """The most leading tokens of seq's prompt a parked state covers (whole pages, leaving one
        to compute); 0 when none does."""
        key = self._best(seq)
        return 0 if key is None else self._offer(seq, self._parked[key])

    def adopt(self, seq: Sequence, offered: int, paged_hit: int) -> int:
        """seq's tiers resume from the best parked state, cut to ``paged_hit`` when the latents are
        in the pages; returns the tokens seq starts with."""
        key = self._best(seq) if offered else None
        tokens = min(offered, paged_hit) if self.needs_pages else offered
        if key is None or tokens == 0:
            return 0
        parked = self._remove(key)
        if self.key_tiers is not None:
            self.key_tiers.resume(seq.request_id, parked.keys, tokens)
        if self.latent_tiers is not None:
            self.latent_tiers.resume(seq.request_id, parked.latents, tokens)
        self.hit_tokens += tokens
        return tokens

    def _best(self, seq: Sequence) -> int | None:
        """The parked state covering most of seq's prompt (of seq's conversation when it names one)."""
        best, most = None, 0
        for key, parked in self._parked.items():
            if seq.conversation is not None and parked.conversation != seq.conversation:
                continue
            tokens = self._offer(seq, parked)
            if tokens > most:
                best, most = key, tokens
        return best

    def _offer(self, seq: Sequence, parked: _Parked) -> int:
        limit = (seq.num_tokens - 1) // self.page_size  # (the last token is computed for its logits)
        ids = seq.token_slice(0, min(len(parked.token_ids), limit * self.page_size))
        return min(common_pages(parked.token_ids, ids, self.page_size), limit) * self.page_size

    # ---- forgetting -----------------------------------------------------------------------------
    def drop_conversation(self, conversation: str) -> int:
        """Forget the conversation's parked states (its chat was deleted); returns how many."""
        return self._drop_where(lambda parked: parked.conversation == conversation)

    def _drop_where(self, doomed: Callable[[_Parked], bool]) -> int:
        keys = [key for key, parked in self._parked.items() if doomed(parked)]
        for key in keys:
            self._remove(key)
        return len(keys)

    def _remove(self, key: int) -> _Parked:
        """Take a state out (its pinned pools are freed once nothing else holds them)."""
        parked = self._parked.pop(key)
        self.nbytes -= parked.nbytes
        return parked

    # ---- reporting ------------------------------------------------------------------------------
    def conversations(self) -> set[str]:
        return {p.conversation for p in self._parked.values() if p.conversation is not None}

    def stats(self) -> dict[str, float]:
        """For ``Engine.stats``: parked chats and their host bytes, prompt tokens served, evictions."""
        return {"tier_cache_chats": float(len(self._parked)), "tier_cache_bytes": float(self.nbytes),
                "tier_cache_hits_tokens": float(self.hit_tokens), "tier_cache_evictions": float(self.evictions)}
