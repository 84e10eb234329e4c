"""Tests for hearth.engine.sampling: penalties, logit bias, greedy, temperature, top-k / top-p / min-p,
seeds; and SamplingParams' checks, which name the field at fault.

The statistical tests draw many samples with fixed seeds and compare empirical counts with the
analytic distribution by a chi-square statistic. ``CHI2_BOUND`` is far above what a correct sampler
produces for these sizes (the statistic's mean is the number of categories minus one, <= 7 here)
and far below what a wrong distribution produces (thousands for the cases checked).
"""

from __future__ import annotations

import math

import pytest
import torch

from hearth.engine.api import RequestError, SamplingParams
from hearth.engine.sampling import (
    Sampler,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
    row_argmax,
)

CHI2_BOUND = 40.0
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])


def _sample_rows(logits: torch.Tensor, params: SamplingParams, num_rows: int, seed: int = 0) -> torch.Tensor:
    """One draw from each of ``num_rows`` copies of ``logits`` [V], default generator seeded."""
    torch.manual_seed(seed)
    batch = logits.expand(num_rows, -1).contiguous()
    empty: list[list[int]] = [[] for _ in range(num_rows)]
    return Sampler()(batch, [params] * num_rows, [None] * num_rows, empty, empty)


def _chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square statistic of ``samples`` against ``probs`` [V]; inf if a 0-probability token shows."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    if (counts[expected == 0] > 0).any():
        return math.inf
    used = expected > 0
    return float(((counts[used] - expected[used]) ** 2 / expected[used]).sum())


def _no_history(batch_size: int) -> list[list[int]]:
    return [[] for _ in range(batch_size)]


# ---- penalties ---------------------------------------------------------------------------------


def test_penalties_change_logits_exactly_as_specified():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, -1.0, 0.0]]).repeat(4, 1)
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),
        SamplingParams(repetition_penalty=1.5, presence_penalty=0.1, frequency_penalty=0.2),
    ]
    token_ids = [[0, 1, 1, 5], [0, 1, 2, 2, 3], [0, 1, 2], [0, 4, 4]]
    output_ids = [[1, 5], [2, 2, 3], [2], [4, 4]]
    out = apply_penalties(logits, params, token_ids, output_ids)
    expected = torch.tensor(
        [
            [1.0, -4.0, 1.0, 0.5, -1.0, 0.0],  # positive / 2, negative * 2, zero stays zero
            [2.0, -2.0, 1.0 - 0.5 - 2 * 0.25, 0.5 - 0.5 - 0.25, -1.0, 0.0],  # prompt tokens untouched
            [2.0, -2.0, 1.0, 0.5, -1.0, 0.0],  # neutral parameters
            [2.0 / 1.5, -2.0, 1.0, 0.5, -1.0 * 1.5 - 0.1 - 2 * 0.2, 0.0],  # repetition, then the others
        ]
    )
    torch.testing.assert_close(out, expected)
    assert torch.equal(logits[0], torch.tensor([2.0, -2.0, 1.0, 0.5, -1.0, 0.0])), "input not modified"


def test_penalties_feed_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)]
    assert Sampler()(logits, params, [None], [[0]], [[]]).tolist() == [1]
    assert Sampler()(logits, params, [None], [[1]], [[]]).tolist() == [0]


# ---- logit bias --------------------------------------------------------------------------------


def test_logit_bias_adds_to_exactly_the_named_tokens_of_its_row():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, -1.0, 0.0]]).repeat(3, 1)
    params = [SamplingParams(logit_bias={1: 2.5, 4: -100}), SamplingParams(), SamplingParams(logit_bias={"5": 0.5})]
    out = apply_logit_bias(logits, params)
    expected = torch.tensor([
        [2.0, 0.5, 1.0, 0.5, -101.0, 0.0],
        [2.0, -2.0, 1.0, 0.5, -1.0, 0.0],  # no bias: unchanged
        [2.0, -2.0, 1.0, 0.5, -1.0, 0.5],
    ])
    torch.testing.assert_close(out, expected)
    assert torch.equal(logits[0], torch.tensor([2.0, -2.0, 1.0, 0.5, -1.0, 0.0])), "input not modified"


def test_logit_bias_steers_greedy_rows_and_comes_after_the_penalties():
    logits = torch.tensor([[2.0, 1.9, 0.0]]).repeat(2, 1)
    params = [SamplingParams(temperature=0, logit_bias={2: 5.0}), SamplingParams(temperature=0)]
    assert Sampler()(logits, params, [None, None], [[], []], [[], []]).tolist() == [2, 0]
    # Token 0 was seen: 2.0 / 2 = 1.0, + 0.95 = 1.95 > 1.9. Biased first, (2.0 + 0.95) / 2 = 1.475 would lose.
    penalised = [SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={0: 0.95})]
    assert Sampler()(logits[:1], penalised, [None], [[0]], [[]]).tolist() == [0]


def test_logit_bias_samples_the_biased_distribution():
    bias = {0: -100.0, 3: 1.5}
    samples = _sample_rows(LOGITS, SamplingParams(temperature=1.0, logit_bias=bias), 40_000)
    biased = LOGITS + torch.tensor([-100.0, 0.0, 0.0, 1.5, 0.0])
    assert _chi2(samples, torch.softmax(biased, dim=-1)) < CHI2_BOUND
    assert not (samples == 0).any(), "a -100 bias all but bans the token"


@pytest.mark.parametrize(("fields", "param"), [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"min_p": 2}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"), ({"stop": ["ok", ""]}, "stop"), ({"logit_bias": {7: 100.5}}, "logit_bias"),
    ({"logit_bias": {7: float("nan")}}, "logit_bias"),
])
def test_out_of_range_parameters_name_their_field(fields, param):
    with pytest.raises(RequestError) as err:
        SamplingParams(**fields)
    assert err.value.param == param and param in str(err.value)


def test_logit_bias_ids_must_be_in_the_vocabulary():
    SamplingParams(logit_bias={0: 1, 511: -1}).check_vocabulary(512)
    for bad in (512, -1):
        with pytest.raises(RequestError, match=f"token id {bad}, outside the vocabulary") as err:
            SamplingParams(logit_bias={3: 1, bad: 1}).check_vocabulary(512)
        assert err.value.param == "logit_bias"


# ---- greedy and temperature --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax(dtype):
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    params = [SamplingParams(temperature=0, top_k=5, top_p=0.5)] * 16  # filters cannot change argmax
    tokens = Sampler()(logits, params, [None] * 16, _no_history(16), _no_history(16))
    assert tokens.dtype == torch.long and tokens.shape == (16,)
    assert torch.equal(tokens, logits.float().argmax(dim=-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_analytic_softmax(temperature):
    samples = _sample_rows(LOGITS, SamplingParams(temperature=temperature), 40_000)
    assert _chi2(samples, torch.softmax(LOGITS / temperature, dim=-1)) < CHI2_BOUND
    for other in {0.5, 1.0, 2.0} - {temperature}:  # a sampler ignoring temperature fails here
        assert _chi2(samples, torch.softmax(LOGITS / other, dim=-1)) > 50 * CHI2_BOUND


def test_one_seeded_generator_across_steps_matches_softmax():
    generator = make_generator(7, "cpu")
    params = [SamplingParams(temperature=0.5)]
    sampler = Sampler()
    samples = torch.cat([sampler(LOGITS[None], params, [generator], [[]], [[]]) for _ in range(4000)])
    assert _chi2(samples, torch.softmax(LOGITS / 0.5, dim=-1)) < CHI2_BOUND
    assert _chi2(samples, torch.softmax(LOGITS, dim=-1)) > 10 * CHI2_BOUND


def test_rows_with_their_own_generators_match_softmax():
    num_rows = 8000
    generators = [make_generator(seed, "cpu") for seed in range(num_rows)]
    batch = LOGITS.expand(num_rows, -1)
    params = [SamplingParams(temperature=2.0)] * num_rows
    samples = Sampler()(batch, params, generators, _no_history(num_rows), _no_history(num_rows))
    assert _chi2(samples, torch.softmax(LOGITS / 2.0, dim=-1)) < CHI2_BOUND


# ---- filters -----------------------------------------------------------------------------------


def test_top_k_never_leaves_the_k_best_and_keeps_their_ratios():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(3))
    best = torch.topk(logits, 5).indices
    samples = _sample_rows(logits, SamplingParams(top_k=5), 40_000)
    assert set(samples.unique().tolist()) <= set(best.tolist())
    expected = torch.zeros(64)
    expected[best] = torch.softmax(logits[best], dim=-1)
    assert _chi2(samples, expected) < CHI2_BOUND


# Hand-built distribution, shuffled so the filters must sort: token -> probability.
HAND_PROBS = {3: 0.40, 0: 0.25, 5: 0.15, 1: 0.10, 4: 0.06, 2: 0.04}
HAND_LOGITS = torch.tensor([math.log(HAND_PROBS[t]) for t in range(6)])


def _kept(filtered: torch.Tensor) -> set[int]:
    return set(torch.isfinite(filtered).nonzero().flatten().tolist())


@pytest.mark.parametrize(
    ("top_k", "top_p", "nucleus"),
    [
        (6, 0.70, {3, 0, 5}),  # 0.40 + 0.25 < 0.70 <= 0.80
        (6, 0.85, {3, 0, 5, 1}),  # 0.80 < 0.85 <= 0.90
        (6, 0.30, {3}),  # the single most likely token already covers it
        (6, 0.01, {3}),  # always at least one token
        (2, 0.90, {3, 0}),  # top-k first, then top-p within it
        (6, math.inf, {0, 1, 2, 3, 4, 5}),  # off
    ],
)
def test_top_k_top_p_filter_keeps_exactly_the_nucleus(top_k, top_p, nucleus):
    filtered = apply_top_k_top_p(HAND_LOGITS[None], torch.tensor([top_k]), torch.tensor([top_p]))[0]
    assert _kept(filtered) == nucleus
    torch.testing.assert_close(filtered[sorted(nucleus)], HAND_LOGITS[sorted(nucleus)])


def test_top_p_samples_the_renormalised_nucleus():
    samples = _sample_rows(HAND_LOGITS, SamplingParams(top_p=0.7), 40_000)
    expected = torch.zeros(6)
    for token in (3, 0, 5):
        expected[token] = HAND_PROBS[token] / 0.80
    assert _chi2(samples, expected) < CHI2_BOUND


def test_top_p_applies_after_temperature():
    # At T=0.5 the probabilities become 0.40^2, 0.25^2, ... renormalised: token 3 alone holds ~0.61.
    samples = _sample_rows(HAND_LOGITS, SamplingParams(temperature=0.5, top_p=0.6), 2000)
    assert set(samples.tolist()) == {3}


def test_min_p_filter_and_samples():
    probs = torch.tensor([0.05, 0.5, 0.09, 0.2, 0.06, 0.1])
    logits = probs.log()
    filtered = apply_min_p(logits[None], torch.tensor([0.19]))[0]  # threshold 0.095
    assert _kept(filtered) == {1, 3, 5}
    assert _kept(apply_min_p(logits[None], torch.tensor([0.0]))[0]) == set(range(6))
    samples = _sample_rows(logits, SamplingParams(min_p=0.19), 40_000)
    expected = torch.where(probs >= 0.095, probs, torch.zeros(6))
    assert _chi2(samples, expected / expected.sum()) < CHI2_BOUND


# ---- seeds and batch composition ---------------------------------------------------------------


def _run_steps(batch_params, target_row, steps_logits, seeds):
    """Sample ``len(steps_logits)`` steps for a batch; returns the tokens of ``target_row``."""
    generators = [make_generator(seed, "cpu") for seed in seeds]
    sampler = Sampler()
    tokens = []
    for step_logits in steps_logits:
        batch = step_logits.expand(len(batch_params), -1)
        history = _no_history(len(batch_params))
        tokens.append(int(sampler(batch, batch_params, generators, history, history)[target_row]))
    return tokens


def test_same_seed_same_tokens_whatever_the_batch():
    gen = torch.Generator().manual_seed(11)
    steps_logits = [torch.randn(50, generator=gen) for _ in range(30)]
    target = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    alone = _run_steps([target], 0, steps_logits, [1234])
    assert len(set(alone)) > 3, "the check needs a target that really samples"
    assert alone == _run_steps([target], 0, steps_logits, [1234])
    crowded_params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.5, top_k=3),
        target,
        SamplingParams(temperature=0.7, min_p=0.1),
        SamplingParams(temperature=1.0),
    ]
    torch.manual_seed(99)  # the default generator, used by the unseeded row, must not matter
    assert _run_steps(crowded_params, 2, steps_logits, [None, 5, 1234, 6, None]) == alone
    assert _run_steps([target], 0, steps_logits, [4321]) != alone


def test_mixed_greedy_and_sampled_batch():
    num_rows = 20_000
    params = [SamplingParams(temperature=0 if i % 2 else 1.0) for i in range(num_rows)]
    batch = LOGITS.expand(num_rows, -1)
    torch.manual_seed(5)
    tokens = Sampler()(batch, params, [None] * num_rows, _no_history(num_rows), _no_history(num_rows))
    assert torch.all(tokens[1::2] == 0), "greedy rows take the argmax"
    assert _chi2(tokens[0::2], torch.softmax(LOGITS, dim=-1)) < CHI2_BOUND


def test_make_generator():
    assert make_generator(None, "cpu") is None
    first = torch.rand(4, generator=make_generator(3, "cpu"))
    assert torch.equal(first, torch.rand(4, generator=make_generator(3, "cpu")))


def test_rejects_mismatched_batch():
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), [SamplingParams()], [None], [[]], [[]])


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampling_has_no_host_syncs_and_is_seeded():
    device = torch.device("cuda")
    logits = torch.randn(6, 32000, device=device, dtype=torch.bfloat16)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.2, seed=2),
        SamplingParams(temperature=1.3, presence_penalty=0.5, frequency_penalty=0.5),
        SamplingParams(temperature=0.9, top_p=0.5, seed=3, logit_bias={17: -100, 31_999: 2.0}),
        SamplingParams(temperature=0, repetition_penalty=1.1),
    ]
    token_ids = [[1, 2, 3], [4, 5], [6, 6, 7], [8], [9, 10], [11]]
    output_ids = [[3], [5], [7], [8, 8], [10], [11]]

    def run() -> torch.Tensor:
        generators = [make_generator(p.seed, device) for p in params]
        torch.cuda.set_sync_debug_mode("error")
        try:
            return Sampler()(logits, params, generators, token_ids, output_ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    first, second = run(), run()
    assert first.device.type == "cuda" and first.dtype == torch.long
    seeded = [1, 2, 4]
    assert torch.equal(first[seeded], second[seeded])
    assert int(first[0]) == int(logits[0].float().argmax())


@pytest.mark.parametrize("cols", [2048, 5000, 129_280])
def test_split_argmax_equals_argmax_with_ties_and_infinities(cols):
    """The chunked argmax (CUDA's path for few long rows) picks torch.argmax's index: the first of the
    row's largest values, whether the tie is inside one chunk, across chunks or in the short last chunk."""
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(6, cols, generator=g)
    x[1, 10] = x[1, 700] = x[1, cols - 1] = 9.0  # a tie inside the first chunk and one in the last
    x[2, 3000 % cols] = x[2, cols - 3] = 9.0  # a tie across chunks
    x[3, :] = -math.inf
    x[3, cols - 2] = 0.0  # the maximum alone in the short last chunk
    x[4, :] = 1.0  # everything tied: index 0
    x[5, cols // 2] = math.inf
    got = row_argmax(x, chunk=1024, force_split=True)
    assert got.tolist() == x.argmax(dim=-1).tolist()
    assert got.tolist()[:2] == [x[0].argmax().item(), 10]
