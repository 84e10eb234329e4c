"""The Engine facade: the one object the CLI, the HTTP server, the GUI's engine host and the
benchmarks drive.

    engine = Engine.load(path, EngineConfig())
    rid = engine.add_request(messages=[...], sampling=SamplingParams(temperature=0))
    while engine.has_unfinished():
        for event in engine.step(): ...        # TokenDelta / Finished

or ``for event in engine.generate(messages=..., sampling=...)`` for a single request.
``add_request`` and ``abort`` may be called from other threads; ``step`` runs on one thread, and
``drop_conversation`` / ``close`` run on it or between its steps.

Overlapped decode (``EngineConfig.overlap_decode``, on by default). A step whose every request
decodes one token samples on the device and leaves its tokens there (a ``Flight``,
``hearth.engine.overlap``). The next ``step`` launches step N+1 with those tokens as its input ids
(a device-side copy: positions, cache slots and block tables are known without the token values;
the block manager holds a placeholder for the token until it lands), and only then reads step N's
tokens back (a non-blocking copy into pinned memory and an event) and detokenises, checks stops and
builds events while the GPU runs step N+1. So each ``step`` call launches one step and lands the one
before; a request's tokens arrive one call later than without overlap, the same tokens.

- A request that finishes when its step-N token lands (EOS, stop token or string, abort) has a row
  in step N+1: that row's token is dropped unread and never counted. Requests whose step-N token is
  certainly their last (``max_tokens``, the context limit) get no row in step N+1.
- Its cache pages are freed at once. That is safe against the step still running: every later use of
  a page (another request's prefill or decode, a prefix-cache restore or spill) is queued on the same
  CUDA stream after that step, and the dropped row writes only the cache slot of its own newest
  token, in a page no other request shares (shared pages are whole, registered prefixes).
- Seeded requests draw from their own generator in the same order as without overlap, so they (and
  greedy requests) give the same tokens; a finished request's dropped draw uses only its own
  generator. Unseeded random requests share the default generator and are not reproducible anyway.
- A step falls back to running synchronously (land the flight, then schedule as usual) when a prompt
  may join (waiting requests and a free seat), a running request is not in the flight (a prompt
  being read), a request's cache must grow and no page is free without preempting, the runahead
  decoder is in use (or ``scheduler=auto`` would switch), or a request uses repetition, presence or
  frequency penalties: those read the token history on the host, so such steps never fly. Nor do steps
  with a structured answer (``SamplingParams.json_schema``): its next mask depends on the token before.
- ``stats()``' ``decode_step_ms`` is the wall time of a decode ``step`` call (with overlap: launching
  step N+1 and landing step N, waiting for it included) and ``decode_run_gpu_ms`` the GPU time of
  ``ModelRunner.run`` alone; in steady decoding the first is the time per token. ``decode_steps_*``
  count steps by how they ran: ``overlapped``, ``sync_<reason>`` after a flight that could not launch
  the next step (``prompt_may_join``, ``request_not_in_flight``, ``no_free_page``, ...), and
  ``sync_previous_step_not_in_flight``. A cache page that fills does not stop the overlap: the token
  in flight takes a free page (``BlockManager.append`` with a placeholder) when the step launches.
- ``step(launched=...)`` calls back once the step's model work is launched, before the host waits
  for its tokens; the server's host hands the previous step's events to the HTTP loop then.

A request whose ``SamplingParams.json_schema`` is set is held to that JSON Schema (structured output,
``hearth.engine.structured``): before each of its tokens is sampled, the tokens that cannot continue
the JSON are masked (after a thinking model's reasoning), and it ends with "stop" once the JSON is whole.

A request may name its conversation (``conversation_id``): its cache pages are tagged with it, kept
in RAM and on disk after the GPU reuses them (``hearth.engine.prefix_store``) and deleted by
``drop_conversation``. ``Engine.load`` with a cache folder starts the warm start first
(``prefix_store.Preload``): the newest saved pages are read back into RAM while the weights load.
With tiered keys or latents a request's state outside the pages is parked in RAM when it ends and
adopted by the chat's next turn (``hearth.engine.tier_cache``); with a cache folder, chats leaving
RAM and those ``close`` saves go to files (``hearth.engine.tier_store``) a later engine adopts.

``warm_up`` runs synthetic requests before the first user request (``hearth.engine.warm_up``), so
that request finds the kernels compiled and the decode graphs captured; the engine host calls it
when ``EngineConfig.warm_up`` asks for it (``wants_warm_up``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
import uuid
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from hearth.engine import api
from hearth.engine.api import (
    ContextLengthError,
    EngineConfig,
    EngineStats,
    Event,
    Finished,
    FinishReason,
    HearthError,
    RequestError,
    RequestStats,
    SamplingParams,
    SchedulerName,
    TokenDelta,
    auto_scheduler,
)
from hearth.engine.block_manager import BlockManager
from hearth.engine.link_gate import AHEAD, SYNC, RunaheadGate
from hearth.engine.overlap import Flight, TokenReadback, device_index
from hearth.engine.prefix_store import PageTier, PrefixStore, Preload, fingerprint, model_key
from hearth.engine.runahead import RunaheadDecoder
from hearth.engine.runner import ModelRunner, StepInput, resolve_device
from hearth.engine.sampling import Sampler, make_generator
from hearth.engine.scheduler import Scheduler, Status
from hearth.engine.scheduler import Sequence as Seq
from hearth.engine.step_timer import StepTimer
from hearth.engine.structured.matcher import DONE, REFUSED, JsonAnswer, StructuredOutputs
from hearth.engine.text.detokenizer import IncrementalDetokenizer, StopChecker
from hearth.engine.text.harmony import uses_harmony
from hearth.engine.text.tokenizer import Tokenizer
from hearth.engine.tier_cache import TierCache
from hearth.engine.tier_store import FORMAT_VERSION as TIER_FORMAT
from hearth.engine.tier_store import TierPreload, TierStore, tier_folder
from hearth.engine.warm_up import ANSWER_TOKENS, CONVERSATION, Limits, warm_up_rounds, warm_up_token_ids
from hearth.offload.expert_cache import ExpertCache


@dataclass
class _Request:
    seq: Seq
    detok: IncrementalDetokenizer
    stop: StopChecker
    generator: torch.Generator | None
    arrival: float
    answer: JsonAnswer | None = None  # structured output: the grammar the answer is held to
    first_token_time: float | None = None
    text: str = ""
    events: list[Event] = field(default_factory=list)


logger = logging.getLogger("hearth.engine")

_OOM_MESSAGE = "the GPU ran out of memory; lower the context length or the number of concurrent requests"


_RATE_WINDOW_S = 5.0  # tok/s in stats averages the steps of the last 5 s
_CONVERSATION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_GIB = 1 << 30
_AUTO_HOST_CACHE_GIB = 4.0
_AUTO_TIER_CACHE_GIB = 32.0  # parked long chats: about six at 64K tokens on DeepSeek-V3.2 (keys + latents)
_PERSIST_BATCH = 64  # pages copied to the host at once when the engine stops
_IN_FLIGHT = (-1,)  # a token sampled on the device and not read back yet (a StepInput's placeholder)


class Engine:
    """Continuous batching over a loaded model: requests join and leave at any step."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig,
                 generation_defaults: Mapping[str, Any] | None = None, *, preload: Preload | None = None,
                 tier_preload: TierPreload | None = None) -> None:
        """``preload`` / ``tier_preload``: the warm starts of the chat cache's pages and of its parked
        long chats that ``Engine.load`` began before the weights loaded (else they are started here
        when ``config`` asks for them; one the model does not use is stopped)."""
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        # The model's recommended temperature / top_p / top_k, for requests that leave them unset.
        self.generation_defaults = dict(generation_defaults or {})
        self.model_config = runner.model_config
        self.max_model_len = runner.max_model_len
        # Tiered keys and latents live per request outside the pages: a finished request's are parked
        # in RAM, then on disk, for its chat's next turn (hearth.engine.tier_cache). With tiered keys
        # only, the pages hold the latents and stay a prefix cache (RAM and disk behind it).
        tiered = runner.key_tiers is not None or runner.latent_tiers is not None
        warm_tiers = tier_preload or config.prefix_cache_preload
        self.tier_cache = TierCache(runner.model_config, runner.key_tiers, runner.latent_tiers, runner.block_size,
                                    _tier_cache_bytes(config), _tier_store(runner, config),
                                    preload=warm_tiers) if tiered else None
        if tier_preload is not None and not tiered:
            tier_preload.cancel(timeout=0)
        self.prefix_tier = None if runner.latent_tiers is not None else _prefix_tier(runner, config, preload)
        if preload is not None and (self.prefix_tier is None or self.prefix_tier.store.preload is not preload):
            preload.cancel(wait=False)  # (no pages on disk to warm: tiered latents)
        self.blocks = BlockManager(runner.num_blocks, runner.block_size,
                                   enable_prefix_caching=self.tier_cache is None or self.tier_cache.needs_pages,
                                   tier=self.prefix_tier)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   states=self.tier_cache)
        self._prompt_tokens = tokenizer.prompt_tokens()
        self.sampler = Sampler()
        self.structured = StructuredOutputs(tokenizer, self.model_config.vocab_size, self.model_config.model_type)
        self._requests: dict[str, _Request] = {}
        self._intake: list[_Request] = []
        self._aborts: list[str] = []
        self._lock = threading.Lock()
        self._generated = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of the last 5 s of steps, for tok/s
        device = getattr(runner, "device", None)
        self.timer = StepTimer(enabled=device is not None and device.type == "cuda")
        # "auto" picks a scheduler per step (api.auto_scheduler) when experts are offloaded; resident
        # experts decode synchronously. "runahead" with offloaded experts is auto whose choice for
        # several requests is runahead: a lone request runs the sync step with overlapped decode, and so
        # do several whose routed experts every layer's pool holds at once (requests x top-k <= slots).
        expert_cache: ExpertCache | None = getattr(runner, "expert_cache", None)
        offloaded = expert_cache is not None
        self._auto = config.scheduler in ("auto", "runahead") and offloaded
        self._several: SchedulerName | None = "runahead" if config.scheduler == "runahead" else None
        self._runahead = config.scheduler == "runahead" and not offloaded  # new tokens start in the decoder
        self.decoder: RunaheadDecoder | None = None
        # auto builds the decoder only where its choice for several requests is runahead (not by default)
        if config.scheduler == "runahead" or (self._auto and api.AUTO_SEVERAL_REQUESTS == "runahead"):
            self.decoder = RunaheadDecoder(runner.model, runner.cache, runner.residency, runner.device,
                                           pieces=getattr(runner, "pieces", None), sync_step=runner.run,
                                           tiers=getattr(runner, "decode_tiers", None))
            self.scheduler.on_preempt.append(lambda seq: self.decoder.drop(seq.request_id))
        self.scheduler.on_preempt.append(lambda seq: self._release(seq, park=True))
        self._pool_requests = None if expert_cache is None else \
            _pool_requests(expert_cache, runner.model_config.num_experts_per_tok)
        # auto runs runahead for several requests only where sync rounds leave the link idle and a trial
        # beats them (hearth.engine.link_gate); a host-memory cache has no link to measure (nor a copy to
        # overlap), so runahead runs there as asked (the CPU tests exercise it)
        self.runahead_gate = RunaheadGate(expert_cache.copy_seconds) \
            if self._auto and self.decoder is not None and expert_cache.is_cuda else None
        self._gate_interval: tuple[str, int, int] | None = None  # the last step, as the gate counts it
        self._gate_start = 0.0
        self._auto_choice = self._auto_pick(1)
        self._flight: Flight | None = None  # overlapped decode: the step launched and not yet landed
        # Steps by how they ran: "overlapped"; "sync_<why>" for a step after a flight that could not
        # launch from it (it may read a prompt too); "sync_previous_step_not_in_flight" for a decode
        # step with no flight before it (after prompts, penalties, overlap off).
        self.decode_steps: Counter[str] = Counter()
        self._readback = TokenReadback(device, config.max_num_seqs) if device is not None else None
        self.warm_up_s: float | None = None  # how long ``warm_up`` took (None: it did not run)

    @classmethod
    def load(cls, path: str, config: EngineConfig | None = None) -> Engine:
        """Load a model folder (config.json, safetensors, tokenizer files)."""
        config = config or EngineConfig()
        # the chat cache's warm starts read while the weights load
        preload, tier_preload = _start_preload(path, config), _start_tier_preload(path, config)
        try:
            runner = ModelRunner.load(str(path), config)
            tokenizer = Tokenizer.from_pretrained(path, runner.model_config.model_type)
            return cls(runner, tokenizer, config, generation_defaults(Path(path)), preload=preload,
                       tier_preload=tier_preload)
        except BaseException:
            if preload is not None:
                preload.cancel()
            if tier_preload is not None:
                tier_preload.cancel()
            raise

    # ---- requests --------------------------------------------------------------------------

    def encode(self, messages: Sequence[dict[str, Any]] | None = None, prompt: str | None = None,
               prompt_token_ids: Sequence[int] | None = None, *, max_tokens: int | None = None,
               conversation_id: str | None = None, **chat_options: Any) -> list[int]:
        """Prompt token ids from exactly one of: chat messages, raw text, token ids. With
        ``max_tokens``, text that certainly encodes to more tokens is refused before tokenising
        (``ContextLengthError``). A chat's ``conversation_id`` lets a follow-up turn tokenise only what
        its last prompt lacked (``hearth.engine.text.prompt_tokens``: the same ids). ``chat_options``
        go to ``Tokenizer.chat_prompt`` (``add_generation_prompt``, ``continue_final_message``,
        template variables)."""
        given = [x is not None for x in (messages, prompt, prompt_token_ids)]
        if sum(given) != 1:
            raise RequestError("give exactly one of messages, prompt or prompt_token_ids")
        if prompt_token_ids is not None:
            return token_list(prompt_token_ids)

        def refuse(fewest: int) -> None:
            if max_tokens is not None and fewest > max_tokens:
                raise ContextLengthError(fewest, self.max_model_len, at_least=True)

        if messages is None:
            assert prompt is not None
            if max_tokens is not None:
                refuse(self.tokenizer.fewest_tokens(prompt))
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        text = self.tokenizer.chat_prompt(list(messages), **chat_options)
        if conversation_id is not None:
            self._adopt_saved_prompt(conversation_id)
            return self._prompt_tokens.encode(text, conversation_id, refuse)
        if max_tokens is not None:
            refuse(self.tokenizer.fewest_tokens(text))
        # NOTE: a chat prompt's text already holds BOS, so special tokens are added to raw text only.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _adopt_saved_prompt(self, conversation_id: str) -> None:
        """After a restart, the conversation's prompt as the last engine tokenised it (saved by
        ``close`` with its pages), so its first turn here tokenises only the new text."""
        tier = self.prefix_tier
        if tier is None or conversation_id in self._prompt_tokens:
            return
        record = tier.store.load_prompt(conversation_id)
        if record is not None and not self._prompt_tokens.adopt(conversation_id, record):
            logger.warning("the saved prompt of conversation %s does not fit this tokenizer; tokenising it whole",
                           conversation_id)

    def add_request(self, messages: Sequence[dict[str, Any]] | None = None, *, prompt: str | None = None,
                    prompt_token_ids: Sequence[int] | None = None,
                    sampling: SamplingParams | Mapping[str, Any] | None = None,
                    request_id: str | None = None, conversation_id: str | None = None,
                    **chat_options: Any) -> str:
        """Queue a request; returns its id. Raises RequestError if it can never run.
        ``conversation_id`` tags its cache pages (see ``drop_conversation``).

        ``sampling`` is either complete ``SamplingParams``, used as given, or what the user asked
        for as ``SamplingParams`` keywords (None or missing = not given): the model's
        generation_config.json fills temperature / top_p / top_k, and ``max_tokens`` defaults to
        the rest of the context and is capped there.
        """
        check_conversation_id(conversation_id)
        ids = self.encode(messages, prompt, prompt_token_ids, conversation_id=conversation_id, **chat_options)
        self._validate(ids)
        params = sampling if isinstance(sampling, SamplingParams) else self.sampling_params(sampling or {}, len(ids))
        params.check_vocabulary(self.model_config.vocab_size)
        answer = None if params.json_schema is None else self.structured.answer(params.json_schema, params, ids)
        request_id = request_id or uuid.uuid4().hex
        seq = Seq(request_id=request_id, prompt_ids=ids, params=params, conversation=conversation_id)
        request = _Request(
            seq=seq,
            # Harmony (gpt-oss) marks its channels with special tokens; the chat layer parses them out.
            detok=IncrementalDetokenizer(self.tokenizer, ids,
                                         skip_special_tokens=not uses_harmony(self.runner.model_config.model_type)),
            stop=StopChecker(params.stop),
            generator=make_generator(params.seed, self.runner.device),
            arrival=time.perf_counter(),
            answer=answer,
        )
        with self._lock:
            if request_id in self._requests or any(r.seq.request_id == request_id for r in self._intake):
                raise RequestError(f"request id {request_id!r} is already in use")
            self._intake.append(request)
        return request_id

    def sampling_params(self, given: Mapping[str, Any], prompt_tokens: int) -> SamplingParams:
        """The request policy: what the user gave, the model's defaults for the rest, and an answer
        that fits the context (``max_tokens`` unset or larger means "up to the end")."""
        chosen = {k: v for k, v in given.items() if v is not None}
        room = self.max_model_len - prompt_tokens
        max_tokens = min(chosen.pop("max_tokens", room), room)
        return SamplingParams(**{**self.generation_defaults, **chosen}, max_tokens=max_tokens)

    @property
    def _cache_tokens(self) -> int:
        """Tokens the cache's pages hold: what one request can grow to (with every other preempted)."""
        return self.blocks.num_blocks * self.runner.block_size

    def _validate(self, ids: list[int]) -> None:
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(len(ids), self.max_model_len)
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:  # (min and max in C: prompts are tens of thousands of ids)
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        blocks_needed = -(-(len(ids) + 1) // self.runner.block_size)
        if blocks_needed > self.blocks.num_blocks:
            raise RequestError(f"the prompt needs {blocks_needed} cache pages but only "
                               f"{self.blocks.num_blocks} exist")

    def abort(self, request_id: str) -> None:
        """Stop a request; its Finished(reason='abort') comes from the next step."""
        with self._lock:
            self._aborts.append(request_id)

    def drop_conversation(self, conversation_id: str) -> int:
        """Delete the conversation's cached pages on the device, in RAM and on disk (pages other
        conversations used too only lose its tag); returns how many were deleted. Call it between
        steps."""
        check_conversation_id(conversation_id)
        self._prompt_tokens.forget(conversation_id)
        dropped = self.blocks.drop_conversation(conversation_id)
        if self.prefix_tier is not None:
            dropped += self.prefix_tier.store.drop(conversation_id)
        if self.tier_cache is not None:
            dropped += self.tier_cache.drop_conversation(conversation_id)
        return dropped

    def close(self) -> int:
        """Save the device's cached pages to disk, so a later engine on the same model and cache
        folder starts with them, and the conversations' tokenised prompts beside them, and the
        parked long chats held only in RAM; returns how many pages and chats were written. Call it
        between steps."""
        chats = 0
        if self.tier_cache is not None:
            self.tier_cache.stop_preload()
            chats = self.tier_cache.flush()
        tier = self.prefix_tier
        if tier is None or tier.store.folder is None:
            return chats
        tier.store.cancel_preload()
        pages = self.blocks.cached_blocks()
        for start in range(0, len(pages), _PERSIST_BATCH):
            tier.spill(pages[start:start + _PERSIST_BATCH])
        written = tier.store.flush()
        tier.store.save_prompts({c: record for c in self._prompt_tokens.conversations()
                                 if (record := self._prompt_tokens.to_bytes(c)) is not None})
        return written + chats

    @property
    def wants_warm_up(self) -> bool:
        """Whether ``config.warm_up`` asks for ``warm_up`` on this engine ("auto": on CUDA, where the first
        request would compile kernels and capture graphs; on the CPU there is nothing to pay ahead)."""
        device = getattr(self.runner, "device", None)
        return self.config.warm_up == "true" or (self.config.warm_up == "auto" and device is not None
                                                 and device.type == "cuda")

    def warm_up(self) -> float:
        """Run the warm-up's requests (``hearth.engine.warm_up``) through the ordinary step loop before any
        user request; returns its duration, which ``stats()`` reports as ``warm_up_s``.

        Nothing of it remains: its requests finish and free their pages; its pages leave the prefix
        cache (a user's prompt cannot hit them); the RAM and disk tiers behind the prefix cache are
        detached meanwhile, so nothing is spilled, restored or written and a warm start's pages are
        left alone; with experts in RAM no expert is copied and the cache forgets every expert the
        warm-up routed to (``_no_expert_copies``); the counters ``stats()`` reports and auto's runahead
        gate start from zero after it. Raises HearthError when
        a warm-up request fails (the GPU ran out of memory)."""
        if self._generated or self.has_unfinished():
            raise RuntimeError("the warm-up runs before the engine's first request")
        start = time.perf_counter()
        limits = Limits(self.runner.block_size, self.max_model_len, self.blocks.num_blocks, self.config.max_num_seqs,
                        self.config.max_num_batched_tokens)
        with self._set_aside(), self._no_expert_copies():
            rounds = warm_up_rounds(warm_up_token_ids(self.tokenizer, self.model_config.vocab_size), limits)
            for i, prompts in enumerate(rounds):
                self._run_aside(prompts)
                if i >= 1:  # the second prompt found the first's pages; every later one is read whole
                    self._forget_warm_up()
            if self.decoder is not None:  # its micro-steps' own graphs (the rounds above ran sync steps)
                self.decoder.warm_up(self.config.max_num_seqs)
        self.warm_up_s = time.perf_counter() - start
        return self.warm_up_s

    @contextlib.contextmanager
    def _set_aside(self) -> Iterator[None]:
        """Work that is not the users' (``warm_up``): see its doc for what this keeps apart."""
        tier, self.blocks.tier = self.blocks.tier, None
        try:
            yield
        finally:
            self.blocks.tier = tier
            self._forget_warm_up()
            if self.tier_cache is not None:
                self.tier_cache.reset_counters()
            self._generated = 0
            self._recent.clear()
            self.decode_steps.clear()
            self.timer = StepTimer(enabled=self.timer.enabled)
            self.blocks.hit_tokens = self.blocks.restored_tokens = 0
            self.runner.reset_stats()
            if self.runahead_gate is not None:  # (the warm-up's rounds copied nothing: no measure of the link)
                self.runahead_gate.reset()
            self._gate_interval = None

    @contextlib.contextmanager
    def _no_expert_copies(self) -> Iterator[None]:
        """With experts in RAM: the warm-up's expert fetches copy nothing (``ExpertCache.dry_copies``; its
        outputs are thrown away), so its prompts up to a whole prefill chunk compile the kernels a user's
        would without streaming the experts they route to over the link (seconds a prompt on a large model).
        The runahead decoder's holds are let go at the end, and every expert it fetched is forgotten."""
        cache = self.runner.expert_cache
        if cache is None:
            yield
            return
        with cache.dry_copies():
            try:
                yield
            finally:
                if self.decoder is not None:
                    self.decoder.release_holds()

    def _forget_warm_up(self) -> None:
        """Drop the warm-up's pages from the prefix cache and its chats from the tier cache."""
        self.blocks.drop_conversation(CONVERSATION)
        if self.tier_cache is not None:
            self.tier_cache.drop_conversation(CONVERSATION)

    def _run_aside(self, prompts: list[list[int]]) -> None:
        """Run ``prompts`` together to their end, greedy; raises HearthError if one fails."""
        params = SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS, ignore_eos=True)
        for ids in prompts:
            self.add_request(prompt_token_ids=ids, sampling=params, conversation_id=CONVERSATION)
        try:
            while self.has_unfinished():
                for event in self.step():
                    if isinstance(event, Finished) and event.reason == "error":
                        raise HearthError(f"the engine's warm-up failed: {event.error}")
        except torch.OutOfMemoryError:  # (outside the model's forward, whose OOM fails its requests instead)
            raise HearthError(f"the engine's warm-up failed: {_OOM_MESSAGE}") from None

    def discard(self) -> None:
        """Stop the engine's background work without saving anything (its load failed after it was built)."""
        if self.prefix_tier is not None:
            self.prefix_tier.store.cancel_preload()
        if self.tier_cache is not None:
            self.tier_cache.stop_preload()

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._intake or self._aborts) or self.scheduler.has_work()

    # ---- the step --------------------------------------------------------------------------

    def step(self, launched: Callable[[], None] | None = None) -> list[Event]:
        """Run one scheduling step; returns the events it produced, in order. ``launched`` (if
        given) is called once the step's model work is launched and before the host waits for its
        tokens: work handed to other threads then runs while this one waits on the device.

        The warm starts (the chat cache's reads from disk) hold while requests run, from this step
        until a step leaves none (``warm_start.BackgroundReads``)."""
        self._yield_warm_starts(True)
        try:
            return self._step(launched)
        finally:
            busy = self.has_unfinished()
            self._yield_warm_starts(busy)
            if not busy:  # the time until the next request arrives is no decode round
                self._gate_interval = None

    def _yield_warm_starts(self, busy: bool) -> None:
        if self.prefix_tier is not None:
            self.prefix_tier.store.yield_preload(busy)
        if self.tier_cache is not None:
            self.tier_cache.yield_preload(busy)

    def _step(self, launched: Callable[[], None] | None) -> list[Event]:
        self._gate_tick()
        events = self._take_intake()
        flight, self._flight = self._flight, None
        if flight is not None:
            rows, fallback = self._next_rows(flight)
            if rows:
                self.decode_steps["overlapped"] += 1
                self._gate_count(SYNC, len(rows))
                return events + self._overlapped_step(flight, rows, launched)
            self.decode_steps[f"sync_{fallback}"] += 1
            events += self._land(flight)
        if self._auto:
            self._choose_scheduler()
        # Tokens in flight in the decoder finish there (after auto switched away from runahead).
        in_flight = self.decoder.flights if self.decoder is not None else {}
        chunks = self.scheduler.schedule(include_decodes=not self._runahead, busy=in_flight)
        decoding = bool(chunks) and all(c.num_tokens == 1 for c in chunks)
        if decoding and flight is None:
            self.decode_steps["sync_previous_step_not_in_flight"] += 1
        self.timer.begin(decoding, prompt=bool(chunks))
        marks = self.timer.around_run()
        if chunks:
            if self.decoder is not None:
                self.decoder.release_holds()  # the step's experts may need every slot of the expert cache
            try:
                if marks is not None:
                    marks[0].record()
                logits = self.runner.run([
                    StepInput(self.blocks.table_view(c.seq.request_id), c.seq.num_computed,
                              c.seq.token_slice(c.seq.num_computed, c.seq.num_computed + c.num_tokens),
                              c.seq.request_id)
                    for c in chunks
                ])
                if marks is not None:
                    marks[1].record()
            except torch.OutOfMemoryError:
                return events + self._fail_all([c.seq for c in chunks], _OOM_MESSAGE)
            if launched is not None:
                launched()
            self.scheduler.after_step(chunks)
            ready = [i for i, c in enumerate(chunks) if c.seq.num_computed == c.seq.num_tokens]
            rows = logits if len(ready) == len(chunks) else logits[ready]  # (decode: every row, no gather)
            requests = [self._requests[chunks[i].seq.request_id] for i in ready]
            if len(ready) == len(chunks) and self._may_fly(requests, chunks):
                self._flight = self._fly(requests, rows)
            else:
                events += self._sample(requests, rows)
        if chunks and decoding:
            self._gate_count(SYNC, len(chunks))
        if self.decoder is not None and len(self.decoder):
            if not chunks:
                self._gate_count(AHEAD, len(self.decoder))
            events += self._runahead_step()
        self.timer.end(marks)
        return events

    # ---- auto's runahead gate (hearth.engine.link_gate) ------------------------------------

    def _auto_pick(self, num_requests: int) -> SchedulerName:
        choice = auto_scheduler(num_requests, self._several, self._pool_requests)
        if choice == "runahead" and self.runahead_gate is not None and not self.runahead_gate.allows(num_requests):
            return "sync"
        return choice

    def _gate_count(self, kind: str, num_requests: int) -> None:
        """This step is one the gate measures: a sync decode round of every request answered, or a
        runahead micro-step (its finished tokens are added by _runahead_step)."""
        if self.runahead_gate is None:
            return
        mixed = self.scheduler.waiting or (kind == SYNC and self.decoder is not None and len(self.decoder))
        self._gate_interval = None if mixed else (kind, num_requests, 0)

    def _gate_tick(self) -> None:
        """Give the gate the interval since the previous step's start, if that step counts."""
        if self.runahead_gate is None:
            return
        now = time.perf_counter()
        interval, self._gate_interval = self._gate_interval, None
        if interval is not None:
            kind, n, tokens = interval
            if kind == SYNC:
                self.runahead_gate.sync_round(n, now - self._gate_start)
            else:
                self.runahead_gate.ahead(n, tokens, now - self._gate_start)
        self.runahead_gate.begin()
        self._gate_start = now

    # ---- overlapped decode (the module doc) ------------------------------------------------

    def _may_fly(self, requests: list[_Request], chunks: list) -> bool:
        """Whether this step's tokens may stay on the device as the next step's input."""
        # (a structured answer's mask depends on the token before: it is read back before the next)
        return (self.config.overlap_decode and self._readback is not None and not self._runahead
                and (self.decoder is None or not len(self.decoder))
                and all(c.num_tokens == 1 for c in chunks)
                and not any(_reads_history(r.seq.params) or r.answer is not None for r in requests))

    def _fly(self, requests: list[_Request], logits: torch.Tensor) -> Flight:
        tokens = self._sample_on_device(requests, logits)
        return Flight(requests, tokens, self._readback.start(tokens))

    def _next_rows(self, flight: Flight) -> tuple[list[int], str]:
        """The flight's rows that decode again in a step launched before the flight lands, or []
        and why the next step must run synchronously (the module doc lists when)."""
        scheduler = self.scheduler
        if self._runahead or (self.decoder is not None and len(self.decoder)):
            return [], "runahead"
        if scheduler.waiting and len(scheduler.running) < self.config.max_num_seqs:
            return [], "prompt_may_join"
        live = [i for i, r in enumerate(flight.requests) if r.seq.status is Status.RUNNING]
        if len(live) != len(scheduler.running):
            return [], "request_not_in_flight"
        if self._auto and self._auto_pick(len(live)) != self._auto_choice:
            return [], "scheduler_change"
        rows = [i for i in live if not self._ends_by_length(flight.requests[i].seq)]
        if not rows:
            return [], "every_token_is_last"
        if len(rows) > self.config.max_num_batched_tokens:
            return [], "token_budget"
        if not self.blocks.can_append_each([flight.requests[i].seq.request_id for i in rows]):
            return [], "no_free_page"
        return rows, ""

    def _ends_by_length(self, seq: Seq) -> bool:
        """Whether the token in flight is certainly the request's last (max_tokens or the context)."""
        return len(seq.output_ids) + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= self.max_model_len

    def _overlapped_step(self, flight: Flight, rows: list[int], launched: Callable[[], None] | None) -> list[Event]:
        """Launch the next decode step of ``rows`` from the flight's tokens on the device, then land
        the flight while that step runs."""
        self.timer.begin(True)
        marks = self.timer.around_run()
        requests = [flight.requests[i] for i in rows]
        inputs = []
        for request in requests:
            seq = request.seq
            self.blocks.append(seq.request_id, _IN_FLIGHT)  # the token's value comes when it lands
            inputs.append(StepInput(self.blocks.table_view(seq.request_id), seq.num_tokens, _IN_FLIGHT,
                                    seq.request_id))
            seq.num_computed += 1  # (its pages are registered once the token lands: _land)
        ids = flight.tokens if len(rows) == len(flight.requests) else \
            flight.tokens.index_select(0, device_index(rows, flight.tokens.device))
        try:
            if marks is not None:
                marks[0].record()
            logits = self.runner.run(inputs, input_ids=ids)
            if marks is not None:
                marks[1].record()
            flown: Flight | None = self._fly(requests, logits)
        except torch.OutOfMemoryError:
            flown = None
        else:
            if launched is not None:
                launched()
        events = self._land(flight)
        if flown is None:
            return events + self._fail_all([r.seq for r in requests if r.seq.status is Status.RUNNING],
                                           _OOM_MESSAGE)
        if any(r.seq.status is Status.RUNNING for r in flown.requests):
            self._flight = flown  # (else every row finished: nothing will read it)
        self.timer.end(marks)
        return events

    def _land(self, flight: Flight) -> list[Event]:
        """Read the flight's tokens and deliver those of requests still running; the others'
        (finished or aborted meanwhile) are dropped uncounted."""
        tokens = flight.pending.tolist()
        live = [(r, t) for r, t in zip(flight.requests, tokens) if r.seq.status is Status.RUNNING]
        for request, token in live:
            seq = request.seq
            if self.blocks.num_tokens(seq.request_id) > seq.num_tokens:  # the next step was launched
                self.blocks.set_token(seq.request_id, seq.num_tokens, token)
        events = self._deliver([r for r, _ in live], [t for _, t in live])
        for request, _ in live:
            if request.seq.status is Status.RUNNING:
                self.blocks.mark_computed(request.seq.request_id, request.seq.num_computed)
        return events

    def _choose_scheduler(self) -> None:
        """auto: the scheduler for the requests answered now. Switching to runahead puts every decoding
        request's next token in flight; switching away lets the tokens in flight finish in the decoder
        while the others decode synchronously."""
        answering = min(len(self.scheduler.running) + len(self.scheduler.waiting), self.config.max_num_seqs)
        choice = self._auto_choice = self._auto_pick(answering)
        starting = choice == "runahead" and not self._runahead
        self._runahead = choice == "runahead"
        for seq in list(self.scheduler.running) if starting else []:
            # (a prompt with one token left and nothing sampled yet is read as a prompt chunk: Scheduler.schedule)
            if not seq.in_prefill and seq.output_ids and seq.request_id not in self.decoder.flights:
                self._launch(seq)
        if self.runner.prefetcher is not None:
            self.runner.prefetcher.active = choice == "prefetch"

    def _runahead_step(self) -> list[Event]:
        start = time.perf_counter()
        try:
            done = self.decoder.step()
        except torch.OutOfMemoryError:
            seqs = [self._requests[r].seq for r in list(self.decoder.flights) if r in self._requests]
            return self._fail_all(seqs, _OOM_MESSAGE)
        self.timer.runahead(time.perf_counter() - start, len(done))
        if self._gate_interval is not None and self._gate_interval[0] == AHEAD:
            self._gate_interval = (AHEAD, self._gate_interval[1], len(done))
        if not done:
            return []
        seqs = []
        for request_id, _ in done:
            seq = self._requests[request_id].seq
            seq.num_computed += 1
            self.blocks.mark_computed(request_id, seq.num_computed)
            seqs.append(seq)
        return self._sample([self._requests[s.request_id] for s in seqs], torch.stack([row for _, row in done]))

    def _launch(self, seq: Seq) -> None:
        """Runahead: put the request's newest token in flight (after growing its cache pages)."""
        if self.decoder is None:
            return
        if not self._runahead:  # auto chose another scheduler: the request decodes synchronously
            self.decoder.drop(seq.request_id)  # it rejoins (if ever) at the round of the others
            return
        if seq.status is not Status.RUNNING or not self.scheduler.make_room(seq):
            return
        self.decoder.start(seq.request_id, seq.output_ids[-1], seq.num_tokens - 1,
                           self.blocks.block_table(seq.request_id), len(seq.output_ids))

    def _take_intake(self) -> list[Event]:
        with self._lock:
            intake, aborts = self._intake, self._aborts
            self._intake, self._aborts = [], []
        for request in intake:
            self._requests[request.seq.request_id] = request
            self.scheduler.add(request.seq)
        events: list[Event] = []
        for request_id in aborts:
            request = self._requests.get(request_id)
            if request is not None:
                events.append(self._finish(request, "abort"))
        return events

    def _sample(self, requests: list[_Request], logits: torch.Tensor) -> list[Event]:
        """Sample the next token of each request from its logits row; emit events."""
        if not requests:
            return []
        return self._deliver(requests, self._sample_on_device(requests, logits).tolist())

    def _sample_on_device(self, requests: list[_Request], logits: torch.Tensor) -> torch.Tensor:
        masks = [r.answer.mask() if r.answer is not None else None for r in requests]
        # Only rows with a repetition penalty read the whole prompt + output (built per call).
        return self.sampler(
            logits, [r.seq.params for r in requests], [r.generator for r in requests],
            [r.seq.token_ids if r.seq.params.repetition_penalty != 1.0 else () for r in requests],
            [r.seq.output_ids for r in requests], masks,
        )

    def _deliver(self, requests: list[_Request], tokens: list[int]) -> list[Event]:
        """Accept each request's new token (stop checks, detokenising); the events, in order."""
        if not requests:
            return []
        now = time.perf_counter()
        self._recent.append((now, len(tokens)))
        while now - self._recent[0][0] >= _RATE_WINDOW_S:
            self._recent.popleft()
        self._generated += len(tokens)
        events: list[Event] = []
        for request, token in zip(requests, tokens):
            events.extend(self._accept(request, int(token), now))
            self._launch(request.seq)
        return events

    def _accept(self, request: _Request, token: int, now: float) -> list[Event]:
        seq, params = request.seq, request.seq.params
        if request.first_token_time is None:
            request.first_token_time = now
        seq.output_ids.append(token)
        is_eos = not params.ignore_eos and token in self.tokenizer.eos_token_ids
        if is_eos or token in params.stop_token_ids:
            return self._emit_tail(request, token, "stop")
        outcome = request.answer.accept(token) if request.answer is not None else None
        if outcome == REFUSED:  # (the mask allows no such token: a bug, not the model's doing)
            return [self._finish(request, "error", f"structured output: token {token} does not continue the "
                                                   "answer's JSON")]
        text, hit = request.stop.feed(request.detok.push(token))
        if hit:
            return self._emit(request, (token,), text) + [self._finish(request, "stop")]
        if outcome == DONE:  # the JSON is whole and nothing may follow it
            return self._emit_tail(request, token, "stop", text)
        # The cache's pages bound a request as the context does: past them it could only preempt
        # itself and recompute forever.
        if len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= min(self.max_model_len, self._cache_tokens):
            return self._emit_tail(request, token, "length", text)
        return self._emit(request, (token,), text)

    def _emit(self, request: _Request, token_ids: tuple[int, ...], text: str) -> list[Event]:
        request.text += text
        return [TokenDelta(request.seq.request_id, token_ids, text)]

    def _emit_tail(self, request: _Request, token: int, reason: FinishReason, text: str = "") -> list[Event]:
        """Flush held-back text (no stop string can complete any more) and finish."""
        text += request.stop.feed(request.detok.flush())[0] + request.stop.flush()
        return self._emit(request, (token,), text) + [self._finish(request, reason)]

    def _finish(self, request: _Request, reason: FinishReason, error: str | None = None) -> Finished:
        seq = request.seq
        if self.decoder is not None:
            self.decoder.drop(seq.request_id)
        self._release(seq, park=reason != "error")
        self.scheduler.finish(seq)
        self._requests.pop(seq.request_id, None)
        now = time.perf_counter()
        stats = RequestStats(
            prompt_tokens=len(seq.prompt_ids), completion_tokens=len(seq.output_ids),
            cached_prompt_tokens=seq.num_cached_prefix,
            time_to_first_token_s=None if request.first_token_time is None else request.first_token_time
            - request.arrival,
            total_time_s=now - request.arrival,
        )
        return Finished(seq.request_id, reason, request.text, stats, error)

    def _release(self, seq: Seq, park: bool) -> None:
        """Drop the request's state outside the pages; its tiers are parked for its chat's next turn
        first (``park``: not after an error, which may have cut a step short)."""
        if park and self.tier_cache is not None:
            self.tier_cache.park(seq)
        self.runner.forget(seq.request_id)

    def _fail_all(self, seqs: list[Seq], message: str) -> list[Event]:
        requests = [self._requests[s.request_id] for s in seqs if s.request_id in self._requests]
        return [self._finish(r, "error", message) for r in requests]

    # ---- conveniences ----------------------------------------------------------------------

    def generate(self, messages: Sequence[dict[str, Any]] | None = None, *, prompt: str | None = None,
                 prompt_token_ids: Sequence[int] | None = None,
                 sampling: SamplingParams | Mapping[str, Any] | None = None,
                 **chat_options: Any) -> Iterator[Event]:
        """Run one request to completion (``sampling`` as for ``add_request``), yielding its events.
        Meant for exclusive use of the engine (events of other requests stepped meanwhile are not
        returned)."""
        request_id = self.add_request(messages, prompt=prompt, prompt_token_ids=prompt_token_ids,
                                      sampling=sampling, **chat_options)
        try:
            while True:
                for event in self.step():
                    if event.request_id == request_id:
                        yield event
                        if isinstance(event, Finished):
                            return
        finally:
            if request_id in self._requests:
                self.abort(request_id)
                self.step()

    def stats(self) -> EngineStats:
        now = time.perf_counter()
        window = [(t, n) for t, n in self._recent if now - t < _RATE_WINDOW_S]
        span = now - window[0][0] if len(window) > 1 else 0.0
        rate = sum(n for _, n in window[1:]) / span if span > 0 else 0.0
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + len(self._intake),
            cache_blocks_total=self.blocks.num_blocks,
            cache_blocks_free=self.blocks.num_free_blocks,
            generated_tokens=self._generated,
            decode_tokens_per_s=rate,
            extra={**{f"expert_cache_{k}": float(v) for k, v in self.runner.expert_stats().items()},
                   **self.timer.summary(), **self.runner.graph_stats(),
                   **{f"decode_steps_{k}": float(v) for k, v in self.decode_steps.items()},
                   **self.prefix_cache_stats(),
                   **({} if self.warm_up_s is None else {"warm_up_s": self.warm_up_s})},
        )

    def prefix_cache_stats(self) -> dict[str, float]:
        """Cached prompt tokens served and what the RAM / disk tiers hold (conversations: those
        with pages on the device, in RAM or on disk, or parked tiers); with tiered keys or latents
        the parked chats (``tier_cache_*``, hearth.engine.tier_cache)."""
        out = {"prefix_cache_hits_tokens": float(self.blocks.hit_tokens),
               "prefix_cache_restored_tokens": float(self.blocks.restored_tokens)}
        conversations = self.blocks.conversations()
        if self.prefix_tier is not None:
            store = self.prefix_tier.store
            store.settle_preload()  # (the engine host asks for stats on this thread, idle or not)
            conversations |= store.conversations()
            counters = store.counters
            out.update(prefix_cache_host_bytes=float(store.host_bytes), prefix_cache_disk_bytes=float(store.disk_bytes),
                       prefix_cache_files_rejected=float(counters.files_rejected),
                       prefix_cache_restore_ms=1e3 * counters.restore_s, prefix_cache_spill_ms=1e3 * counters.spill_s,
                       prefix_cache_disk_read_ms=1e3 * counters.disk_read_s,
                       prefix_cache_disk_read_bytes=float(counters.disk_read_bytes),
                       prefix_cache_preloaded_pages=float(counters.pages_preloaded),
                       prefix_cache_preloaded_bytes=float(counters.pages_preloaded * store.page_bytes),
                       prefix_cache_preload_running=float(store.preload_running),
                       prefix_cache_preload_wait_ms=1e3 * counters.preload_wait_s)
        if self.tier_cache is not None:
            conversations |= self.tier_cache.conversations()
            out.update(self.tier_cache.stats())
        out["prefix_cache_conversations"] = float(len(conversations))
        return out

    def running_ids(self) -> list[str]:
        return [s.request_id for s in self.scheduler.running if s.status is Status.RUNNING]


def _pool_requests(cache: ExpertCache, top_k: int) -> int:
    """How many requests' routed experts (``top_k`` each) every MoE layer's pool of ``cache`` holds at
    once (``auto_scheduler``'s ``pool_requests``)."""
    return min(cache.capacity(layer) for layer in cache.store.layers) // max(1, top_k)


def _reads_history(params: SamplingParams) -> bool:
    """Whether sampling reads the request's earlier tokens on the host (penalties)."""
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty) or bool(params.frequency_penalty)


def token_list(ids: Sequence[int]) -> list[int]:
    """``ids`` as a list of Python ints (one conversion in C, not a Python loop over a long prompt)."""
    try:
        return array("q", ids).tolist()
    except (TypeError, OverflowError):
        raise RequestError("prompt token ids must be integers") from None


def check_conversation_id(conversation_id: str | None) -> None:
    if conversation_id is not None and (not isinstance(conversation_id, str)
                                        or not _CONVERSATION_ID.fullmatch(conversation_id)):
        raise RequestError("conversation_id must be 1 to 128 letters, digits or . _ : -")


def _host_cache_bytes(config: EngineConfig) -> int:
    if config.prefix_cache_host_gib is not None:
        return int(config.prefix_cache_host_gib * _GIB)
    return min(int(_AUTO_HOST_CACHE_GIB * _GIB), psutil.virtual_memory().total // 10)


def _tier_cache_bytes(config: EngineConfig) -> int:
    if config.tier_cache_host_gib is not None:
        return int(config.tier_cache_host_gib * _GIB)
    return min(int(_AUTO_TIER_CACHE_GIB * _GIB), psutil.virtual_memory().total // 4)


def _start_preload(checkpoint: str | Path, config: EngineConfig) -> Preload | None:
    """The warm start of the chat cache's RAM tier from its folder (``Preload``), when ``config``
    keeps chat caches on disk and asks for it."""
    if not (config.prefix_cache_offload and config.prefix_cache_dir and config.prefix_cache_preload):
        return None
    pin = resolve_device(config.device).type == "cuda"  # (the pages go to a CUDA device through pinned memory)
    return Preload(config.prefix_cache_dir, model_key(checkpoint), _host_cache_bytes(config), pin=pin)


def _start_tier_preload(checkpoint: str | Path, config: EngineConfig) -> TierPreload | None:
    """The warm start of the parked long chats' files (``TierPreload``), begun before the weights load
    (a model of hundreds of GB loads for minutes; its newest chats are in RAM by then), when ``config``
    keeps chat caches on disk and asks for it, and the folder holds chats of this model."""
    if not (config.prefix_cache_offload and config.prefix_cache_dir and config.prefix_cache_preload):
        return None
    chats = TierPreload.plan_folder(tier_folder(config.prefix_cache_dir), model_key(checkpoint),
                                    _tier_cache_bytes(config))
    if not chats:
        return None
    return TierPreload(tier_folder(config.prefix_cache_dir), chats, pin=resolve_device(config.device).type == "cuda")


def _tier_store(runner: ModelRunner, config: EngineConfig) -> TierStore | None:
    """The files of parked long chats, as ``config`` asks (as the prefix cache's: for a model loaded
    from a folder, in its cache folder); stale when the model, its page layout or a tier config differs."""
    if not (config.prefix_cache_offload and config.prefix_cache_dir) or runner.checkpoint is None:
        return None
    gib = config.tier_cache_disk_gib if config.tier_cache_disk_gib is not None else config.prefix_cache_disk_gib
    layout = {**runner.page_layout(), "tier_store": TIER_FORMAT,
              "key_tiers": repr(runner.key_tiers.config) if runner.key_tiers is not None else None,
              "key_tiers_planned": runner.key_tiers is not None and runner.key_tiers.planned,
              "latent_tiers": repr(runner.latent_tiers.config) if runner.latent_tiers is not None else None}
    return TierStore(tier_folder(config.prefix_cache_dir), int(gib * _GIB),
                     fingerprint_=fingerprint(runner.checkpoint, layout), key=model_key(runner.checkpoint),
                     pin=runner.device.type == "cuda")


def _prefix_tier(runner: ModelRunner, config: EngineConfig, preload: Preload | None = None) -> PageTier | None:
    """RAM and disk behind the device's prefix cache, as ``config`` asks (disk only for a model
    loaded from a folder: the files are tied to it), warmed by ``preload`` or a preload started here."""
    if not config.prefix_cache_offload:
        return None
    folder = config.prefix_cache_dir if runner.checkpoint is not None else None
    checkpoint = runner.checkpoint or ""
    store = PrefixStore(
        runner.cache.page_bytes, _host_cache_bytes(config), folder=folder,
        disk_bytes=int(config.prefix_cache_disk_gib * _GIB),
        fingerprint_=fingerprint(checkpoint, runner.page_layout()) if folder else "",
        key=model_key(checkpoint) if folder else "")
    tier = PageTier(runner.cache, store)
    if folder is not None:
        preload = preload or _start_preload(checkpoint, config)
        if preload is not None:
            store.attach_preload(preload)
    return tier


def generation_defaults(folder: Path) -> dict[str, Any]:
    """temperature / top_p / top_k the checkpoint's generation_config.json recommends (when it
    samples at all), as SamplingParams keywords."""
    try:
        raw = json.loads((folder / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict) or raw.get("do_sample") is False:
        return {}
    kinds = {"temperature": float, "top_p": float, "top_k": int}
    return {k: kind(raw[k]) for k, kind in kinds.items() if isinstance(raw.get(k), int | float)}
