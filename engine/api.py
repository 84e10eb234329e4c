"""The engine's public vocabulary: sampling parameters, engine configuration and the plain
dataclass events that ``Engine.step()`` / ``Engine.generate()`` return.

Everything here is frozen, validated at construction, and free of tensors and Qt types, so the GUI,
the CLI, the HTTP server and the benchmarks can all share it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort", "error"]


class HearthError(Exception):
    """An error the user caused or can fix (bad file, unsupported model, prompt too long...).

    Its message is one clear line meant for people; front ends print it without a traceback.
    """


class UnsupportedModelError(HearthError):
    """The checkpoint's architecture, or a config value that changes the math, is not supported."""


class CheckpointError(HearthError):
    """A weight file is missing, truncated, corrupt, or holds a tensor of the wrong name/shape."""


class RequestError(HearthError):
    """A request cannot be served as asked (prompt longer than the context, bad parameters...).

    ``param``: the request field at fault, when there is one (the HTTP server's error names it).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(RequestError):
    """The prompt leaves no room for an answer in the context. The message opens with OpenAI's
    wording ("This model's maximum context length is N tokens"), which clients such as LiteLLM
    match to trim a conversation's history."""

    def __init__(self, prompt_tokens: int, max_model_len: int, *, at_least: bool = False) -> None:
        super().__init__(f"This model's maximum context length is {max_model_len} tokens. However, the prompt has "
                         f"{'at least ' if at_least else ''}{prompt_tokens} tokens, and the context holds "
                         f"{max_model_len} for prompt and answer together: shorten the prompt or raise the "
                         "context length.")
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` means greedy decoding.

    ``top_k == 0``, ``top_p == 1``, ``min_p == 0`` and penalties of 1/0/0 switch those filters off.
    ``seed`` makes a request reproducible regardless of what else runs in the batch.
    ``logit_bias``: (token id, bias) pairs, each bias in [-100, 100] added to that token's logit
    before sampling (OpenAI's ``logit_bias``; a mapping is accepted and stored sorted by id).
    ``json_schema``: hold the answer to this JSON Schema (structured output, ``hearth.engine.structured``;
    ``{"type": "object"}`` is OpenAI's json_object); given as JSON text or as the schema itself, stored as
    JSON text. The engine refuses a schema it cannot enforce (RequestError, param "response_format").
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    json_schema: str | None = None

    def __post_init__(self) -> None:
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            try:
                object.__setattr__(self, "json_schema", json.dumps(self.json_schema, allow_nan=False))
            except (TypeError, ValueError) as err:
                raise RequestError(f"response_format: the schema is not JSON ({err})", "response_format") from None
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        checks = [
            (self.temperature >= 0, "temperature", "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "top_k must be >= 0 (0 disables it)"),
            (0 <= self.min_p <= 1, "min_p", "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (self.max_tokens >= 1, "max_tokens", "max_tokens must be >= 1"),
            (all(s for s in self.stop), "stop", "stop strings must not be empty"),
            (all(-100 <= b <= 100 for _, b in self.logit_bias), "logit_bias",
             "logit_bias values must be in [-100, 100]"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise RequestError(message, param)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise RequestError if ``logit_bias`` names a token id outside ``0..vocab_size - 1`` (the
        sampler indexes the logits with those ids; on a GPU a stray one is a device-side assert)."""
        bad = next((t for t, _ in self.logit_bias if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"logit_bias names token id {bad}, outside the vocabulary (0..{vocab_size - 1})",
                               "logit_bias")


OptionKind = Literal["bool", "int", "float", "str", "choice"]
BASIC = "Engine"
ADVANCED = "Advanced engine options"


@dataclass(frozen=True)
class OptionText:
    """How one ``EngineConfig`` field is shown to people: its Settings row and its server flag.

    label: the Settings row's label. help: one plain line for ``--help``, the explanation under the
    Settings row and its tooltip. section: the Settings group (``BASIC`` or ``ADVANCED``).
    none_text: what ``None`` means (shown for it in Settings). unit: the Settings suffix of a number.
    minimum: the smallest whole number allowed (float options, all memory sizes, must be > 0).
    restart: a change takes effect only when the engine restarts (true of every option the engine
    reads at load time, which today is all of them).
    """

    label: str
    help: str
    section: str = ADVANCED
    none_text: str = "auto"
    unit: str = ""
    minimum: int | None = None
    restart: bool = True


def _option(default: Any, label: str, help: str, **text: Any) -> Any:
    return field(default=default, metadata={"text": OptionText(label, help, **text)})


SchedulerName = Literal["sync", "runahead", "prefetch"]

# What ``scheduler="auto"`` runs while several requests are answered, set from bench/bench_e2e.py
# measurements on the H200 (docs/benchmarks.md, 2026-12-01: DeepSeek-V3.2 widths, 64 of 256 experts
# cached, 8 requests: sync 91 tok/s, runahead 78, prefetch 73; one request: 27.9 / 39.3 / 27.1 ms per
# token). One request always decodes with "sync": the others only pay with several requests in flight.
# Since piecewise graphs (third run, 2026-12-01 night): runahead 106 tok/s and prefetch 91 at 8 requests.
# The three side by side (bench/bench_runahead.py, H200, 2026-12-02 sixth session, schedulers in rotated
# order): where the requests' experts outnumber a layer's pool (32 requests, 64 or 128 of 256 slots)
# runahead 70.7 / 104.0 tok/s against sync 56.0 / 78.2 and prefetch 50.3 / 78.2 under uniform routing
# (1.26x / 1.33x sync), 313.9 / 336.1 against 296.2 / 330.4 and 201.7 / 339.4 under skewed routing; within
# the pool (1 and 8 requests) auto runs the sync step either way (``pool_requests`` below), and through the
# server 1 and 8 requests ran at 0.99x sync. Those runahead gains came from plain-torch attention, whose slow
# layers left the link idle. On the kernel path (Triton attention, CUDA graphs; bench_runahead.py, H200,
# 2026-12-03) sync was the fastest or within 3% of it on every measured row but one: uniform routing,
# 32 requests, 25% / 50% cache: sync 106.6 / 160.3 tok/s, runahead behind its gate 107.0 / 160.8, runahead always on
# 99.5 / 149.1, prefetch 89.3 / 117.7; skewed routing, 5% / 10% cache, 8 and 32 requests: runahead behind
# its gate 0.49-0.98x sync (its trials cost more than they won back), always on 0.88-1.09x (1.09x: 10%
# cache, 32 requests, the one row sync lost). So several requests run sync; `scheduler="runahead"` still
# runs runahead behind the gate.
AUTO_SEVERAL_REQUESTS: SchedulerName = "sync"


def auto_scheduler(num_requests: int, several: SchedulerName | None = None,
                   pool_requests: int | None = None) -> SchedulerName:
    """The scheduler ``auto`` runs while ``num_requests`` requests are being answered (``several``: the
    one it runs for more than one; ``scheduler="runahead"`` with offloaded experts is auto with
    ``several="runahead"``, so one request costs exactly what "sync" costs, overlapped decode included).

    ``pool_requests``: how many requests' routed experts every MoE layer's expert-cache pool holds at
    once (slots // top-k). Up to that many, runahead is not chosen: the sync step acquires each layer's
    experts in one lease and queues all their copies at once, so the link has nothing more to carry under
    runahead, which only adds calls (7 per token round instead of 1 and 3% more copies, running ahead
    evicting what others were about to use, in a CPU simulation of 8 requests, 64 of 256 slots, top-8;
    on the H200 runahead ran at 0.87x sync there). Beyond that the engine's runahead gate
    (``hearth.engine.link_gate``) still runs sync until its measured rounds leave both the link and the
    compute idle a fair share of the time and a runahead trial beats them: on the H200's kernel path sync
    kept the link 92-97% busy at 32 requests and runahead, always on, ran at 0.93x sync. ``auto`` itself
    runs ``AUTO_SEVERAL_REQUESTS`` (sync) for several requests."""
    if num_requests <= 1:
        return "sync"
    choice = several or AUTO_SEVERAL_REQUESTS
    if choice == "runahead" and pool_requests is not None and num_requests <= pool_requests:
        return "sync"
    return choice


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model. ``None`` and ``"auto"`` mean "decide from the machine".

    Every field carries an ``OptionText`` (see ``engine_options()``): the server's flags, the engine
    host's options, the Settings form and the GUI's restart decision are all generated from it.
    Details the one-line help leaves out:

    max_model_len: None is the model's limit, capped at 8192 until the user asks for more.
    keep_fp8: FP8 weights keep their 128x128 block scales and are dequantised on the fly.
    cuda_graphs: one graph per batch-size bucket up to max_num_seqs, captured on first use, where
        the step allows: the kernel path with every request decoding one token. With
        offloaded experts or MLI the step runs as per-layer pieces, each captured per bucket, the
        routed experts between them (hearth.engine.piecewise); every scheduler replays them. With
        tiered keys / latents the step (or its attention pieces) is captured per set of decoding
        requests and recaptured when their tier buffers move or a request leaves.
    overlap_decode: a step where every request decodes one token leaves its sampled tokens on the
        device as the next step's input and launches that step before reading them back
        (hearth.engine.engine's module doc); tokens are the same as with it off.
    warm_up: hearth.engine.warm_up; the engine host runs it after loading, before the model is ready.
        "auto" skips it on the CPU, where nothing is compiled or captured.
    mli: on CUDA the layer's own indexer runs on a side stream, overlapping its attention; the
        selections shift by one indexer layer, which changes the math slightly.
    index_key_hot_pages: the cold pages sit behind a compact per-page summary (coarse-to-fine
        selection, hearth.offload.tiered_keys). The candidate default, 8 x index_topk / block_size
        (256 for DeepSeek-V3.2 at 64-token pages), keeps top-k recall >= 0.99 on clustered keys
        (docs/benchmarks.md); the device page cache is as large.
    index_key_lagged_fetch: needs the page cache to hold the candidates; exact mode stays exact.
    scheduler: only used with offloaded experts (resident ones always decode layer by layer, as "sync",
        unless "runahead" is asked for). "runahead" is described in hearth.engine.runahead; with
        offloaded experts a lone request decodes as "sync" (the decoder has nothing to run ahead of,
        and the sync step overlaps the host's work), and so do several whose routed experts every MoE
        layer's pool holds at once (:func:`auto_scheduler`); the decoder takes over beyond;
        "prefetch" is a baseline for measurements; "auto" picks per step with :func:`auto_scheduler`.
    prefix_cache_*: hearth.engine.prefix_store. Pages are spilled when the device reuses them and
        when the engine stops, restored when a new prompt starts with them. With tiered latents off
        (their pages are not shared); with tiered keys only the pages hold latents.
        prefix_cache_preload: ``Preload``, started by ``Engine.load`` before the weights load; with
        tiers also the parked long chats' warm start (``hearth.engine.tier_store.TierPreload``).
    tier_cache_host_gib, tier_cache_disk_gib: hearth.engine.tier_cache (tiered keys or latents only):
        finished requests' tiers parked in RAM for their chat's next turn, then in files in
        ``prefix_cache_dir`` (hearth.engine.tier_store; None: as much as ``prefix_cache_disk_gib``).
    """

    device: str = _option(
        "auto", "Device", "Where the model runs: auto (the GPU when there is one), cpu, cuda or cuda:N.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _option(
        "auto", "Number format", "Precision of weights and activations: auto is bfloat16 on a GPU, float32 on the CPU.")
    max_model_len: int | None = _option(
        None, "Context length", "The longest conversation one request may hold, prompt and answer, in tokens.",
        section=BASIC, unit=" tokens", minimum=2)
    max_num_seqs: int = _option(8, "Parallel requests", "Requests answered at the same time; more wait in a queue.",
                                minimum=1)
    max_num_batched_tokens: int = _option(
        2048, "Prompt tokens per step",
        "Prompt tokens read in one step; longer prompts are read in chunks so running answers keep flowing.",
        minimum=1)
    block_size: int = _option(64, "Cache page size", "Tokens per page of the attention caches.", minimum=1)
    num_cache_blocks: int | None = _option(
        None, "Cache pages", "Pages per attention cache (auto: enough for every parallel request at full length).",
        minimum=1)
    prefix_cache_offload: bool = _option(
        True, "Keep chat caches",
        "When the GPU needs the cache pages of earlier turns, move them to RAM and then to disk, and copy them back "
        "when the chat goes on instead of reading the whole chat again.", section=BASIC)
    prefix_cache_host_gib: float | None = _option(
        None, "Chat cache in RAM",
        "RAM for chat cache pages moved off the GPU; the least recently used go to disk (auto: 4 GiB, at most a "
        "tenth of the machine's RAM).", unit=" GiB")
    prefix_cache_disk_gib: float = _option(
        16.0, "Chat cache on disk",
        "Disk space for chat cache pages that left RAM or were saved when the engine stopped; the least recently "
        "used are deleted first.", unit=" GiB")
    prefix_cache_dir: str | None = _option(
        None, "Chat cache folder",
        "Folder of the chat cache's files (the app and `hearth --cli serve` use Hearth's cache folder; none: RAM "
        "only, nothing survives a restart).", none_text="none")
    prefix_cache_preload: bool = _option(
        True, "Warm chat caches at start",
        "When the engine starts, read the most recently used chats' cache pages (and long chats' keys and latents) "
        "from the chat cache folder into RAM in the background (up to the RAM sizes set here), so the next turn of "
        "those chats does not wait for the disk.")
    tier_cache_host_gib: float | None = _option(
        None, "Long chat cache in RAM",
        "With GPU key pages or latent rows: RAM that keeps the keys and latents of finished answers, so a chat's "
        "next turn continues from them instead of reading the whole chat again; the least recently used chats "
        "go to disk when there is a chat cache folder (auto: 32 GiB, at most a quarter of the machine's RAM).",
        unit=" GiB")
    tier_cache_disk_gib: float | None = _option(
        None, "Long chat cache on disk",
        "With GPU key pages or latent rows and a chat cache folder: disk space for the keys and latents of long "
        "chats that left RAM or were saved when the engine stopped, so a chat continues after a restart; the "
        "least recently used are deleted first (auto: as much as the chat cache on disk).", unit=" GiB")
    keep_fp8: bool | None = _option(
        None, "Keep FP8 weights",
        "Keep FP8 checkpoints in FP8, half the memory of bfloat16, and expand them as they are used "
        "(auto: on a GPU, not on the CPU).")
    faithful: bool = _option(
        False, "Faithful DeepSeek rounding",
        "Round like DeepSeek's official inference code (FP8 indexer and latent cache); off computes exactly.")
    use_kernels: Literal["auto", "never"] = _option(
        "auto", "Triton kernels",
        "auto runs Hearth's attention kernels on a GPU; never uses plain PyTorch everywhere (slower, for comparison).")
    cuda_graphs: bool = _option(
        True, "CUDA graphs",
        "Replay each decode step from a recorded CUDA graph, which saves the cost of starting each GPU "
        "kernel (GPU only; off is slower, for debugging).", section=BASIC)
    overlap_decode: bool = _option(
        True, "Overlapped decode",
        "While the GPU computes the next token of every answer, the host reads back, detokenises and checks "
        "the previous one; steps with prompt chunks, penalties, JSON answers or the runahead scheduler run one at a "
        "time.")
    warm_up: Literal["auto", "true", "false"] = _option(
        "auto", "Warm up at start",
        "Before the model is reported ready, run a few short requests that compile the GPU kernels and record the "
        "decode graphs, so the first real request does not wait for them (auto: on a GPU).")
    offload: Literal["auto", "always", "never"] = _option(
        "auto", "Experts in RAM",
        "Keep the experts in RAM behind a GPU cache: auto when they do not fit on the GPU, always, or never.")
    expert_cache_slots: int | None = _option(
        None, "Expert cache slots",
        "Experts per layer kept on the GPU when experts live in RAM (auto: the memory planner decides).", minimum=1)
    expert_cache_policy: Literal["lru", "lfu"] = _option(
        "lru", "Expert cache eviction",
        "Which cached expert makes room for a new one: lru (least recently used) or lfu (least often used).")
    host_experts: Literal["auto", "on", "off"] = _option(
        "auto", "CPU for missed experts",
        "With experts in RAM, compute a missing expert on the CPU instead of copying it to the GPU "
        "(auto: when a start-up test finds the CPU quicker).")
    gpu_memory_gib: float | None = _option(
        None, "GPU memory budget", "GPU memory Hearth may use (auto: what is free).", section=BASIC, unit=" GiB")
    expert_cache_gib: float | None = _option(
        None, "Expert cache",
        "GPU memory for the experts kept on the GPU when the rest live in RAM (auto: the planner decides).",
        section=BASIC, unit=" GiB")
    host_memory_gib: float | None = _option(
        None, "RAM budget", "Host memory Hearth may use for experts kept in RAM (auto: what is available).",
        section=BASIC, unit=" GiB")
    mli: bool = _option(
        False, "Multi-layer Indexer",
        "DSA models: each layer reads the tokens the previous layer's indexer chose while its own indexer "
        "works for the layers after it; faster on a GPU, answers change very slightly.", section=BASIC)
    index_topk_freq: int | None = _option(
        None, "Indexer retention",
        "DSA models: only every N-th layer picks which earlier tokens matter, the layers between reuse its "
        "pick; faster, answers change slightly (off: as the model ships).",
        section=BASIC, none_text="off", unit=" layers", minimum=1)
    index_skip_topk_offset: int | None = _option(
        None, "Indexer retention offset",
        "With indexer retention: which layer of each group of N keeps its indexer (auto: as the model ships).",
        minimum=0)
    index_topk_pattern: str | None = _option(
        None, "Indexer layer pattern",
        "Instead of a retention N: one letter per layer, F (own indexer) or S (reuse the previous pick).",
        none_text="none")
    index_key_hot_pages: int | None = _option(
        None, "GPU key pages",
        "Long contexts: keep only this many recent pages of the indexer's keys per request on the GPU and the "
        "rest in RAM, to save GPU memory (off: all on the GPU).",
        section=BASIC, none_text="off", unit=" pages", minimum=1)
    index_key_candidate_pages: int | None = _option(
        None, "Key pages scored",
        "With GPU key pages: pages in RAM scored exactly per step (auto: 8 x top-k / page size).", minimum=1)
    index_key_cache_pages: int | None = _option(
        None, "Key page cache",
        "With GPU key pages: pages fetched from RAM kept on the GPU across steps (auto: as many as scored).",
        minimum=1)
    index_key_exact: bool = _option(
        False, "Exact key selection",
        "With GPU key pages: fetch every page that may hold a chosen token, so the choice is exact (slower).")
    index_key_lagged_fetch: bool = _option(
        False, "Lagged key fetch",
        "With GPU key pages: score the pages fetched for the previous step while this step's are copied, so "
        "no step waits for its own copy.")
    latent_hot_rows: int | None = _option(
        None, "GPU latent rows",
        "Long contexts on DSA models: keep this many attention-cache rows per request and layer on the GPU, "
        "all of them in RAM; rows a step needs are copied in (off: all on the GPU).",
        section=BASIC, none_text="off", unit=" rows", minimum=1)
    scheduler: Literal["auto", "sync", "runahead", "prefetch"] = _option(
        "auto", "Scheduler",
        "How answers advance when experts live in RAM: auto (sync for one answer, "
        f"{AUTO_SEVERAL_REQUESTS} for several: the fastest measured), sync (together, layer by layer), runahead "
        "(ready requests run ahead while others wait for experts, where measured sync steps leave the GPU link "
        "room to overlap and a trial beats them), prefetch (sync plus guessing the next layer's experts).",
        section=BASIC)

    def __post_init__(self) -> None:
        for option in engine_options():
            problem = option.check(getattr(self, option.name))
            if problem is not None:
                raise HearthError(problem)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise HearthError(f"device must be auto, cpu, cuda or cuda:N, not {self.device!r}")


@dataclass(frozen=True)
class EngineOption:
    """One ``EngineConfig`` field with its type resolved: what front ends generate flags and rows from."""

    name: str
    kind: OptionKind
    optional: bool
    choices: tuple[str, ...]
    default: Any
    text: OptionText

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value: Any) -> str | None:
        """Why ``value`` cannot be this option's value, or None when it can."""
        if value is None:
            return None if self.optional else f"{self.name} must be set"
        expected: type | tuple[type, ...] = {"bool": bool, "int": int, "float": (int, float)}.get(self.kind, str)
        # NOTE: bool is an int subclass; a JSON true must not pass as a count or a size.
        if not isinstance(value, expected) or (isinstance(value, bool) and self.kind != "bool"):
            return f"{self.name} has the wrong type ({type(value).__name__})"
        if self.choices and value not in self.choices:
            return f"{self.name} must be {', '.join(self.choices[:-1])} or {self.choices[-1]}, not {value!r}"
        if self.kind == "int" and self.text.minimum is not None and value < self.text.minimum:
            return f"{self.name} must be >= {self.text.minimum}"
        if self.kind == "float" and value <= 0:
            return f"{self.name} must be > 0"
        return None


@functools.cache
def engine_options() -> tuple[EngineOption, ...]:
    """Every ``EngineConfig`` field, in declaration order, with its kind, choices and texts."""
    hints = typing.get_type_hints(EngineConfig)
    return tuple(_resolve(f, hints[f.name]) for f in dataclasses.fields(EngineConfig))


def _resolve(config_field: dataclasses.Field[Any], hint: Any) -> EngineOption:
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        (hint,) = [a for a in args if a is not type(None)]
    if typing.get_origin(hint) is Literal:
        kind: OptionKind = "choice"
        choices = tuple(typing.get_args(hint))
    else:
        kind = {bool: "bool", int: "int", float: "float", str: "str"}[hint]
        choices = ()
    return EngineOption(config_field.name, kind, optional, choices, config_field.default,
                        config_field.metadata["text"])


@dataclass(frozen=True)
class RequestStats:
    """Timing of one request: time to first token and decode speed."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    time_to_first_token_s: float | None
    total_time_s: float

    @property
    def decode_tokens_per_s(self) -> float | None:
        return decode_rate(self.completion_tokens, self.time_to_first_token_s, self.total_time_s)


def decode_rate(completion_tokens: int, time_to_first_token_s: float | None, total_time_s: float) -> float | None:
    """Decode speed in tokens/s: the tokens after the first over the time after the first (the
    first token's time is prefill). None when there is no such interval."""
    if time_to_first_token_s is None or completion_tokens < 2:
        return None
    decode_time = total_time_s - time_to_first_token_s
    return (completion_tokens - 1) / decode_time if decode_time > 0 else None


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request and the text they complete (never a broken UTF-8 sequence;
    text that could still become a stop string is held back until it cannot)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Finished:
    """A request ended. ``text`` is the whole answer (stop string excluded)."""

    request_id: str
    reason: FinishReason
    text: str
    stats: RequestStats
    error: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine for status bars and the /stats endpoint."""

    running: int
    waiting: int
    cache_blocks_total: int
    cache_blocks_free: int
    generated_tokens: int
    decode_tokens_per_s: float
    extra: dict[str, float] = field(default_factory=dict)


Event = TokenDelta | Finished


def usage(stats: RequestStats) -> dict[str, Any]:
    """OpenAI's usage block of a finished request; ``prompt_tokens_details.cached_tokens`` counts the
    prompt tokens whose cache was reused (on the GPU or restored from RAM or disk) instead of computed."""
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens}}
