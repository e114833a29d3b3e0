"""``omni-patches audit`` as a demanding operator meets it (issue 20, items 6-12): each test fails on the code
before the fix. Real files where they matter (a real vllm-ascend sdist on an interpreter without tarfile filters,
the real vllm-ascend / vllm-omni trees of old releases as tagless checkouts), fakes for the edge cases."""
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from omni_patches import cli
from omni_patches.tools import audit
from omni_patches.states import Cause
from omni_patches.testing.releases import write_dist_info
from support import wheels
from support.ci import skip_or_fail
from support.fakes import FAKE_LOADER, entry, fake_omni, zip_dir as _zip_dir
from support.venvs import without_switches

ROOT = Path(__file__).resolve().parent.parent
APPLY, FIXED, DRIFTED, NOT_AFFECTED = audit.WOULD_APPLY, audit.FIXED, audit.DRIFTED, audit.NOT_AFFECTED


def _audit(capsys, *argv):
    capsys.readouterr()
    rc = cli.main(["audit", "--json", *map(str, argv)])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    return rc, {p["id"]: p for p in out.get("patches", [])}, out, captured.err


def _cli(*argv, env=None, timeout=300):
    """``python -m omni_patches audit ...`` in a child, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "omni_patches", "audit", *map(str, argv)], capture_output=True,
                          text=True, cwd=ROOT, env=env or without_switches(), timeout=timeout)




def _fake_wheel(tmp_path, folder, loader=FAKE_LOADER, version="0.28.0"):
    site = tmp_path / f"site-{folder}"
    fake_omni(site, version, loader=loader)
    out = tmp_path / folder
    out.mkdir(exist_ok=True)
    return _zip_dir(site, out / f"fake_omni-{version}-py3-none-any.whl")


@pytest.fixture
def fake(shim):
    shim.registry(entry())
    return shim


# -- 6. the unpack cache is keyed by content --------------------------------------------------------------
def test_a_different_file_with_the_same_name_is_read_not_served_from_the_cache(fake, tmp_path, capsys):
    cache = tmp_path / "cache"
    good = _fake_wheel(tmp_path, "good")
    rc, got, _, _ = _audit(capsys, "--wheel", good, "--cache", cache)
    assert (rc, got["fake-double"]["verdict"]) == (0, APPLY)
    # The operator's next file has the same name: one whose target drifted, then one that is not a wheel at all.
    drifted = _fake_wheel(tmp_path, "drifted", FAKE_LOADER.replace("def compute(x, scale=1):", "def compute(x):"))
    assert drifted.name == good.name
    rc, got, _, _ = _audit(capsys, "--wheel", drifted, "--cache", cache)
    assert (rc, got["fake-double"]["verdict"]) == (audit.EXIT_DRIFT, DRIFTED), got["fake-double"]
    broken = tmp_path / "broken" / good.name
    broken.parent.mkdir()
    broken.write_bytes(b"this is not a zip file\n" * 100)
    rc, got, out, err = _audit(capsys, "--wheel", broken, "--cache", cache)
    assert rc == audit.EXIT_FETCH and "cannot unpack" in out["error"] and not got, out
    # The first file still gets its own (cached) tree.
    rc, got, _, _ = _audit(capsys, "--wheel", good, "--cache", cache)
    assert (rc, got["fake-double"]["verdict"]) == (0, APPLY)
    assert len(list((cache / "unpacked").glob(f"{good.name}-*[!t]"))) == 2  # good + drifted (broken: none)


def test_unpacked_trees_are_named_by_sha256(tmp_path):
    import hashlib

    whl = _fake_wheel(tmp_path, "w")
    out = audit.unpack(str(whl), str(tmp_path / "cache"))
    assert os.path.basename(out) == f"{whl.name}-{hashlib.sha256(whl.read_bytes()).hexdigest()[:20]}"


# -- 7. --source of a site-packages that holds omni_patches (and its own dependencies) --------------------------
def _serving_site(tmp_path):
    """A serving image's site-packages: omni-patches installed (not editable) next to its dependency
    packaging and the target distribution."""
    import packaging

    site = tmp_path / "site-packages"
    fake_omni(site, "0.28.0")
    shutil.copytree(ROOT / "omni_patches", site / "omni_patches", ignore=shutil.ignore_patterns("__pycache__"))
    write_dist_info(site, "omni-patches", "0.1.0", ["omni_patches"])
    shutil.copytree(Path(packaging.__file__).parent, site / "packaging", ignore=shutil.ignore_patterns("__pycache__"))
    write_dist_info(site, "packaging", "24.0", ["packaging"])
    return site


def test_source_site_packages_holding_omni_patches(fake, tmp_path, capsys):
    site = _serving_site(tmp_path)
    rc, got, out, _ = _audit(capsys, "--source", site, "--cache", tmp_path / "cache")
    assert rc == 0 and got["fake-double"]["verdict"] == APPLY, out
    names = {d["name"]: d["packages"] for d in out["distributions"]}
    assert "omni-patches" not in names and names["fake-omni"] == ["fakeomni"]
    assert names.get("packaging", []) == []  # never replaced by a skeleton of itself


def test_source_site_packages_with_the_shipped_registry(tmp_path):
    """The same, through the console entry point with the real registry (the README's serving-image layout)."""
    site = _serving_site(tmp_path)
    proc = _cli("--source", site, "--cache", tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "moe-lora-idle-detach" in proc.stdout


# -- 8. sdists on every supported Python ------------------------------------------------------------------------
def _fake_sdist(tmp_path, extra=()):
    """An sdist of fake-omni (PKG-INFO + package) plus ``extra`` raw members ``(TarInfo, bytes or None)``."""
    path = tmp_path / "fake_omni-0.28.0.tar.gz"
    site = tmp_path / "sdist-src"
    fake_omni(site, "0.28.0")
    with tarfile.open(path, "w:gz") as tf:
        top = "fake_omni-0.28.0"
        data = b"Metadata-Version: 2.1\nName: fake-omni\nVersion: 0.28.0\n"
        info = tarfile.TarInfo(f"{top}/PKG-INFO")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
        for f in sorted((site / "fakeomni").rglob("*.py")):
            tf.add(f, f"{top}/{f.relative_to(site).as_posix()}")
        for info, payload in extra:
            tf.addfile(info, io.BytesIO(payload) if payload is not None else None)
    return path


def _old_tarfile(mocker, monkeypatch):
    """tarfile as Python 3.10.0-3.10.11 / 3.11.0-3.11.3 have it: no data_filter, no ``filter`` argument."""
    monkeypatch.delattr(tarfile, "data_filter")
    real = tarfile.TarFile.extractall

    def extractall(self, path=".", members=None, *, numeric_owner=False):
        return real(self, path, members, numeric_owner=numeric_owner)

    return mocker.patch.object(tarfile.TarFile, "extractall", autospec=True, side_effect=extractall)


def test_sdist_without_tarfile_filters(fake, tmp_path, capsys, mocker, monkeypatch):
    _old_tarfile(mocker, monkeypatch)
    assert not hasattr(tarfile, "data_filter")
    sdist = _fake_sdist(tmp_path)
    rc, got, out, _ = _audit(capsys, "--wheel", sdist, "--cache", tmp_path / "cache")
    assert rc == 0 and got["fake-double"]["verdict"] == APPLY, out


def _member(name, kind=tarfile.REGTYPE, data=b"x = 1\n", linkname=""):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    if kind == tarfile.REGTYPE:
        info.size = len(data)
        return info, data
    return info, None


@pytest.mark.parametrize("old", [False, True], ids=["data-filter", "no-filter"])
@pytest.mark.parametrize("bad", ["../evil.py", "/tmp/omni-patches-evil.py", "fake_omni-0.28.0/../../evil.py"])
def test_sdist_members_outside_are_refused(fake, tmp_path, capsys, mocker, monkeypatch, old, bad):
    if old:
        _old_tarfile(mocker, monkeypatch)
    sdist = _fake_sdist(tmp_path, [_member(bad)])
    rc, _, out, _ = _audit(capsys, "--wheel", sdist, "--cache", tmp_path / "cache")
    assert rc == audit.EXIT_FETCH and "unsafe member" in out["error"], out
    assert not (tmp_path / "evil.py").exists() and not (tmp_path / "cache" / "evil.py").exists()
    assert not os.path.exists("/tmp/omni-patches-evil.py")


@pytest.mark.parametrize("old", [False, True], ids=["data-filter", "no-filter"])
def test_sdist_links_and_devices_are_never_extracted(fake, tmp_path, capsys, mocker, monkeypatch, old):
    if old:
        _old_tarfile(mocker, monkeypatch)
    outside = tmp_path / "outside.py"
    outside.write_text("SECRET = 1\n")
    sdist = _fake_sdist(tmp_path, [
        _member("fake_omni-0.28.0/fakeomni/link.py", tarfile.SYMTYPE, linkname=str(outside)),
        _member("fake_omni-0.28.0/fakeomni/hard.py", tarfile.LNKTYPE, linkname="/etc/passwd"),
        _member("fake_omni-0.28.0/fakeomni/dev.py", tarfile.CHRTYPE),
        _member("fake_omni-0.28.0/fakeomni/fifo.py", tarfile.FIFOTYPE),
    ])
    rc, got, out, _ = _audit(capsys, "--wheel", sdist, "--cache", tmp_path / "cache")
    assert rc == 0 and got["fake-double"]["verdict"] == APPLY, out
    tree = Path(out["distributions"][0]["root"]) / "fakeomni"
    assert sorted(p.name for p in tree.iterdir()) == ["__init__.py", "consumer.py", "loader.py"]


def _old_python():
    """An interpreter of this minor version whose tarfile has no extraction filters (Debian 12: 3.11.2)."""
    for cand in (f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}", "/usr/bin/python3"):
        if not os.path.exists(cand):
            continue
        probe = subprocess.run([cand, "-c", "import sys, tarfile; print(sys.version_info[:2], "
                                "hasattr(tarfile, 'data_filter'), sys.version.split()[0])"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.startswith(str(tuple(sys.version_info[:2]))) \
                and " False " in probe.stdout:
            return cand, probe.stdout.split()[-1]
    return None, None


def test_real_sdist_on_an_interpreter_without_tarfile_filters(tmp_path):
    """vllm-ascend 0.27.1rc1's real sdist, audited by Python 3.11.2 (Debian 12's python3)."""
    python, version = _old_python()
    if python is None:
        pytest.skip("no interpreter of this minor version without tarfile.data_filter here")
    try:
        sdist = wheels.download("vllm-ascend", "0.27.1rc1", sdist=True)
    except RuntimeError as exc:  # pragma: no cover - network dependent
        skip_or_fail(f"cannot fetch the sdist: {exc}")
    import site

    env = without_switches()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *site.getsitepackages()])  # packaging, wrapt (same minor)
    proc = subprocess.run([python, "-m", "omni_patches", "audit", "--json", "--wheel", str(sdist), "--cache",
                           str(tmp_path / "cache")], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 0, f"Python {version}: {proc.stderr[-3000:]}"
    got = {p["id"]: p for p in json.loads(proc.stdout)["patches"]}
    assert got["ascend-moe-skip-idle-lora"]["verdict"] == APPLY, got["ascend-moe-skip-idle-lora"]


# -- 9. a registry that cannot be read is never a pass ----------------------------------------------------------
def test_unparsable_overlay_fails_the_audit(fake, tmp_path, capsys, monkeypatch):
    bad = tmp_path / "overlay.toml"
    bad.write_text("[[patch]\nid = 'x'\n")
    monkeypatch.setenv("OMNI_PATCHES_CONFIG", str(bad))
    site = tmp_path / "src"
    fake_omni(site, "0.28.0")
    rc, got, out, err = _audit(capsys, "--source", site, "--cache", tmp_path / "cache")
    assert rc == audit.EXIT_REGISTRY == 4
    assert got["fake-double"]["verdict"] == APPLY  # what can be read is still shown
    assert any(str(bad) in e for e in out["registry_errors"]) and "registry cannot be read" in err
    capsys.readouterr()
    assert cli.main(["audit", "--source", str(site), "--cache", str(tmp_path / "cache")]) == 4
    assert f"registry error: {bad}" in capsys.readouterr().out


def test_corrupted_shipped_registry_fails_the_audit(shim, tmp_path, capsys):
    shim.builtin.write_bytes(b"\x00\xff not toml [[[")
    site = tmp_path / "src"
    fake_omni(site, "0.28.0")
    rc, got, out, _ = _audit(capsys, "--source", site, "--cache", tmp_path / "cache")
    assert rc == audit.EXIT_REGISTRY and not got and out["registry_errors"], out


# -- 10. code older than the bug is not affected, not drifted ---------------------------------------------------
# Trees as `git archive <tag>` gives them: wheels.tagless.


@pytest.mark.parametrize("version,verdict", [
    ("0.22.1rc1", NOT_AFFECTED),  # no MoE-LoRA context at all
    ("0.21.0rc1", NOT_AFFECTED),
    ("0.23.0rc1", APPLY),  # the first release with the MoE-LoRA branch: affected
    ("0.23.0", APPLY),
])
def test_tagless_ascend_checkout_older_than_the_bug(tmp_path, capsys, version, verdict):
    co = wheels.tagless(tmp_path, "vllm-ascend", version, "vllm_ascend")
    rc, got, out, _ = _audit(capsys, "--source", co, "--cache", tmp_path / "cache")
    st = got["ascend-moe-skip-idle-lora"]
    assert st["verdict"] == verdict and "decided by code features" in st["detail"], st
    if verdict == NOT_AFFECTED:
        assert "predates the MoE-LoRA branch" in st["detail"]
    assert rc == 0, out


def test_tagless_ascend_checkout_that_drifted_is_still_drifted(tmp_path, capsys):
    """Genuine drift stays drift: 0.23.0 whose runner method and fallback no longer match still has the
    MoE-LoRA context."""
    co = wheels.tagless(tmp_path, "vllm-ascend", "0.23.0", "vllm_ascend",
                        ("ops/fused_moe/fused_moe.py", "def set_lora_context(", "def attach_lora_context("),
                        ("ops/fused_moe/fused_moe_0_23_0.py", "def set_lora_context(", "def attach_lora_context("),
                        ("ops/fused_moe/moe_mlp.py", "    lora_context=None,\n", "    lora_ctx=None,\n"))
    rc, got, _, _ = _audit(capsys, "--source", co, "--cache", tmp_path / "cache")
    assert got["ascend-moe-skip-idle-lora"]["verdict"] == DRIFTED and rc == audit.EXIT_DRIFT


@pytest.mark.parametrize("version,verdict", [("0.22.0", NOT_AFFECTED), ("0.31.0rc1", NOT_AFFECTED),
                                             ("0.32.0rc1", APPLY)])
def test_tagless_omni_checkout_older_than_moe_lora(tmp_path, capsys, version, verdict):
    """A tagless omni checkout is decided by its code; beside it the real vllm-ascend 0.23.0 sdist, which the patch
    also requires (alone, the checkout's verdict is "absent")."""
    co = wheels.tagless(tmp_path, "vllm-omni", version, "vllm_omni")
    try:
        ascend = wheels.download("vllm-ascend", "0.23.0", sdist=True, extra_env=dict(audit.SDIST_ENV))
    except RuntimeError as exc:  # pragma: no cover - network dependent
        skip_or_fail(f"cannot fetch vllm-ascend==0.23.0: {exc}")
    rc, got, _, _ = _audit(capsys, "--source", co, "--wheel", ascend, "--cache", tmp_path / "cache")
    assert got["moe-lora-idle-detach"]["verdict"] == verdict, got["moe-lora-idle-detach"]
    rc, alone, _, _ = _audit(capsys, "--source", co, "--cache", tmp_path / "cache")
    assert alone["moe-lora-idle-detach"]["verdict"] == audit.ABSENT, alone["moe-lora-idle-detach"]


PREDATES = '''
def check(ctx):
    if not ctx.has("compute"):
        ctx.not_affected("fakeomni.loader has no compute(): older than the bug")


def apply(ctx):
    ctx.wrap("", "compute", lambda wrapped, instance, args, kwargs: 2 * wrapped(*args, **kwargs))
'''


def test_not_affected_at_run_time_is_a_skip_even_in_strict_mode(shim, logs):
    """The engine side: a check that says "predates the bug" skips; strict mode does not stop the host."""
    (shim.site / "a2patches").mkdir()
    (shim.site / "a2patches" / "__init__.py").write_text("")
    (shim.site / "a2patches" / "predates.py").write_text(PREDATES)
    shim.registry(entry(targets=["fakeomni.loader"], module="a2patches.predates", fixed_in={},
                        requires={"fake-omni": ">=0.1"}))
    shim.omni("0.28.0", loader="def other(x):\n    return x\n")
    shim.env(OMNI_PATCHES="1", OMNI_PATCHES_STRICT="1")
    import omni_patches

    omni_patches.activate()
    import fakeomni.loader  # noqa: F401  (strict: a Drift here would raise into this import)

    st = shim.status()["fake-double"]
    assert st.state == "skipped:version" and st.cause is Cause.NOT_AFFECTED, st
    assert any("not affected (predates the bug)" in m for m in logs.messages())


# -- 11. an index that accepts connections and never answers ---------------------------------------------------
@pytest.fixture
def silent_index():
    """http://127.0.0.1:PORT/simple/ that accepts every connection and never sends a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held, stop = [], threading.Event()

    def serve():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                held.append(conn)
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}/simple/", held
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    server.close()


def _index_env(monkeypatch, url):
    """pip and the audit ask only ``url`` (no pip.conf, no find-links of this machine)."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", url)
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)


def test_silent_index_fails_within_the_fetch_timeout(fake, tmp_path, capsys, monkeypatch, mocker, silent_index):
    url, held = silent_index
    _index_env(monkeypatch, url)
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "180")  # this machine's pip setting: pip alone would wait 15 min
    killpg = mocker.spy(os, "killpg")
    started = time.monotonic()
    rc, _, out, err = _audit(capsys, "fake-omni==0.28.0", "--fetch-timeout", "4", "--cache", tmp_path / "cache")
    took = time.monotonic() - started
    assert rc == audit.EXIT_FETCH, out
    assert took < 30, took
    assert "fetching fake-omni==0.28.0" in err and url in err  # says what it fetches, as it goes
    assert "did not finish within 4 s" in out["error"] and "--fetch-timeout" in out["error"]
    assert held  # the index was asked
    assert killpg.call_count == 1  # pip (and anything it started) was ended with the deadline


def test_silent_index_latest_fails_within_the_fetch_timeout(fake, tmp_path, capsys, monkeypatch, silent_index):
    url, _ = silent_index
    _index_env(monkeypatch, url)
    started = time.monotonic()
    capsys.readouterr()
    rc = cli.main(["audit", "--latest", "fake-omni", "--fetch-timeout", "2", "--cache", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert rc == audit.EXIT_FETCH and time.monotonic() - started < 15
    assert f"resolving the newest releases of fake-omni on {url}" in err and "did not finish within 2 s" in err


def test_silent_index_bounds_the_index_lookup_too(tmp_path, monkeypatch, silent_index):
    from omni_patches.tools import index

    url, _ = silent_index
    started = time.monotonic()
    with pytest.raises(index.FetchTimeout):
        index.download("fake-omni", "0.28.0", str(tmp_path), index=url, deadline=index.Deadline(2))
    assert time.monotonic() - started < 10


# -- 12. an unwritable HOME; exit codes that mean one thing each ------------------------------------------------
def test_unwritable_home_audits_with_a_temporary_cache(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    whl = _fake_wheel(tmp_path, "w")
    env = without_switches()
    env.pop("XDG_CACHE_HOME", None)
    env["HOME"] = str(blocker / "home")  # nothing can be created under it, not even by root
    proc = _cli("--json", "--wheel", whl, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "cannot be used" in proc.stderr, proc.stderr
    assert json.loads(proc.stdout)["distributions"][0]["name"] == "fake-omni"
    used = proc.stderr.split("; using ", 1)[1].split(" for this run", 1)[0]
    assert "omni-patches-audit-" in used and not os.path.exists(used)  # the temporary cache is removed afterwards


def test_unwritable_cache_option_is_a_fetch_failure(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    proc = _cli("--wheel", _fake_wheel(tmp_path, "w"), "--cache", blocker / "cache")
    assert proc.returncode == audit.EXIT_FETCH, proc.stderr
    assert "Traceback" not in proc.stderr and f"--cache {blocker / 'cache'} cannot be used" in proc.stderr


def test_internal_error_has_its_own_exit_code(fake, tmp_path, capsys, mocker):
    mocker.patch.object(audit, "run", side_effect=RuntimeError("a bug of ours"))
    site = tmp_path / "src"
    fake_omni(site, "0.28.0")
    capsys.readouterr()
    rc = cli.main(["audit", "--source", str(site), "--cache", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert rc == audit.EXIT_INTERNAL and "RuntimeError: a bug of ours" in err and "internal error" in err


def test_usage_errors_exit_2(tmp_path, capsys):
    capsys.readouterr()
    assert cli.main(["audit", "vllm-omni>=0.28", "--cache", str(tmp_path)]) == audit.EXIT_USAGE
    assert "exact version" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["audit", "--fetch-timeout", "soon"])
    assert exc.value.code == audit.EXIT_USAGE


def test_exit_codes_are_distinct_and_documented():
    codes = audit.EXIT_CODES
    assert sorted(codes) == list(range(len(codes))) and len(set(codes.values())) == len(codes)
    proc = _cli("--help")
    readme = (ROOT / "README.md").read_text()
    for code, text in codes.items():
        assert f"  {code}  {text}" in proc.stdout, (code, proc.stdout)
        assert f"| `{code}` |" in readme, f"README's audit exit code table lacks {code}"
