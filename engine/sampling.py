"""On-device token sampling: penalties, logit bias, temperature, top-k / top-p / min-p, seeded draws.

``Sampler()(logits, params, generators, token_ids, output_ids)`` turns a batch of next-token logits
``[B, V]`` into next tokens ``[B]`` on the logits' device, in this order:

1. Repetition penalty (as in HF / vLLM): for every token seen in the row's prompt + output so far,
   a positive logit is divided by ``repetition_penalty`` and a negative one multiplied by it.
2. Presence / frequency penalties (as in OpenAI), over the row's output tokens only:
   ``logit[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0)``.
3. Logit bias (as in OpenAI): ``logit[t] += bias`` for each (t, bias) of the row's ``logit_bias``,
   added after the penalties, so no repetition penalty scales it; -100 / +100 all but ban / force t.
   Then allowed-token masks (structured output, ``hearth.engine.structured``): a row given a [V] bool
   mask has every other logit set to -inf, so no bias or filter below brings one back.
4. ``temperature == 0``: greedy argmax of the biased logits. Greedy and random rows may share a
   batch; the random steps below only run on the random rows.
5. Otherwise the logits are divided by the temperature, then filtered:
   top-k keeps the k largest logits (ties at the boundary broken by sort order);
   top-p keeps the smallest set of most likely tokens whose probability sums to >= top_p (always at
   least the most likely token); min-p drops tokens whose probability is below
   ``min_p * max probability`` (probabilities after top-k / top-p; the ratio does not depend on the
   renormalisation).
6. A token is drawn from the renormalised distribution by an exponential race:
   ``argmax(probs / E)`` with ``E ~ Exp(1)`` per vocabulary entry, which picks token i with
   probability ``probs[i]``. A row with its own ``torch.Generator`` draws its V exponentials from that
   generator alone, so a seeded request gets the same tokens whatever else shares the batch. Rows
   without one share the device's default generator.

All math runs in float32 whatever the logits' dtype. Nothing here reads a device value back to the
host: per-row parameters travel host -> device through pinned memory with non-blocking copies, and
rows are grouped by the filters they need from the Python-side parameters, never from tensor values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from hearth.engine.api import SamplingParams

__all__ = [
    "Sampler",
    "row_argmax",
    "apply_logit_bias",
    "apply_token_masks",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k_top_p",
    "make_generator",
]


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator on ``device`` seeded with ``seed``, or None (use the default generator)."""
    if seed is None:
        return None
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator


def _to_device(values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list as a device tensor without a host sync (pageable H2D copies synchronise)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _row_col_indices(
    rows: Sequence[int], ids: Sequence[Sequence[int]], device: torch.device
) -> tuple[Tensor, Tensor]:
    """Flat (row, token) index tensors for the tokens ``ids[j]`` of batch row ``rows[j]``."""
    row_list = [row for row, row_ids in zip(rows, ids) for _ in row_ids]
    col_list = [token for row_ids in ids for token in row_ids]
    return _to_device(row_list, torch.long, device), _to_device(col_list, torch.long, device)


def _repetition_penalty(
    logits: Tensor, params: Sequence[SamplingParams], token_ids: Sequence[Sequence[int]]
) -> Tensor:
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 and token_ids[i]]
    if not rows:
        return logits
    row_idx, col_idx = _row_col_indices(rows, [token_ids[i] for i in rows], logits.device)
    seen = torch.zeros_like(logits, dtype=torch.bool)
    # NOTE: a tensor value, not a Python True: a scalar would be copied from pageable host memory.
    seen.index_put_((row_idx, col_idx), torch.ones_like(col_idx, dtype=torch.bool))
    penalty = _to_device([p.repetition_penalty for p in params], torch.float32, logits.device)[:, None]
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def _presence_frequency_penalty(
    logits: Tensor, params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]]
) -> Tensor:
    rows = [i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty) and output_ids[i]]
    if not rows:
        return logits
    row_idx, col_idx = _row_col_indices(rows, [output_ids[i] for i in rows], logits.device)
    counts = torch.zeros_like(logits)
    counts.index_put_((row_idx, col_idx), torch.ones_like(col_idx, dtype=logits.dtype), accumulate=True)
    frequency = _to_device([p.frequency_penalty for p in params], torch.float32, logits.device)[:, None]
    presence = _to_device([p.presence_penalty for p in params], torch.float32, logits.device)[:, None]
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def apply_penalties(
    logits: Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> Tensor:
    """Repetition, then presence / frequency penalties (see the module docstring).

    logits: [B, V] float32; token_ids[b]: prompt + output of row b; output_ids[b]: its output.
    Returns a new [B, V] tensor; rows with neutral penalties come back unchanged.
    """
    logits = _repetition_penalty(logits, params, token_ids)
    return _presence_frequency_penalty(logits, params, output_ids)


def apply_logit_bias(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Add each row's ``logit_bias`` to its logits (rows without one come back unchanged).

    logits: [B, V] float32; every biased token id must be < V (``SamplingParams.check_vocabulary``).
    """
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    row_idx, col_idx = _row_col_indices(rows, [[t for t, _ in params[i].logit_bias] for i in rows], logits.device)
    bias = _to_device([b for i in rows for _, b in params[i].logit_bias], torch.float32, logits.device)
    return logits.index_put((row_idx, col_idx), bias, accumulate=True)


def apply_token_masks(logits: Tensor, masks: Sequence[Tensor | None]) -> Tensor:
    """Set the logits of tokens a row's mask does not allow to -inf (rows with None come back unchanged).

    logits: [B, V] float32; masks[b]: [V] bool on the host (True: allowed) or None. The masks travel in
    one pinned, non-blocking copy: no host sync.
    """
    rows = [i for i, mask in enumerate(masks) if mask is not None]
    if not rows:
        return logits
    cuda = logits.device.type == "cuda"
    allowed = torch.empty((len(rows), logits.shape[1]), dtype=torch.bool, pin_memory=cuda)
    torch.stack([masks[i] for i in rows], out=allowed)  # type: ignore[misc]
    banned = allowed.to(logits.device, non_blocking=cuda).logical_not_()  # (our own copy: inverted in place)
    return _on_rows(logits, rows, lambda x, banned: x.masked_fill(banned, float("-inf")), banned)


def apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Set every logit outside the row's top-k and top-p nucleus to -inf.

    logits: [N, V] float32 (already divided by the temperature); top_k: [N] long, V or more for
    "off"; top_p: [N] float32, > 1 (e.g. inf) for "off" so rounding in the cumulative sum never
    trims a row that asked for no trimming.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (N, V)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
    # NOTE: rank 0 has mass_before == 0 < top_p, so at least one token always survives.
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Set logits whose probability is below ``min_p * max probability`` to -inf.

    logits: [N, V] float32; min_p: [N] float32 (0 for "off").
    """
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _on_rows(logits: Tensor, rows: list[int], fn: Callable[..., Tensor], *args: Tensor) -> Tensor:
    """Apply ``fn(logits[rows], *args)`` to the chosen rows only, leaving the others as they are."""
    if len(rows) == logits.shape[0]:
        return fn(logits, *args)
    index = _to_device(rows, torch.long, logits.device)
    return logits.index_copy(0, index, fn(logits.index_select(0, index), *args))


# Rows shorter than this, or batches taller than this, keep torch's own argmax (enough blocks already).
_SPLIT_ARGMAX_MIN_COLS = 16384
_SPLIT_ARGMAX_MAX_ROWS = 32
_ARGMAX_CHUNK = 1024


def row_argmax(x: Tensor, chunk: int = _ARGMAX_CHUNK, force_split: bool = False) -> Tensor:
    """``x.argmax(-1)`` for a 2-D ``x`` (the first index of the row's largest value).

    NOTE: torch reduces one row with one thread block, so a decode batch's few vocabulary-long rows
    (129,280 values) run on a handful of SMs: 37 us for one row on the H200. Here each row is cut into
    ``chunk``-wide pieces reduced in parallel, then the pieces' maxima; both reductions return the first
    index of their maximum, so ties resolve as torch's argmax does. CUDA only (``force_split``: tests).
    """
    rows, cols = x.shape
    split = force_split or (x.is_cuda and cols >= _SPLIT_ARGMAX_MIN_COLS and rows <= _SPLIT_ARGMAX_MAX_ROWS)
    if not split or cols < 2 * chunk:
        return x.argmax(dim=-1)
    body = cols - cols % chunk
    values, within = x[:, :body].reshape(rows, body // chunk, chunk).max(dim=-1)  # (rows, pieces) each
    if body < cols:  # the last, shorter piece
        tail_value, tail_index = x[:, body:].max(dim=-1, keepdim=True)
        values = torch.cat((values, tail_value), dim=1)
        within = torch.cat((within, tail_index), dim=1)
    piece = values.argmax(dim=-1, keepdim=True)  # (rows, 1)
    return (piece * chunk + within.gather(1, piece)).squeeze(1)


def _exponential_race(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """One token per row of ``probs`` [N, V]: argmax(probs / E), E ~ Exp(1) from the row's generator."""
    noise = torch.empty_like(probs)
    shared_rows = [i for i, g in enumerate(generators) if g is None]
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    if len(shared_rows) == len(generators):
        noise.exponential_()
    elif shared_rows:
        index = _to_device(shared_rows, torch.long, probs.device)
        noise.index_copy_(0, index, torch.empty_like(probs[: len(shared_rows)]).exponential_())
    # Exp(1) draws can round to 0; a tiny floor keeps 0 / 0 (filtered tokens) from becoming NaN.
    return row_argmax(probs / noise.clamp_min(torch.finfo(probs.dtype).tiny))


class Sampler:
    """Picks next tokens on the logits' device (see the module docstring for the exact semantics)."""

    def __call__(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        token_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        masks: Sequence[Tensor | None] | None = None,
    ) -> Tensor:
        """logits: [B, V] any float dtype -> next tokens: [B] long, on the logits' device. ``masks``: per
        row, the allowed tokens ([V] bool on the host) or None (``apply_token_masks``)."""
        if not (logits.dim() == 2 and logits.shape[0] == len(params) == len(generators)):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(params)} sampling params")
        logits = apply_logit_bias(apply_penalties(logits.float(), params, token_ids, output_ids), params)
        if masks is not None:
            logits = apply_token_masks(logits, masks)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not random_rows:
            return row_argmax(logits)
        random_params = [params[i] for i in random_rows]
        random_generators = [generators[i] for i in random_rows]
        if len(random_rows) == len(params):
            return self._sample(logits, random_params, random_generators)
        index = _to_device(random_rows, torch.long, logits.device)
        sampled = self._sample(logits.index_select(0, index), random_params, random_generators)
        return row_argmax(logits).index_copy(0, index, sampled)

    def _sample(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> Tensor:
        """Temperature, filters and the draw for rows that all sample. logits: [N, V] float32."""
        device, vocab_size = logits.device, logits.shape[-1]
        temperature = _to_device([p.temperature for p in params], torch.float32, device)
        logits = logits / temperature[:, None]
        sort_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab_size or p.top_p < 1]
        if sort_rows:
            top_k = [params[i].top_k if 0 < params[i].top_k < vocab_size else vocab_size for i in sort_rows]
            top_p = [params[i].top_p if params[i].top_p < 1 else float("inf") for i in sort_rows]
            top_k_t = _to_device(top_k, torch.long, device)
            top_p_t = _to_device(top_p, torch.float32, device)
            logits = _on_rows(logits, sort_rows, apply_top_k_top_p, top_k_t, top_p_t)
        min_p_rows = [i for i, p in enumerate(params) if p.min_p > 0]
        if min_p_rows:
            min_p = _to_device([params[i].min_p for i in min_p_rows], torch.float32, device)
            logits = _on_rows(logits, min_p_rows, apply_min_p, min_p)
        return _exponential_race(logits.softmax(dim=-1), generators)
