"""Installed models: importing a local folder, resolving names, deleting downloads, offline use."""

from __future__ import annotations

import pytest

from hearth.app.hub.context import HubContext
from hearth.app.hub.errors import HubError
from hearth.app.hub.installed import delete_model, import_local_model, list_installed, resolve_model
from hearth.app.hub.manager import ItemState
from hearth.app.hub.state import Registry
from hearth.app.hub.transfer import RepoCache
from tests.app.conftest import TINY_REPO, write_tiny_model
from tests.app.fakehub import FakeHub, Fault


@pytest.fixture
def ctx(settings) -> HubContext:
    return HubContext.from_settings(settings)


def test_import_local_folder_is_listed_and_resolvable(ctx, tmp_path):
    folder = write_tiny_model(tmp_path / "my-tiny")
    model = import_local_model(folder, ctx=ctx)
    assert (model.name, model.source, model.is_supported) == ("my-tiny", "imported", True)
    [listed] = list_installed(ctx)
    assert listed.name == "my-tiny" and listed.path == folder and listed.size_bytes > 0 and listed.is_ready
    assert resolve_model("my-tiny", ctx) == folder
    assert resolve_model(str(folder), ctx) == folder


def test_import_rejects_folders_that_are_not_checkpoints(ctx, tmp_path):
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text('{"model_type": "deepseek_v3"}')
    with pytest.raises(HubError, match="safetensors"):
        import_local_model(no_weights, ctx=ctx)
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes(b"x")
    with pytest.raises(HubError, match="config.json"):
        import_local_model(no_config, ctx=ctx)
    with pytest.raises(HubError, match="not a folder"):
        import_local_model(tmp_path / "missing", ctx=ctx)
    with pytest.raises(HubError, match="without '/'"):
        import_local_model(write_tiny_model(tmp_path / "ok"), name="a/b", ctx=ctx)
    assert list_installed(ctx) == []


def test_removing_an_import_keeps_the_folder(ctx, tmp_path):
    folder = write_tiny_model(tmp_path / "keep-me")
    import_local_model(folder, name="keeper", ctx=ctx)
    assert delete_model("keeper", ctx) == 0
    assert folder.is_dir() and list_installed(ctx) == []


def test_rm_deletes_a_download_from_the_cache(make_manager, ctx):
    manager, _ = make_manager()
    assert manager.wait(manager.enqueue(TINY_REPO), timeout=20) == ItemState.READY
    folder = RepoCache(ctx.cache_dir, TINY_REPO).folder
    assert folder.is_dir()
    freed = delete_model(TINY_REPO, ctx)
    assert freed > 200_000
    assert not folder.exists() and list_installed(ctx) == []
    assert TINY_REPO not in Registry(ctx.registry_path).ready()
    with pytest.raises(HubError, match="No model called"):
        resolve_model(TINY_REPO, ctx)
    with pytest.raises(HubError, match="not installed"):
        delete_model(TINY_REPO, ctx)


def test_partial_download_is_not_resolvable_and_rm_removes_it(make_manager, ctx, fake_hub: FakeHub):
    fake_hub.add_fault(TINY_REPO, "model.safetensors", Fault("status", status=504, times=100))
    manager, _ = make_manager()
    assert manager.wait(manager.enqueue(TINY_REPO), timeout=20) == ItemState.FAILED
    [model] = list_installed(ctx)
    assert model.name == TINY_REPO and not model.is_ready
    with pytest.raises(HubError, match="not fully downloaded"):
        resolve_model(TINY_REPO, ctx)
    delete_model(TINY_REPO, ctx)
    assert not RepoCache(ctx.cache_dir, TINY_REPO).folder.exists()
    assert not ctx.queue_path.exists() or TINY_REPO not in ctx.queue_path.read_text()


def test_installed_models_work_offline(make_manager, settings, fake_hub: FakeHub):
    manager, _ = make_manager()
    assert manager.wait(manager.enqueue(TINY_REPO), timeout=20) == ItemState.READY
    seen = len(fake_hub.requests)
    offline = HubContext.from_settings(settings.replace(offline=True))
    [model] = list_installed(offline)
    assert model.is_ready and resolve_model(TINY_REPO, offline).is_dir()
    assert len(fake_hub.requests) == seen
