"""Hub search (sorting, architecture filter), repo details (checksums, gated state, config) and the
fit verdicts on fabricated machines."""

from __future__ import annotations

import pytest

from hearth.app.hub.catalog import repo_details, search_models
from hearth.app.hub.context import HubContext
from hearth.app.hub.errors import HubError, OfflineError, RepoNotFoundError
from hearth.app.hub.fit import (
    GPU_RUNTIME_BYTES,
    HOST_RUNTIME_BYTES,
    Machine,
    Verdict,
    assess_fit,
    fit_for_repo,
    footprint_from_config,
)
from hearth.app.hub.installed import list_installed
from hearth.app.hub.units import GIB
from tests.app.conftest import GATED_REPO, TINY_REPO
from tests.app.fakehub import FakeHub, FakeRepo

# DeepSeek-V3-shaped numbers (FP8 checkpoint, ~689 GB of weights).
V3_CONFIG = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
             "first_k_dense_replace": 3, "n_routed_experts": 256, "moe_intermediate_size": 2048,
             "kv_lora_rank": 512, "qk_rope_head_dim": 64, "quantization_config": {"quant_method": "fp8"}}
V3_WEIGHTS = 689 * 10**9


@pytest.fixture
def ctx(settings) -> HubContext:
    return HubContext.from_settings(settings)


@pytest.fixture
def more_repos(fake_hub: FakeHub) -> FakeHub:
    fake_hub.add_repo(FakeRepo("other/llama-big", {}, "c" * 40, downloads=10_000, likes=1, trending=1.0,
                               model_type="llama"))
    fake_hub.add_repo(FakeRepo("other/glm-5-mini", {}, "d" * 40, downloads=100, likes=99, trending=50.0,
                               created_at="2026-03-01T00:00:00.000Z", model_type="glm_moe_dsa"))
    return fake_hub


def test_search_keeps_runnable_architectures_sorted(ctx, more_repos: FakeHub):
    by_downloads = [r.repo_id for r in search_models(ctx, "", sort="downloads")]
    assert by_downloads == [GATED_REPO, TINY_REPO, "other/glm-5-mini"]
    assert [r.repo_id for r in search_models(ctx, "", sort="likes")][0] == "other/glm-5-mini"
    assert [r.repo_id for r in search_models(ctx, "", sort="trending")][0] == "other/glm-5-mini"
    assert [r.repo_id for r in search_models(ctx, "", sort="recent")][0] == "other/glm-5-mini"
    # one request per supported model_type, each filtered by the Hub
    filters = {r.query.get("filter", [None])[0] for r in more_repos.requests if r.path == "/api/models"}
    assert {"deepseek_v3", "deepseek_v32", "glm_moe_dsa", "deepseek_v2", "glm4_moe"} <= filters


def test_search_all_architectures_text_and_limit(ctx, more_repos: FakeHub):
    everything = search_models(ctx, "", all_architectures=True)
    assert everything[0].repo_id == "other/llama-big" and not everything[0].is_supported
    assert everything[0].model_type == "llama"
    assert [r.repo_id for r in search_models(ctx, "glm")] == ["other/glm-5-mini"]
    assert len(search_models(ctx, "", limit=1)) == 1
    gated = next(r for r in everything if r.repo_id == GATED_REPO)
    assert gated.gated and gated.is_supported


def test_search_rejects_an_unknown_sort(ctx):
    with pytest.raises(HubError, match="sort"):
        search_models(ctx, "x", sort="size")


def test_repo_details_lists_checksums_and_config(ctx, fake_hub: FakeHub):
    details = repo_details(ctx, TINY_REPO)
    files = {f.filename: f for f in details.files}
    weights = fake_hub.repos[TINY_REPO].files["model.safetensors"]
    assert files["model.safetensors"].sha256 == weights.sha256
    assert files["model.safetensors"].size == len(weights.content)
    assert files["config.json"].sha256 is None and files["config.json"].blob_id
    assert details.commit == "a" * 40 and not details.gated
    assert details.model_type == "deepseek_v3" and details.is_supported
    assert details.weights_bytes == len(weights.content)
    assert details.download_bytes() < sum(f.size for f in details.files)  # no pickle, no README
    assert list_installed(ctx) == []  # reading config.json did not half-install the repo


def test_gated_repo_details_say_so_without_a_token(ctx):
    details = repo_details(ctx, GATED_REPO)
    assert details.gated and details.config is None
    assert details.access_error and "gated" in details.access_error


def test_unknown_repo_is_one_clear_error(ctx):
    with pytest.raises(RepoNotFoundError, match="not found"):
        repo_details(ctx, "nobody/nothing")


def test_offline_catalog_makes_no_request(settings, fake_hub: FakeHub):
    ctx = HubContext.from_settings(settings.replace(offline=True))
    with pytest.raises(OfflineError):
        search_models(ctx, "deepseek")
    with pytest.raises(OfflineError):
        repo_details(ctx, TINY_REPO)
    assert fake_hub.requests == []


def test_footprint_from_config_counts_experts_and_caches():
    fp = footprint_from_config(V3_CONFIG, V3_WEIGHTS)
    assert fp.num_moe_layers == 58
    assert fp.experts_bytes == 58 * 256 * 3 * 7168 * 2048 * 1
    assert fp.cache_bytes_per_token == 61 * 576 * 2
    dsa = footprint_from_config({**V3_CONFIG, "model_type": "deepseek_v32"}, V3_WEIGHTS)
    assert dsa.cache_bytes_per_token == 61 * (576 * 2 + 132)
    bf16 = footprint_from_config({**V3_CONFIG, "quantization_config": None, "torch_dtype": "bfloat16"},
                                 2 * V3_WEIGHTS)
    assert bf16.experts_bytes == 2 * fp.experts_bytes
    assert footprint_from_config(None, 1000).experts_bytes == 0


@pytest.mark.parametrize(("machine", "verdict"), [
    (Machine(gpu_bytes=800 * GIB, ram_bytes=64 * GIB, disk_free_bytes=10**12), Verdict.GPU),
    (Machine(gpu_bytes=80 * GIB, ram_bytes=768 * GIB, disk_free_bytes=10**12), Verdict.EXPERTS_IN_RAM),
    (Machine(gpu_bytes=24 * GIB, ram_bytes=128 * GIB, disk_free_bytes=10**12), Verdict.DOES_NOT_FIT),
    (Machine(gpu_bytes=80 * GIB, ram_bytes=256 * GIB, disk_free_bytes=10**12), Verdict.DOES_NOT_FIT),
    (Machine(gpu_bytes=None, ram_bytes=1024 * GIB, disk_free_bytes=10**12), Verdict.CPU_ONLY),
])
def test_fit_verdicts(machine: Machine, verdict: Verdict):
    fp = footprint_from_config(V3_CONFIG, V3_WEIGHTS)
    report = assess_fit(fp, machine, context_length=8192, download_bytes=V3_WEIGHTS)
    assert report.verdict == verdict
    assert report.cache_bytes == 8192 * 61 * 576 * 2
    assert str(verdict) in report.summary and "GPU" in report.summary
    if verdict == Verdict.GPU:
        assert report.gpu_needed_bytes == V3_WEIGHTS + report.cache_bytes + GPU_RUNTIME_BYTES + fp.activation_bytes
    if verdict == Verdict.EXPERTS_IN_RAM:
        assert report.gpu_needed_bytes < machine.gpu_bytes < V3_WEIGHTS
        assert fp.experts_bytes < report.ram_needed_bytes <= machine.ram_bytes


def test_longer_context_can_push_a_model_off_the_gpu():
    fp = footprint_from_config({**V3_CONFIG, "model_type": "deepseek_v32"}, 30 * GIB)
    machine = Machine(gpu_bytes=40 * GIB, ram_bytes=64 * GIB, disk_free_bytes=10**12)
    assert assess_fit(fp, machine, context_length=4096).verdict == Verdict.GPU
    assert assess_fit(fp, machine, context_length=128 * 1024).verdict != Verdict.GPU


def test_fit_reports_a_disk_that_is_too_small():
    fp = footprint_from_config(V3_CONFIG, V3_WEIGHTS)
    machine = Machine(gpu_bytes=800 * GIB, ram_bytes=64 * GIB, disk_free_bytes=100 * 10**9)
    report = assess_fit(fp, machine, context_length=8192, download_bytes=V3_WEIGHTS)
    assert not report.fits_on_disk and "free on disk" in report.summary


def test_a_tiny_model_needs_its_weights_and_the_runtime_not_gigabytes():
    """A 24.7 MB model (the demo) on a CPU machine: the engine host measured 0.56 GiB."""
    config = {"model_type": "deepseek_v32", "num_hidden_layers": 2, "hidden_size": 256, "kv_lora_rank": 64,
              "qk_rope_head_dim": 32, "first_k_dense_replace": 1, "n_routed_experts": 8,
              "moe_intermediate_size": 128, "torch_dtype": "float32"}
    fp = footprint_from_config(config, 24_700_000)
    report = assess_fit(fp, Machine(gpu_bytes=None, ram_bytes=8 * GIB, disk_free_bytes=10**12), context_length=2048)
    assert report.verdict == Verdict.CPU_ONLY
    assert 0.6 * GIB < report.ram_needed_bytes < 0.75 * GIB
    assert report.ram_needed_bytes == 24_700_000 + report.cache_bytes + HOST_RUNTIME_BYTES + fp.activation_bytes
    on_gpu = assess_fit(fp, Machine(gpu_bytes=8 * GIB, ram_bytes=8 * GIB, disk_free_bytes=10**12), context_length=2048)
    assert on_gpu.verdict == Verdict.GPU and on_gpu.gpu_needed_bytes < 1 * GIB


def test_fit_for_a_hub_repo(ctx, settings):
    details = repo_details(ctx, TINY_REPO)
    machine = Machine(gpu_bytes=None, ram_bytes=64 * GIB, disk_free_bytes=10**12)
    report = fit_for_repo(details, settings, machine)
    assert report.verdict == Verdict.CPU_ONLY and report.download_bytes == details.download_bytes()


def test_fit_footprint_of_gqa_moe_models():
    """Qwen3-30B-A3B-like and Mixtral-8x7B-like configs: experts dominate, KV per token from GQA."""
    from hearth.app.hub.fit import footprint_from_config

    qwen = {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "moe_intermediate_size": 768,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "bfloat16"}
    fp = footprint_from_config(qwen, weights_bytes=61 * 10**9)
    assert fp.num_moe_layers == 48
    assert fp.cache_bytes_per_token == 48 * 2 * 4 * 128 * 2
    assert fp.experts_bytes == 48 * 128 * 3 * 2048 * 768 * 2  # ~58 GB of the 61
    mixtral = {"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
               "num_key_value_heads": 8, "num_local_experts": 8, "intermediate_size": 14336, "torch_dtype": "bfloat16"}
    fp = footprint_from_config(mixtral, weights_bytes=93 * 10**9)
    assert fp.num_moe_layers == 32 and fp.experts_bytes == 32 * 8 * 3 * 4096 * 14336 * 2


def test_fit_footprint_of_gpt_oss_counts_mxfp4_in_ram_and_resident_on_the_gpu():
    """gpt-oss-120b: 36 layers x 128 experts of 3 x 2880 x 2880 weights, 4.25 bits each in the files
    (about 61 GiB downloaded), in RAM when offloaded and on the GPU when resident (the fused kernel reads
    MXFP4); offloaded experts are computed in bf16 GPU slots."""
    from hearth.app.hub.fit import footprint_from_config

    config = {"model_type": "gpt_oss", "num_hidden_layers": 36, "hidden_size": 2880, "intermediate_size": 2880,
              "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
              "quantization_config": {"quant_method": "mxfp4"}, "torch_dtype": "bfloat16"}
    params = 36 * 128 * 3 * 2880 * 2880
    download = 65 * 10**9
    fp = footprint_from_config(config, weights_bytes=download)
    assert fp.num_moe_layers == 36 and fp.cache_bytes_per_token == 36 * 2 * 8 * 64 * 2
    assert fp.experts_bytes == params * 2
    assert fp.weights_bytes == download - int(params * 4.25 / 8) + params * 2
    assert fp.dense_bytes == download - int(params * 4.25 / 8)  # attention, embeddings, routers stay as shipped
    assert fp.experts_in_ram_bytes == int(params * 4.25 / 8)
    assert fp.resident_gpu_weights_bytes == download  # all resident: the weights as shipped
    from hearth.app.hub.fit import Machine, Verdict, assess_fit

    # 80 GiB of GPU: everything resident, the experts as MXFP4 (61 GB), not as bf16 (229 GB)
    report = assess_fit(fp, Machine(80 * GIB, 70 * GIB, 10**13), context_length=8192)
    assert report.verdict == Verdict.GPU and download < report.gpu_needed_bytes < 80 * GIB
    # 48 GiB of GPU, 70 GiB of RAM: the experts fit in RAM as MXFP4, not as bf16
    report = assess_fit(fp, Machine(48 * GIB, 70 * GIB, 10**13), context_length=8192)
    assert report.verdict == Verdict.EXPERTS_IN_RAM
    assert report.ram_needed_bytes < 70 * GIB < params * 2


def test_fit_footprint_of_glm45_air():
    """GLM-4.5-Air-like config: one dense layer then 45 MoE layers of 128 experts; K and V of 8 KV
    heads of 128 dims per token (head_dim is not hidden / heads here); the MTP layer's experts are
    in the download but never loaded."""
    from hearth.app.hub.fit import footprint_from_config

    air = {"model_type": "glm4_moe", "num_hidden_layers": 46, "hidden_size": 4096, "num_attention_heads": 96,
           "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 128, "moe_intermediate_size": 1408,
           "first_k_dense_replace": 1, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"}
    layer_experts = 128 * 3 * 4096 * 1408 * 2
    fp = footprint_from_config(air, weights_bytes=221 * 10**9)
    assert fp.num_moe_layers == 45 and fp.experts_bytes == 45 * layer_experts
    assert fp.weights_bytes == 221 * 10**9 - layer_experts  # the MTP layer's experts
    assert fp.cache_bytes_per_token == 46 * 2 * 8 * 128 * 2
    assert footprint_from_config({**air, "first_k_dense_replace": 0}, 221 * 10**9).num_moe_layers == 46
    defaults = {k: v for k, v in air.items() if k != "first_k_dense_replace"}
    assert footprint_from_config(defaults, 221 * 10**9).num_moe_layers == 45  # transformers' default: 1
