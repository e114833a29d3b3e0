"""``omni-patches audit``: static verdicts from wheels, never installing or importing upstream code."""
import json
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest

from omni_patches import cli, registry
from omni_patches.tools import audit
from support import wheels
from support.ci import skip_or_fail
from support.venvs import without_switches
from support.fakes import FAKE_LOADER, entry, fake_omni, zip_dir as _zip_dir

APPLY, FIXED, OUT, ABSENT, DRIFTED = (audit.WOULD_APPLY, audit.FIXED, audit.OUT_OF_RANGE, audit.ABSENT,
                                      audit.DRIFTED)


def _audit(capsys, *argv):
    capsys.readouterr()
    rc = cli.main(["audit", "--json", *map(str, argv)])
    out = json.loads(capsys.readouterr().out)
    return rc, {p["id"]: p for p in out.get("patches", [])}, out


# -- fake distribution (tests/fakepatches/double.py) ------------------------------------------------------
@pytest.fixture
def fake(shim, tmp_path):
    shim.registry(entry())

    def make(version="0.28.0", loader=FAKE_LOADER, name="src"):
        site = tmp_path / name
        fake_omni(site, version, loader=loader)
        return site

    return make


@pytest.mark.parametrize("version,verdict,detail", [
    ("0.28.0", APPLY, "fake-omni 0.28.0"),
    ("0.30.0", FIXED, "fixed upstream in fake-omni 0.30.0rc1"),
    ("0.22.0", OUT, "outside >=0.27.0rc1,<0.30.0rc1"),
])
def test_fake_dist_versions(fake, capsys, tmp_path, version, verdict, detail):
    rc, got, out = _audit(capsys, "--source", fake(version), "--cache", tmp_path / "cache")
    assert (got["fake-double"]["verdict"], rc) == (verdict, 0)
    assert detail in got["fake-double"]["detail"]
    assert out["distributions"][0]["name"] == "fake-omni"
    assert not [m for m in sys.modules if m.startswith("fakeomni")]  # skeletons are gone afterwards


def test_fake_dist_feature_marker_is_fixed_upstream(fake, capsys, tmp_path):
    site = fake(loader=FAKE_LOADER + "\n    ALREADY_FIXED = True\n")
    _, got, _ = _audit(capsys, "--source", site, "--cache", tmp_path / "cache")
    assert got["fake-double"]["verdict"] == FIXED
    assert "ALREADY_FIXED" in got["fake-double"]["detail"]


@pytest.mark.parametrize("old,new,needle", [
    ("def compute(x, scale=1):", "def compute_scaled(x, scale=1):", "'compute'"),
    ("def compute(x, scale=1):", "def compute(x, factor=1):", "no parameter(s) scale"),
    ("        def helper(x):", "        def helper2(x):", "'helper'"),
])
def test_fake_dist_drift_names_what_differs(fake, capsys, tmp_path, old, new, needle):
    site = fake(loader=FAKE_LOADER.replace(old, new))
    rc, got, _ = _audit(capsys, "--source", site, "--cache", tmp_path / "cache")
    assert got["fake-double"]["verdict"] == DRIFTED
    assert needle in got["fake-double"]["detail"]
    assert rc == 1


def test_fake_dist_nothing_given_is_absent_and_nothing_leaks(fake, capsys, tmp_path):
    other = tmp_path / "other"
    wheels_dir = other / "pkg-1.0.dist-info"
    wheels_dir.mkdir(parents=True)
    (wheels_dir / "METADATA").write_text("Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n")
    (other / "pkg").mkdir()
    (other / "pkg" / "__init__.py").write_text("")
    rc, got, _ = _audit(capsys, "--source", other, "--cache", tmp_path / "cache")
    assert got["fake-double"]["verdict"] == ABSENT and "fake-omni not given" in got["fake-double"]["detail"]
    assert rc == 0
    assert not [m for m in sys.modules if m == "pkg" or m.startswith(("fakeomni", "pkg."))]


def test_fake_dist_never_runs_upstream_code(fake, capsys, tmp_path):
    boom = FAKE_LOADER.replace("import threading", "raise SystemExit('upstream code ran')")
    boom += "\n    class Late(Mixin):\n        def method(self, x):\n            raise SystemExit('ran')\n"
    site = fake(loader=boom)
    rc, got, _ = _audit(capsys, "--source", site, "--cache", tmp_path / "cache")
    assert got["fake-double"]["verdict"] == APPLY and rc == 0




def test_fake_wheel_and_pip_download_path(fake, capsys, tmp_path, monkeypatch):
    site = fake("0.28.0")
    info = site / "fake_omni-0.28.0.dist-info"
    (info / "WHEEL").write_text("Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    index = tmp_path / "index"
    index.mkdir()
    whl = _zip_dir(site, index / "fake_omni-0.28.0-py3-none-any.whl")
    _, got, _ = _audit(capsys, "--wheel", whl, "--cache", tmp_path / "c1")
    assert got["fake-double"]["verdict"] == APPLY
    # The download path: real `pip download --no-deps`, served from a local index (no network needed).
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    rc, got, out = _audit(capsys, "fake-omni==0.28.0", "--cache", tmp_path / "c2")
    assert got["fake-double"]["verdict"] == APPLY, out
    assert list((tmp_path / "c2" / "dists" / "fake-omni-0.28.0").glob("*.whl"))
    rc, _, out = _audit(capsys, "fake-omni==9.9.9", "--cache", tmp_path / "c2")
    assert rc == audit.EXIT_FETCH == 3 and "cannot download fake-omni==9.9.9" in out["error"]


def _checkout(tmp_path, loader=FAKE_LOADER):
    """A repository checkout: the package plus what a real repo root has beside it (vllm-ascend's has
    collect_env.py, setup.py, tests/ ...). No metadata."""
    co = tmp_path / "checkout"
    (co / "fakeomni").mkdir(parents=True)
    (co / "fakeomni" / "__init__.py").write_text("")
    (co / "fakeomni" / "loader.py").write_text(textwrap.dedent(loader))
    (co / "fakeomni" / "consumer.py").write_text("from fakeomni.loader import compute\n")
    (co / "collect_env.py").write_text("print('upstream code: never run')\n")
    (co / "setup.py").write_text("raise SystemExit('never run')\n")
    (co / "tests").mkdir()
    (co / "tests" / "__init__.py").write_text("")
    return co


def test_source_checkout_without_a_version_is_decided_by_features(shim, tmp_path, capsys):
    shim.registry(entry())
    co = _checkout(tmp_path)
    rc, got, out = _audit(capsys, "--source", co, "--cache", tmp_path / "cache")
    assert rc == 0 and got["fake-double"]["verdict"] == APPLY, out
    detail = got["fake-double"]["detail"]
    assert "fake-omni 0.0.0 is a source build without tags" in detail and "decided by code features" in detail
    assert "found: loader.compute(x, scale)" in detail or "(loader.compute(x, scale))" in detail
    fixed = _checkout(tmp_path / "fixed", FAKE_LOADER + "\n    ALREADY_FIXED = True\n")
    rc, got, _ = _audit(capsys, "--source", fixed, "--cache", tmp_path / "cache")
    assert got["fake-double"]["verdict"] == FIXED and "decided by code features" in got["fake-double"]["detail"]


@pytest.mark.parametrize("order", ["before", "after"])
def test_source_checkout_with_a_version_anywhere_on_the_line(shim, tmp_path, capsys, order):
    shim.registry(entry())
    co = _checkout(tmp_path)
    args = ["--source", co, "--cache", tmp_path / "cache"]
    args = ["fake-omni==0.30.0", *args] if order == "before" else [*args, "fake-omni==0.30.0"]
    rc, got, _ = _audit(capsys, *args)
    assert got["fake-double"]["verdict"] == FIXED and "0.30.0" in got["fake-double"]["detail"]


def test_one_distribution_twice_audits_each_version(fake, capsys, tmp_path, monkeypatch):
    site = fake("0.28.0")
    info = site / "fake_omni-0.28.0.dist-info"
    (info / "WHEEL").write_text("Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    index = tmp_path / "index"
    index.mkdir()
    _zip_dir(site, index / "fake_omni-0.28.0-py3-none-any.whl")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-omni\nVersion: 0.30.0\n")
    _zip_dir(site, index / "fake_omni-0.30.0-py3-none-any.whl")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    assert cli.main(["audit", "--json", "--cache", str(tmp_path / "c"), "fake-omni==0.28.0", "fake-omni==0.30.0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    verdicts = [{p["id"]: p["verdict"] for p in a["patches"]}["fake-double"] for a in doc["audits"]]
    assert verdicts == [APPLY, FIXED] and "patches" not in doc
    assert cli.main(["audit", "--cache", str(tmp_path / "c"), "fake-omni==0.28.0", "fake-omni==0.30.0"]) == 0
    out = capsys.readouterr().out
    assert out.count("audit of fake-omni 0.28.0") == 1 and out.count("audit of fake-omni 0.30.0") == 1


# -- real wheels --------------------------------------------------------------------------------------
# Every patch's verdicts on real releases, in and just outside its range: the VERDICTS of its case.py
# (tests/patches/<module>/case.py), each release audited alone, as `omni-patches audit dist==version` does.
def _verdict_rows():
    from support.contract import case_modules

    rows = []
    for module in case_modules().values():
        for spec, verdict in getattr(module, "VERDICTS", {}).items():
            dist, _, version = spec.partition("==")
            rows.append(pytest.param(dist, version, module.CASE.patch_id, verdict,
                                     id=f"{module.CASE.patch_id}-{dist}-{version}"))
    return rows


AUDIT_CACHE = wheels.CACHE / "audit"
_done = {}


def _wheel(dist, version, **kw):
    try:
        return wheels.download(dist, version, **kw)
    except RuntimeError as exc:  # pragma: no cover - network dependent
        skip_or_fail(f"cannot fetch {dist}=={version}: {exc}")


def _real_audit(*paths):
    key = tuple(map(str, paths))
    if key not in _done:
        args = [a for p in paths for a in ("--wheel", str(p))]
        proc = subprocess.run([sys.executable, "-m", "omni_patches", "audit", "--json", "--cache", str(AUDIT_CACHE),
                               *args], capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)),
                              env=without_switches())
        out = json.loads(proc.stdout)
        _done[key] = (proc.returncode, {p["id"]: p for p in out["patches"]})
    return _done[key]


def _release_archive(dist, version):
    """The wheel of ``dist==version``; for vllm-ascend, its sdist where the index has no wheel for this machine."""
    try:
        return wheels.download(dist, version)
    except RuntimeError:
        if dist != "vllm-ascend":
            return _wheel(dist, version)
    return _wheel(dist, version, sdist=True)


@pytest.mark.parametrize("dist,version,patch_id,verdict", _verdict_rows())
def test_real_releases_match_each_patch_verdicts(dist, version, patch_id, verdict):
    assert patch_id in registry.load().specs, f"a case names {patch_id}, which patches.toml does not"
    rc, got = _real_audit(_release_archive(dist, version))
    assert got[patch_id]["verdict"] == verdict, got[patch_id]
    if verdict == APPLY and dist != "vllm-omni":
        assert "found: " in got[patch_id]["detail"], got[patch_id]  # names what it would change
    assert rc == 0


def test_the_newest_vllm_alone_leaves_every_other_patch_absent():
    """vLLM 0.34.0 (the newest release, 2026-12-04) has no vllm-omni or vllm-ascend release built for it: audited
    alone, only a patch that gates on vLLM has a verdict of its own (its case's VERDICTS); every other is absent."""
    rc, got = _real_audit(_release_archive("vllm", "0.34.0"))
    for pid, spec in registry.load().specs.items():
        if "vllm" not in spec.requires:
            assert got[pid]["verdict"] == ABSENT, got[pid]
    assert rc == 0


def test_every_patch_states_its_verdicts():
    from support.contract import case_modules

    stated = {m.CASE.patch_id for m in case_modules().values() if getattr(m, "VERDICTS", None)}
    assert set(registry.load().specs) <= stated, sorted(set(registry.load().specs) - stated)


def test_real_ascend_sdist_0_23_with_omni_0_32():
    sdist = _wheel("vllm-ascend", "0.23.0", sdist=True, extra_env=dict(audit.SDIST_ENV))
    rc, got = _real_audit(_wheel("vllm-omni", "0.32.0rc1"), sdist)
    assert got["ascend-moe-skip-idle-lora"]["verdict"] == APPLY, got["ascend-moe-skip-idle-lora"]
    assert got["moe-lora-idle-detach"]["verdict"] == APPLY


def _edited_wheel(tmp_path, version, relpath, old, new):
    src = _wheel("vllm-omni", version)
    out = tmp_path / src.name
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == relpath:
                text = data.decode()
                assert old in text
                data = text.replace(old, new).encode()
            zout.writestr(item, data)
    return out


@pytest.mark.parametrize("old,new,needle", [
    ("def _prepare_lora_delta(", "def _compute_lora_delta(", "'_prepare_lora_delta'"),
    ("def unload_module_lora(", "def unload_lora_from_module(", "unload_module_lora"),
])
def test_real_wheel_with_renamed_target_is_drifted(tmp_path, capsys, old, new, needle):
    whl = _edited_wheel(tmp_path, "0.28.0", "vllm_omni/diffusion/lora/loader.py", old, new)
    rc, got, _ = _audit(capsys, "--wheel", whl, "--cache", tmp_path / "cache")
    assert got["lora-accel-delta"]["verdict"] == DRIFTED
    assert needle in got["lora-accel-delta"]["detail"]
    assert rc == 1
    capsys.readouterr()
    assert cli.main(["audit", "--wheel", str(whl), "--cache", str(tmp_path / "cache")]) == 1
    assert "drifted: " in capsys.readouterr().out


def test_sdist_pip_cannot_download_comes_from_the_index(tmp_path, capsys):
    """vllm-ascend 0.27.1rc1+ publish only sdists whose metadata pip cannot build here: audit fetches the file
    through the index's PEP 691 JSON API (pip's configured index) and reads it."""
    cache = tmp_path / "cache"
    rc, got, out = _audit(capsys, "vllm-ascend==0.27.1rc1", "--cache", cache)
    if "error" in out:  # pragma: no cover - network dependent
        skip_or_fail(out["error"])
    assert [p.name for p in (cache / "dists" / "vllm-ascend-0.27.1rc1").iterdir()] == ["vllm_ascend-0.27.1rc1.tar.gz"]
    (dist,) = out["distributions"]
    assert (dist["name"], dist["version"]) == ("vllm-ascend", "0.27.1rc1")
    assert got["ascend-moe-skip-idle-lora"]["verdict"] == APPLY, got["ascend-moe-skip-idle-lora"]
    assert "found: " in got["ascend-moe-skip-idle-lora"]["detail"]  # names the wrap point it would change


def test_real_ascend_checkout_root(tmp_path, capsys):
    """--source at a repository root (collect_env.py, setup.py, tests/, ... beside vllm_ascend/), no metadata:
    the package is found, the version is unknown, the patch's feature checks decide."""
    import shutil

    src = wheels.release_root("vllm-ascend", "0.30.0rc2")
    co = tmp_path / "vllm-ascend"
    shutil.copytree(src, co, ignore=shutil.ignore_patterns("PKG-INFO", "*.egg-info"))
    assert (co / "collect_env.py").exists() and (co / "setup.py").exists()
    rc, got, out = _audit(capsys, "--source", co, "--cache", tmp_path / "cache")
    assert "error" not in out, out
    (dist,) = out["distributions"]
    assert (dist["name"], dist["version"], dist["packages"]) == ("vllm-ascend", "0.0.0", ["vllm_ascend"])
    st = got["ascend-moe-skip-idle-lora"]
    assert st["verdict"] == APPLY and "decided by code features" in st["detail"], st
