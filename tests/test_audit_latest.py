"""``omni-patches audit --latest [DIST ...]`` (issue 21 item 6): the newest release and the newest final of each
distribution on pip's configured index, and every patch's verdict for them.

The logic runs against a PEP 691 index that the test serves on 127.0.0.1 (real pip and real HTTP, no network);
one check asks the real index (PyPI or this machine's pip configuration) and fails under CI=1 when it cannot."""
import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from omni_patches import cli
from omni_patches.tools import audit, index
from support.fakes import FAKE_LOADER, entry, fake_omni
from support.ci import skip_or_fail
from support.venvs import without_switches

ROOT = Path(__file__).resolve().parent.parent
APPLY, FIXED, OUT, DRIFTED = audit.WOULD_APPLY, audit.FIXED, audit.OUT_OF_RANGE, audit.DRIFTED
JSON_TYPE = "application/vnd.pypi.simple.v1+json"


def _wheel(folder, version, loader=FAKE_LOADER):
    site = folder / f"site-{version}"
    fake_omni(site, version, loader=loader)
    (site / f"fake_omni-{version}.dist-info" / "WHEEL").write_text(
        "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    path = folder / f"fake_omni-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for f in sorted(site.rglob("*")):
            if f.is_file():
                zf.write(f, f.relative_to(site).as_posix())
    return path


class _Index(http.server.ThreadingHTTPServer):
    daemon_threads = True


def _handler(projects, files, seen):
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            seen.append(self.path)
            parts = [p for p in self.path.split("?")[0].split("/") if p]
            if len(parts) == 2 and parts[0] == "simple" and parts[1] in projects:
                body = json.dumps({"meta": {"api-version": "1.1"}, "name": parts[1],
                                   "files": projects[parts[1]]}).encode()
                self._send(200, JSON_TYPE, body)
            elif len(parts) == 2 and parts[0] == "files" and parts[1] in files:
                self._send(200, "application/octet-stream", files[parts[1]])
            else:
                self._send(404, "text/plain", b"not found")

        def _send(self, code, ctype, body):
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """``serve({"0.28.0": loader, ...}, yanked={...})`` -> the index URL; pip and the audit ask only it."""
    servers = []

    def serve(releases, yanked=()):
        folder = tmp_path / "index-files"
        folder.mkdir(exist_ok=True)
        entries, files, seen = [], {}, []
        for version, loader in releases.items():
            path = _wheel(folder, version, loader)
            data = path.read_bytes()
            files[path.name] = data
            entries.append({"filename": path.name, "url": f"/files/{path.name}",
                            "hashes": {"sha256": hashlib.sha256(data).hexdigest()},
                            "yanked": "broken" if version in yanked else False})
        server = _Index(("127.0.0.1", 0), _handler({"fake-omni": entries}, files, seen))
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        servers.append((server, thread))
        url = f"http://127.0.0.1:{server.server_address[1]}/simple/"
        monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
        monkeypatch.setenv("PIP_INDEX_URL", url)
        for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
            monkeypatch.delenv(name, raising=False)
        serve.seen = seen
        return url

    yield serve
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _latest(capsys, *argv):
    capsys.readouterr()
    rc = cli.main(["audit", "--json", "--latest", *map(str, argv)])
    captured = capsys.readouterr()
    return rc, json.loads(captured.out), captured.err


def _verdicts(doc):
    return {a["label"]: ({d["name"]: d["version"] for d in a["distributions"]},
                         {p["id"]: p["verdict"] for p in a["patches"]}["fake-double"]) for a in doc["audits"]}


RELEASES = {"0.22.0": FAKE_LOADER, "0.28.0": FAKE_LOADER, "0.30.0rc1": FAKE_LOADER, "0.31.0": FAKE_LOADER}


def test_latest_resolves_newest_and_newest_final(shim, tmp_path, capsys, local_index):
    shim.registry(entry())
    url = local_index(RELEASES, yanked={"0.31.0"})  # a yanked release is never the newest
    rc, doc, err = _latest(capsys, "fake-omni", "--cache", tmp_path / "cache")
    assert rc == 0, doc
    assert doc["latest"] == {"fake-omni": {"newest": "0.30.0rc1", "newest_final": "0.28.0"}}
    assert _verdicts(doc) == {"newest releases": ({"fake-omni": "0.30.0rc1"}, FIXED),
                              "newest finals": ({"fake-omni": "0.28.0"}, APPLY)}
    assert f"resolving the newest releases of fake-omni on {url}" in err
    assert any(p.startswith("/files/fake_omni-0.30.0rc1") for p in local_index.seen)  # really downloaded


def test_latest_one_block_when_the_newest_is_final(shim, tmp_path, capsys, local_index):
    shim.registry(entry())
    local_index({"0.22.0": FAKE_LOADER, "0.28.0": FAKE_LOADER})
    rc, doc, _ = _latest(capsys, "fake-omni", "--cache", tmp_path / "cache")
    assert rc == 0 and _verdicts(doc) == {"newest releases": ({"fake-omni": "0.28.0"}, APPLY)}
    assert doc["patches"] and doc["label"] == "newest releases"  # one block: also at the top, like audit DIST==VER


def test_latest_drift_on_the_newest_final_fails_the_job(shim, tmp_path, capsys, local_index):
    shim.registry(entry())
    drifted = FAKE_LOADER.replace("def compute(x, scale=1):", "def compute(x):")
    local_index({"0.28.0": drifted, "0.29.0rc1": FAKE_LOADER})
    rc, doc, _ = _latest(capsys, "fake-omni", "--cache", tmp_path / "cache")
    assert _verdicts(doc) == {"newest releases": ({"fake-omni": "0.29.0rc1"}, APPLY),
                              "newest finals": ({"fake-omni": "0.28.0"}, DRIFTED)}
    assert rc == doc["exit"] == audit.EXIT_DRIFT
    capsys.readouterr()
    assert cli.main(["audit", "--latest", "fake-omni", "--cache", str(tmp_path / "cache")]) == audit.EXIT_DRIFT
    out = capsys.readouterr().out
    assert "newest on the index: fake-omni 0.29.0rc1 (final: 0.28.0)" in out
    assert "[newest finals]" in out and "drifted: " in out


def test_latest_unknown_project_cannot_be_resolved(shim, tmp_path, capsys, local_index):
    shim.registry(entry())
    local_index(RELEASES)
    rc, doc, err = _latest(capsys, "no-such-project", "--cache", tmp_path / "cache")
    assert rc == audit.EXIT_FETCH and "no-such-project" in doc["error"] and "404" in doc["error"], doc


def test_latest_with_a_pinned_distribution(shim, tmp_path, capsys, local_index):
    """DIST==VERSION arguments join every block (here the same project pinned: it replaces the resolved one)."""
    shim.registry(entry())
    local_index(RELEASES, yanked={"0.31.0"})
    rc, doc, _ = _latest(capsys, "fake-omni", "fake-omni==0.22.0", "--cache", tmp_path / "cache")
    assert _verdicts(doc) == {"newest releases": ({"fake-omni": "0.22.0"}, OUT)} and rc == 0


def test_latest_versions_from_the_index_api(local_index):
    url = local_index({"0.9.0": FAKE_LOADER, "0.10.0rc1": FAKE_LOADER, "0.10.0": FAKE_LOADER,
                       "0.11.0.dev1": FAKE_LOADER}, yanked={"0.10.0"})
    assert index.latest("fake-omni", url) == ("0.11.0.dev1", "0.9.0")  # PEP 440 order, not text order
    assert index.latest("fake_Omni", url) == ("0.11.0.dev1", "0.9.0")  # PEP 503 names


def test_latest_on_the_real_index(tmp_path):
    """One real look-up through the configured index: vllm-omni's newest release and newest final, audited."""
    proc = subprocess.run([sys.executable, "-m", "omni_patches", "audit", "--json", "--latest", "vllm-omni",
                           "--cache", str(tmp_path / "cache"), "--fetch-timeout", "300"], capture_output=True,
                          text=True, cwd=ROOT, env=without_switches(), timeout=900)
    if proc.returncode == audit.EXIT_FETCH:  # pragma: no cover - network dependent
        skip_or_fail(f"the index cannot be reached: {proc.stderr[-500:]}")
    doc = json.loads(proc.stdout)
    assert proc.returncode in (0, 1), proc.stderr
    newest, final = doc["latest"]["vllm-omni"]["newest"], doc["latest"]["vllm-omni"]["newest_final"]
    from packaging.version import Version

    assert Version(newest) >= Version(final) >= Version("0.30.0") and not Version(final).is_prerelease
    versions = [{d["name"]: d["version"] for d in a["distributions"]}["vllm-omni"] for a in doc["audits"]]
    assert versions == ([newest, final] if newest != final else [newest])
    for a in doc["audits"]:
        assert {p["id"] for p in a["patches"]} >= {"lora-accel-delta", "omni-stage-shutdown-nonblocking"}
