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
  With tiered latents only, the indexer keys live in the pages: the same holds for them (the prefix
  cache on, page hits and adopted latents cut to each other; after a restart nothing is adopted, as those
  pages have no files: the prefix cache's RAM and disk tiers stay off with tiered latents). With both
  tiered the prefix cache stays off: the parked state is all a request needs.
- Budget: at most ``budget_bytes`` of parked host memory; parking evicts the least recently parked
  chats beyond it, and a chat larger than the whole budget is not kept in RAM (only on disk, below).
  A parked chat whose tokens a newer one of the same conversation extends is dropped (the newer
  serves every prompt it would).
- Disk: with a ``TierStore`` (``hearth.engine.tier_store``: a chat cache folder and a model loaded from
  a folder), a parked chat the RAM budget pushes out, or one larger than the whole budget, is written
  to a file, and ``flush`` (``Engine.close``) writes every chat held only in RAM; a new engine indexes
  the files when it starts. A prompt that matches a chat on disk reads it back into RAM (it stays on
  disk too, as the least recently parked chat's copy) and adopts it as any parked one; a file that is
  corrupt or stale is deleted and its tokens computed. A chat a newer parked one of the same
  conversation extends is deleted on disk too, and ``drop_conversation`` deletes the conversation's
  files. With tiered keys only, the latent pages the adopted keys need come back from the prefix
  cache's own files.
- Warm start: with ``preload`` (``prefix_cache_preload``), a ``TierPreload`` thread reads the store's
  newest chats, up to the RAM budget, into tensors of its own; this (the engine's) thread places them
  (``settle_preload``: before it looks for a chat on disk, and in ``stats``) as the least recently
  parked, only while the budget has room, after checking each file is still indexed (a file deleted
  meanwhile is dropped, an unsound one rejected as a read of its own would). A request needing a file
  still planned reads it itself (the thread skips it) or waits for the read under way.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hearth.engine.block_manager import common_pages
from hearth.engine.config import ModelConfig
from hearth.engine.scheduler import Sequence
from hearth.engine.tier_store import StoredChat, TierPreload, TierStore
from hearth.engine.tiers import KeyTiers, LatentTiers
from hearth.offload.parked import headroom


@dataclass
class _Parked:
    token_ids: list[int]  # the tokens the state covers (whole pages)
    conversation: str | None
    keys: dict[int, Any]  # layer -> hearth.offload.parked.ParkedPages
    latents: dict[int, Any]  # layer -> hearth.offload.parked.ParkedRows
    nbytes: int
    file: str | None = None  # its copy on disk (a ``TierStore`` file name)


class TierCache:
    """Parked tiers of finished requests, least recently parked first (see the module doc)."""

    def __init__(self, model_config: ModelConfig, key_tiers: KeyTiers | None, latent_tiers: LatentTiers | None,
                 page_size: int, budget_bytes: int, store: TierStore | None = None, *,
                 preload: bool | TierPreload = False) -> None:
        """``store``: where parked chats go when they leave RAM (None: they are forgotten);
        ``preload``: read its newest chats into RAM in the background (``TierPreload``), or the
        warm start ``Engine.load`` began from the folder before the weights loaded (its chats are
        checked against the store as they are placed)."""
        self.key_tiers, self.latent_tiers = key_tiers, latent_tiers
        self.page_size = page_size
        self.budget_bytes = budget_bytes
        self.store = store
        tiers = key_tiers or latent_tiers
        self._cuda = tiers is not None and tiers.device.type == "cuda"
        # the layers a request's tiers must all hold for its state to be whole
        self._key_layers = {layer for layer in range(model_config.num_hidden_layers)
                            if model_config.runs_indexer(layer)} if key_tiers is not None else set()
        self._latent_layers = set(range(model_config.num_hidden_layers)) if latent_tiers is not None else set()
        self._parked: OrderedDict[int, _Parked] = OrderedDict()
        self._next_key = 0
        self.nbytes = 0
        self.hit_tokens = 0  # prompt tokens served from parked states
        self.evictions = 0
        self.restored_chats = 0  # chats read back from disk
        # cumulative host time (ms) on the request path, for ``stats``: ``restore_ms`` adopting parked
        # chats (reading one back from disk, the evictions that makes, and the tiers' ``resume``: its
        # device copies), of it ``resume_ms`` the tiers' resume; ``match_ms`` every ``match`` (the
        # scheduler asks at each step a request waits; it includes reading back); ``park_ms`` parking
        # ended requests (and the evictions that makes); ``spill_ms`` writing chats the RAM budget
        # pushes out to disk (in parking or reading back, also counted there); ``flush_ms`` writing
        # the chats held only in RAM at close
        self.restore_ms = self.resume_ms = self.match_ms = 0.0
        self.park_ms = self.spill_ms = self.flush_ms = 0.0
        self._flushing = False
        # the warm start: chats the preload read and this thread placed in RAM, their bytes, and the
        # time requests waited for a file the preload was reading
        self.preloaded_chats = self.preloaded_bytes = 0
        self.preload_wait_ms = 0.0
        self._preload: TierPreload | None = None
        if isinstance(preload, TierPreload):
            if store is not None and budget_bytes > 0:
                self._preload = preload
            else:
                preload.cancel(timeout=0)
        elif store is not None and preload and budget_bytes > 0:
            chats = TierPreload.plan(store, budget_bytes)
            if chats:
                self._preload = TierPreload(store.folder, chats, pin=store.pin)

    def reset_counters(self) -> None:
        """Zero what ``stats`` counts of the requests so far (the engine's warm-up is not a user's)."""
        self.hit_tokens = self.evictions = self.restored_chats = 0
        self.restore_ms = self.resume_ms = self.match_ms = 0.0
        self.park_ms = self.spill_ms = self.flush_ms = 0.0

    @property
    def needs_pages(self) -> bool:
        """Whether part of a request's cache lives in the paged cache: the latents with tiered keys only,
        the indexer keys with tiered latents only (see the module doc)."""
        return self.latent_tiers is None or self.key_tiers is None

    # ---- parking --------------------------------------------------------------------------------
    def park(self, seq: Sequence) -> None:
        """Keep the tiers of a request that ends (then the caller drops what is left of them)."""
        start = time.perf_counter()
        try:
            self._park(seq)
        finally:
            self.park_ms += _ms_since(start)

    def _park(self, seq: Sequence) -> None:
        covered = self._covered(seq)
        if covered == 0 or self.budget_bytes <= 0:
            return
        keys = self.key_tiers.park(seq.request_id, covered) if self.key_tiers is not None else {}
        latents = self.latent_tiers.park(seq.request_id, covered) if self.latent_tiers is not None else {}
        nbytes = sum(state.nbytes for state in (*keys.values(), *latents.values()))
        if nbytes > self.budget_bytes and self.store is None:
            return
        parked = _Parked(seq.token_slice(0, covered), seq.conversation, keys, latents, nbytes)

        def extended(old: _Parked | StoredChat) -> bool:  # (the new state serves every prompt old would)
            return old.conversation == parked.conversation and parked.token_ids[:len(old.token_ids)] == old.token_ids

        self._drop_where(extended)
        if self.store is not None:
            for chat in [chat for chat in self.store.usable() if extended(chat)]:
                self.store.delete(chat.name)
        if nbytes > self.budget_bytes:
            self._spill(parked)
            return
        self._insert(parked)
        self._fit(keep=None)

    def _insert(self, parked: _Parked) -> int:
        key = self._next_key
        self._parked[key] = parked
        self._next_key += 1
        self.nbytes += parked.nbytes
        return key

    def _fit(self, keep: int | None) -> None:
        """Evict the least recently parked chats (to disk, when there is a store) beyond the budget,
        never ``keep`` (a chat just read back for a request)."""
        while self.nbytes > self.budget_bytes:
            key = next((k for k in self._parked if k != keep), None)
            if key is None:
                return
            self._spill(self._remove(key))
            self.evictions += 1

    def _spill(self, parked: _Parked) -> None:
        """Write a chat leaving RAM to disk, unless it is there already (or there is no disk)."""
        if self.store is None or parked.file is not None:
            return
        start = time.perf_counter()
        if self._cuda:
            torch.cuda.synchronize()  # the host pools' write-through copies must have landed
        parked.file = self.store.write(parked.token_ids, parked.conversation, parked.keys, parked.latents)
        if self._flushing:
            self.flush_ms += _ms_since(start)
        else:
            self.spill_ms += _ms_since(start)

    def flush(self) -> int:
        """Write every chat held only in RAM to disk (the engine is stopping); returns how many."""
        pending = [parked for parked in self._parked.values() if parked.file is None]
        self._flushing = True
        try:
            for parked in pending:
                self._spill(parked)
        finally:
            self._flushing = False
        return sum(parked.file is not None for parked in pending)

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
        start = time.perf_counter()
        try:
            key = self._best_in_ram(seq)
            return 0 if key is None else self._offer(seq, self._parked[key])
        finally:
            self.match_ms += _ms_since(start)

    def adopt(self, seq: Sequence, offered: int, paged_hit: int) -> int:
        """seq's tiers resume from the best parked state, cut to ``paged_hit`` when the latents are
        in the pages; returns the tokens seq starts with."""
        start, restored = time.perf_counter(), self.restore_ms  # (a read back here counts once)
        room = seq.num_tokens + headroom(seq.num_tokens)  # (the prompt and an eighth: no pool grows in its prefill)
        for tiers in (self.key_tiers, self.latent_tiers):
            if tiers is not None:
                tiers.reserve(seq.request_id, room)
        key = self._best_in_ram(seq) if offered else None
        tokens = min(offered, paged_hit) if self.needs_pages else offered
        if key is None or tokens == 0:
            return 0
        parked = self._remove(key)
        resuming = time.perf_counter()
        if self.key_tiers is not None:
            self.key_tiers.resume(seq.request_id, parked.keys, tokens)
        if self.latent_tiers is not None:
            self.latent_tiers.resume(seq.request_id, parked.latents, tokens)
        self.resume_ms += _ms_since(resuming)
        self.restore_ms = restored + _ms_since(start)
        self.hit_tokens += tokens
        return tokens

    def _best_in_ram(self, seq: Sequence) -> int | None:
        """The key of the parked state covering most of seq's prompt, read back from disk when the
        best is there (a file found unsound is deleted and the next best taken)."""
        self.settle_preload()
        while True:
            key = self._best(seq)
            if not isinstance(key, str):
                return key
            key = self._read_back(key)
            if key is not None:
                return key

    def _best(self, seq: Sequence) -> int | str | None:
        """The parked state covering most of seq's prompt (of seq's conversation when it names one):
        a key of RAM, else the name of a file when one on disk covers more."""
        best: int | str | None = None
        most = 0
        candidates: list[tuple[int | str, _Parked | StoredChat]] = list(self._parked.items())
        if self.store is not None:
            in_ram = {parked.file for parked in self._parked.values()}
            candidates += [(chat.name, chat) for chat in self.store.usable() if chat.name not in in_ram]
        for key, parked in candidates:
            if seq.conversation is not None and parked.conversation != seq.conversation:
                continue
            tokens = self._offer(seq, parked)
            if tokens > most:
                best, most = key, tokens
        return best

    def _read_back(self, name: str) -> int | None:
        """Read a chat from disk into RAM, as the most recently parked; its key, or None when its file
        was unsound (then deleted) or does not hold the states of every tiered layer."""
        start = time.perf_counter()
        try:
            return self._read_back_file(name)
        finally:
            self.restore_ms += _ms_since(start)

    def _read_back_file(self, name: str) -> int | None:
        assert self.store is not None
        chat = self.store.chats[name]
        taken = None
        if self._preload is not None:  # (the preload's read of it, waited for when it has begun)
            start = time.perf_counter()
            taken = self._preload.take(name)
            self.preload_wait_ms += _ms_since(start)
        if taken is None or self._indexed(taken[0]) is not chat:
            return self._place(chat, self.store.read(name), used=True, preloaded=False)
        return self._place(chat, self.store.settle_read(name, *taken[1]), used=True, preloaded=True)

    def _place(self, chat: StoredChat, states: tuple[dict[int, Any], dict[int, Any]] | None, *,
               used: bool, preloaded: bool) -> int | None:
        """Put a chat read from its file into RAM: ``used`` by a request, as the most recently parked
        (evicting others beyond the budget), else (preloaded, not asked for yet) as the least
        recently parked, only when the budget has room; its key, or None when its file was unsound
        (deleted), its states do not hold every tiered layer (deleted) or there was no room."""
        assert self.store is not None
        if states is None:
            return None
        keys, latents = states
        if set(keys) != (self._key_layers if self.key_tiers is not None else set()) \
                or set(latents) != self._latent_layers \
                or any(state.pages * self.page_size < len(chat.token_ids) for state in keys.values()) \
                or any(state.rows < len(chat.token_ids) for state in latents.values()):
            self.store.reject(chat.name, "its layers or sizes do not fit this engine's tiers")
            return None
        nbytes = sum(state.nbytes for state in (*keys.values(), *latents.values()))
        if not used and self.nbytes + nbytes > self.budget_bytes:
            self.stop_preload(timeout=0)  # (RAM filled up meanwhile: nothing is evicted for a preload)
            return None
        key = self._insert(_Parked(chat.token_ids, chat.conversation, keys, latents, nbytes, file=chat.name))
        if used:
            self._fit(keep=key)
        else:  # (preloaded newest first, each older than any chat this engine parked or used)
            self._parked.move_to_end(key, last=False)
        self.restored_chats += 1
        if preloaded:
            self.preloaded_chats += 1
            self.preloaded_bytes += nbytes
        return key

    # ---- the warm start (TierPreload) -----------------------------------------------------------
    def settle_preload(self) -> None:
        """Place the chats the preload read since the last call in RAM (a file deleted meanwhile is
        dropped, an unsound one rejected as a read of this thread's would be)."""
        if self._preload is None or self.store is None:
            return
        for read, (states, problem) in self._preload.claim():
            chat = self._indexed(read)
            if chat is None:
                continue  # (its file was deleted, evicted or found stale meanwhile: the copy goes)
            self._place(chat, self.store.settle_read(chat.name, states, problem, used=False),
                        used=False, preloaded=True)

    def _indexed(self, read: StoredChat) -> StoredChat | None:
        """The store's entry of the file a preload read, if it is still that file and usable (a warm
        start begun before the store opened planned from the files alone: no fingerprint check)."""
        assert self.store is not None
        chat = self.store.chats.get(read.name)
        if chat is None or chat.size != read.size or read.fingerprint != self.store.fingerprint:
            return None
        return chat

    def wait_preload(self, timeout: float | None = None) -> bool:
        """Wait until the preload read (or skipped) every file it planned, then place them; False
        on timeout."""
        done = self._preload is None or self._preload.wait(timeout)
        self.settle_preload()
        return done

    def yield_preload(self, busy: bool) -> None:
        """The engine serves requests (``busy``) or is idle: the preload holds meanwhile
        (``warm_start.BackgroundReads.set_busy``)."""
        if self._preload is not None:
            self._preload.set_busy(busy)

    def stop_preload(self, timeout: float | None = 10.0) -> bool:
        """Stop the preload (its outcomes not placed yet are dropped); whether its thread ended."""
        return self._preload is None or self._preload.cancel(timeout)

    @property
    def preload_running(self) -> bool:
        return self._preload is not None and self._preload.running

    def _offer(self, seq: Sequence, parked: _Parked | StoredChat) -> int:
        limit = (seq.num_tokens - 1) // self.page_size  # (the last token is computed for its logits)
        ids = seq.token_slice(0, min(len(parked.token_ids), limit * self.page_size))
        return min(common_pages(parked.token_ids, ids, self.page_size), limit) * self.page_size

    # ---- forgetting -----------------------------------------------------------------------------
    def drop_conversation(self, conversation: str) -> int:
        """Forget the conversation's parked states, in RAM and on disk (its chat was deleted);
        returns how many."""
        dropped = self._drop_where(lambda parked: parked.conversation == conversation)
        if self.store is not None:
            dropped += self.store.drop(conversation)
        return dropped

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
        ram = {p.conversation for p in self._parked.values() if p.conversation is not None}
        return ram | (self.store.conversations() if self.store is not None else set())

    def stats(self) -> dict[str, float]:
        """For ``Engine.stats``: parked chats and their host bytes, prompt tokens served, evictions;
        with a store, the chats and bytes on disk (any model's files in its folder), chats read back
        and files deleted as corrupt or stale; and the cumulative host times (``*_ms``) and bytes of
        the request path (see ``__init__`` and ``TierStore.__init__``): ``disk_read_ms`` is the whole
        reading of chats' files (of it ``pin_alloc_ms`` allocating their pinned tensors and
        ``disk_crc_ms`` checksumming), ``write_ms`` every file write (spills and close)."""
        self.settle_preload()  # (the engine host asks for stats on the engine thread)
        out = {"tier_cache_chats": float(len(self._parked)), "tier_cache_bytes": float(self.nbytes),
               "tier_cache_hits_tokens": float(self.hit_tokens), "tier_cache_evictions": float(self.evictions),
               "tier_cache_restore_ms": self.restore_ms, "tier_cache_resume_ms": self.resume_ms,
               "tier_cache_match_ms": self.match_ms, "tier_cache_park_ms": self.park_ms}
        if self.store is not None:
            store = self.store
            out.update(tier_cache_disk_chats=float(len(store.chats)),
                       tier_cache_disk_bytes=float(store.disk_bytes),
                       tier_cache_restored_chats=float(self.restored_chats),
                       tier_cache_files_rejected=float(store.files_rejected),
                       tier_cache_disk_read_ms=store.read_ms, tier_cache_disk_read_bytes=float(store.read_bytes),
                       tier_cache_pin_alloc_ms=store.alloc_ms, tier_cache_disk_crc_ms=store.crc_ms,
                       tier_cache_spill_ms=self.spill_ms, tier_cache_flush_ms=self.flush_ms,
                       tier_cache_write_ms=store.write_ms, tier_cache_write_crc_ms=store.write_crc_ms,
                       tier_cache_write_bytes=float(store.write_bytes), tier_cache_scan_ms=store.scan_ms,
                       tier_cache_preloaded_chats=float(self.preloaded_chats),
                       tier_cache_preloaded_bytes=float(self.preloaded_bytes),
                       tier_cache_preload_running=float(self.preload_running),
                       tier_cache_preload_wait_ms=self.preload_wait_ms,
                       tier_cache_preload_read_ms=self._preload.read_ms if self._preload is not None else 0.0)
        return out


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3
