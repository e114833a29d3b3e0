"""``omni-patches audit``: static verdicts from wheels, never installing or importing upstream code."""
import json
import os
import subprocess
import sys
import zipfile

import pytest

from omni_patches import audit, cli, registry
from support import wheels
from support.fakes import FAKE_LOADER, entry, fake_omni

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


def _zip_dir(site, path):
    with zipfile.ZipFile(path, "w") as zf:
        for f in sorted(site.rglob("*")):
            if f.is_file():
                zf.write(f, f.relative_to(site).as_posix())
    return path


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
    assert rc == 2 and "cannot download fake-omni==9.9.9" in out["error"]


def test_source_checkout_needs_a_version(shim, tmp_path, capsys):
    shim.registry(entry())
    co = tmp_path / "checkout"
    (co / "fakeomni").mkdir(parents=True)
    (co / "fakeomni" / "__init__.py").write_text("")
    (co / "fakeomni" / "loader.py").write_text(FAKE_LOADER.replace("\n    ", "\n"))
    (co / "fakeomni" / "consumer.py").write_text("from fakeomni.loader import compute\n")
    rc, _, out = _audit(capsys, "--source", co, "--cache", tmp_path / "cache")
    assert rc == 2 and "cannot tell the version" in out["error"]
    rc, got, _ = _audit(capsys, "fake-omni==0.29.0", "--source", co, "--cache", tmp_path / "cache")
    assert got["fake-double"]["verdict"] == APPLY and "0.29.0" in got["fake-double"]["detail"]


# -- real wheels --------------------------------------------------------------------------------------
# What /work/shared/TARGETS.md §0 implies, per vllm-omni release, with no vllm-ascend given.
# lora-cpu-fused-delta is opt-in and applies wherever the stock CPU merge exists (0.27.0rc1+).
EXPECTED = {
    "0.22.0": {"lora-accel-delta": OUT, "lora-cpu-fused-delta": OUT, "moe-ep-parallel-mapping": APPLY,
               "moe-lora-idle-detach": OUT, "ascend-moe-skip-idle-lora": ABSENT},
    "0.24.0": {"lora-accel-delta": OUT, "lora-cpu-fused-delta": OUT, "moe-ep-parallel-mapping": FIXED,
               "moe-lora-idle-detach": OUT, "ascend-moe-skip-idle-lora": ABSENT},
    "0.28.0": {"lora-accel-delta": APPLY, "lora-cpu-fused-delta": APPLY, "moe-ep-parallel-mapping": FIXED,
               "moe-lora-idle-detach": OUT, "ascend-moe-skip-idle-lora": ABSENT},
    "0.30.0": {"lora-accel-delta": FIXED, "lora-cpu-fused-delta": APPLY, "moe-ep-parallel-mapping": FIXED,
               "moe-lora-idle-detach": OUT, "ascend-moe-skip-idle-lora": ABSENT},
    "0.32.0rc1": {"lora-accel-delta": FIXED, "lora-cpu-fused-delta": APPLY, "moe-ep-parallel-mapping": FIXED,
                  "moe-lora-idle-detach": APPLY, "ascend-moe-skip-idle-lora": ABSENT},
}
ROWS = [(v, pid) for v, row in EXPECTED.items() for pid in row]
AUDIT_CACHE = wheels.CACHE / "audit"
_done = {}


def _wheel(dist, version, **kw):
    try:
        return wheels.download(dist, version, **kw)
    except RuntimeError as exc:  # pragma: no cover - network dependent
        if os.environ.get("CI"):
            raise
        pytest.skip(f"cannot fetch {dist}=={version}: {exc}")


def _real_audit(*paths):
    key = tuple(map(str, paths))
    if key not in _done:
        args = [a for p in paths for a in ("--wheel", str(p))]
        proc = subprocess.run([sys.executable, "-m", "omni_patches", "audit", "--json", "--cache", str(AUDIT_CACHE),
                               *args], capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)),
                              env={k: v for k, v in os.environ.items() if not k.startswith("OMNI_PATCHES")})
        out = json.loads(proc.stdout)
        _done[key] = (proc.returncode, {p["id"]: p for p in out["patches"]})
    return _done[key]


@pytest.mark.parametrize("version,patch_id", ROWS, ids=[f"{v}-{p}" for v, p in ROWS])
def test_real_wheels_match_the_version_table(version, patch_id):
    if patch_id not in registry.load().specs:
        pytest.skip(f"{patch_id} is not in patches.toml yet (another engineer is adding it)")
    rc, got = _real_audit(_wheel("vllm-omni", version))
    assert got[patch_id]["verdict"] == EXPECTED[version][patch_id], got[patch_id]
    assert rc == 0


def test_real_ascend_sdist_0_23_with_omni_0_32():
    if "ascend-moe-skip-idle-lora" not in registry.load().specs:
        pytest.skip("ascend-moe-skip-idle-lora is not in patches.toml yet")
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
    if "lora-accel-delta" not in registry.load().specs:
        pytest.skip("lora-accel-delta is not in patches.toml yet")
    whl = _edited_wheel(tmp_path, "0.28.0", "vllm_omni/diffusion/lora/loader.py", old, new)
    rc, got, _ = _audit(capsys, "--wheel", whl, "--cache", tmp_path / "cache")
    assert got["lora-accel-delta"]["verdict"] == DRIFTED
    assert needle in got["lora-accel-delta"]["detail"]
    assert rc == 1
    capsys.readouterr()
    assert cli.main(["audit", "--wheel", str(whl), "--cache", str(tmp_path / "cache")]) == 1
    assert "drifted: " in capsys.readouterr().out
