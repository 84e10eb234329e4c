"""The engine with the Triton DSA kernels on (CUDA, bf16): same selections semantics and close
logits to the plain-PyTorch path and to the transformers reference, on a tiny model with the
kernels' widths (indexer 16 x 128, 576-wide latents). GPU only; the CPU suite covers the kernels
themselves under the interpreter (tests/kernels)."""

from __future__ import annotations

import pytest
import torch

from hearth.engine import Engine, EngineConfig, SamplingParams, TokenDelta, load_model
from hearth.engine.tiny import KERNEL_SHAPES, write_tiny_model
from tests.engine.conftest import hf_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def kernel_model(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("kshapes") / request.param, request.param, seed=3,
                            overrides=KERNEL_SHAPES)


def _prompt(n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(4)).tolist()


def test_kernels_are_on_and_logits_match_reference(kernel_model):
    ids = _prompt(150)  # > index_topk 64: sparse
    model = load_model(str(kernel_model), device="cuda", dtype="bfloat16")
    assert model.runner.use_kernels
    got = model.logits(ids, chunk_size=50)
    plain = load_model(str(kernel_model), device="cuda", dtype="bfloat16", use_kernels="never")
    assert not plain.runner.use_kernels
    ref_torch = plain.logits(ids, chunk_size=50)
    ref = hf_model(kernel_model)(torch.tensor([ids])).logits[0].float().detach()
    ref_bf16 = hf_model(kernel_model, torch.bfloat16)(torch.tensor([ids])).logits[0].float().detach()
    bar = (ref_bf16 - ref).abs().max(-1).values.median()
    assert (got - ref).abs().max(-1).values.median() <= 2 * bar + 0.02
    assert (got.argmax(-1) == ref_torch.argmax(-1)).float().mean() >= 0.9


def test_kernel_decode_matches_plain_decode(kernel_model):
    sampling = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for use in ("auto", "never"):
        engine = Engine.load(str(kernel_model), EngineConfig(device="cuda", dtype="bfloat16", use_kernels=use))
        ids = [engine.add_request(prompt_token_ids=_prompt(100 + 9 * i), sampling=sampling) for i in range(3)]
        toks = {i: [] for i in ids}
        while engine.has_unfinished():
            for e in engine.step():
                if isinstance(e, TokenDelta):
                    toks[e.request_id].extend(e.token_ids)
        outs.append([toks[i] for i in ids])
    agree = sum(a == b for x, y in zip(*outs) for a, b in zip(x, y)) / sum(len(x) for x in outs[0])
    assert agree >= 0.8  # bf16 + FP8 indexer keys flip a few near-ties; most tokens must agree
