"""Proof in production: per-process records, ``status --all-processes``, the INFO line and the gauge."""
import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys

import pytest

import omni_patches
from omni_patches import cli, proof
from support import proof_child
from support.fakes import entry


def _all_processes(capsys, directory):
    capsys.readouterr()
    rc = cli.main(["status", "--all-processes", "--json", "--state-dir", str(directory)])
    return rc, json.loads(capsys.readouterr().out)["processes"]


def test_spawned_processes_are_listed_and_a_killed_one_is_gone(shim, tmp_path, monkeypatch, capsys):
    shim.omni("0.28.0")
    overlay = shim.registry(entry(), name="overlay.toml")
    state = tmp_path / "state"
    for k, v in {"OMNI_PATCHES": "1", "OMNI_PATCHES_CONFIG": str(overlay), "OMNI_PATCHES_STATE_DIR": str(state)}.items():
        monkeypatch.setenv(k, v)
    ctx = multiprocessing.get_context("spawn")
    stop = tmp_path / "stop"
    procs, readies = [], []
    for rank in range(4):
        ready = ctx.Event()
        p = ctx.Process(target=proof_child.serve, args=(ready, str(stop), "fakeomni.loader"), name=f"VllmWorker-{rank}")
        p.start()
        procs.append(p)
        readies.append(ready)
    try:
        for ready in readies:
            assert ready.wait(60), "a child did not apply its patch in time"
        rc, records = _all_processes(capsys, state)
        assert rc == 0
        assert sorted(r["pid"] for r in records) == sorted(p.pid for p in procs)
        for r in records:
            assert r["status"] == "running"
            assert r["patches"]["fake-double"]["state"] == "applied"
            assert r["patches"]["fake-double"]["targets"] == ["fakeomni.loader"]
        assert sorted(r["role"] for r in records) == [f"worker {i}" for i in range(4)]

        victim = procs[1]
        os.kill(victim.pid, signal.SIGKILL)  # atexit does not run: the record stays behind
        victim.join(30)
        rc, records = _all_processes(capsys, state)
        by_pid = {r["pid"]: r for r in records}
        assert by_pid[victim.pid]["status"] == "gone"
        assert [by_pid[p.pid]["status"] for p in procs if p is not victim] == ["running"] * 3

        capsys.readouterr()
        cli.main(["status", "--all-processes", "--state-dir", str(state)])
        text = capsys.readouterr().out
        assert "gone" in text and "worker 0" in text and "fake-double" in text
    finally:
        stop.touch()
        for p in procs:
            p.join(30)
            if p.is_alive():  # pragma: no cover
                p.kill()
    # The others exited normally: atexit removed their records; the killed one's is left, marked gone.
    left = sorted(f.name for f in state.iterdir() if f.name != "stop")
    assert left == [f"{victim.pid}.json"]


def test_one_info_line_per_process_and_atomic_record(shim, logs, tmp_path, monkeypatch):
    monkeypatch.setattr(proof, "_logged_pid", None)
    monkeypatch.setenv("OMNI_PATCHES_STATE_DIR", str(tmp_path / "st"))
    shim.omni("0.28.0")
    shim.registry(entry())
    shim.env(OMNI_PATCHES="1")
    omni_patches.activate()
    import fakeomni.consumer  # noqa: F401,E501 -- applies to both targets: loader, then consumer

    lines = [m for m in logs.messages(logging.INFO) if m.startswith("process pid=")]
    assert len(lines) == 1, lines
    assert f"pid={os.getpid()}" in lines[0] and "fake-double=applied" in lines[0]
    files = sorted(p.name for p in (tmp_path / "st").iterdir())
    assert files == [f"{os.getpid()}.json"]  # no temp file left behind
    rec = json.loads((tmp_path / "st" / files[0]).read_text())
    assert rec["patches"]["fake-double"]["targets"] == ["fakeomni.loader", "fakeomni.consumer"]
    assert rec["role"] in ("main", "rank " + os.environ.get("RANK", "")) and rec["pgid"] == os.getpgid(0)


def test_concurrent_writers_never_leave_a_torn_file(tmp_path):
    """Many processes rewriting their records while a reader reads: every file always parses."""
    code = ("import sys; sys.path.insert(0, %r); from omni_patches import proof\n"
            "for i in range(200): proof.write({'pid': %d, 'patches': {'x': {'state': 'applied', 'reason': 'r' * (i * 50)}}}, %r)")
    writers = [subprocess.Popen([sys.executable, "-c", code % (os.getcwd(), 4_000_000 + n % 2, str(tmp_path))])
               for n in range(4)]  # two writers per file: os.replace makes the last one win, whole
    bad = []
    while any(w.poll() is None for w in writers):
        for r in proof.collect(tmp_path):
            if r.get("status") == "unreadable":
                bad.append(r)
    assert all(w.wait() == 0 for w in writers)
    assert not bad
    assert sorted(f.name for f in tmp_path.iterdir()) == ["4000000.json", "4000001.json"]
    assert {r["status"] for r in proof.collect(tmp_path)} == {"gone"}  # no such pids


def test_unreadable_record_is_reported_not_fatal(tmp_path, capsys):
    (tmp_path / "123.json").write_text("{not json")
    rc, records = _all_processes(capsys, tmp_path)
    assert records[0]["status"] == "unreadable"


def test_empty_state_dir(tmp_path, capsys):
    assert cli.main(["status", "--all-processes", "--state-dir", str(tmp_path / "none")]) == 1
    assert "no process" in capsys.readouterr().out


def test_default_state_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("OMNI_PATCHES_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert proof.state_dir() == str(tmp_path / "omni-patches")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "")
    assert proof.state_dir().endswith(f"omni-patches-{os.getuid()}")
    monkeypatch.setenv("OMNI_PATCHES_STATE_DIR", "/x/y")
    assert proof.state_dir() == "/x/y"


def test_gauge_with_real_prometheus_client(shim, tmp_path, monkeypatch):
    prometheus_client = pytest.importorskip("prometheus_client")
    monkeypatch.setenv("OMNI_PATCHES_STATE_DIR", str(tmp_path / "st"))
    shim.omni("0.28.0")
    shim.registry(entry(), entry("fake-out", requires={"fake-omni": ">=0.40"}, fixed_in={}))
    shim.env(OMNI_PATCHES="1")
    omni_patches.activate()
    import fakeomni.loader  # noqa: F401

    text = prometheus_client.generate_latest().decode()
    assert 'omni_patches_applied{patch="fake-double"} 1.0' in text
    assert 'omni_patches_applied{patch="fake-out"} 0.0' in text
    assert "# TYPE omni_patches_applied gauge" in text


def test_nothing_at_start_up_until_a_patch_applies(tmp_path):
    """Activation alone imports neither proof nor prometheus_client and writes no record."""
    code = ("import sys, omni_patches; omni_patches.activate(force=True); "
            "print('omni_patches.proof' in sys.modules, 'prometheus_client' in sys.modules)")
    env = {**os.environ, "OMNI_PATCHES": "1", "OMNI_PATCHES_STATE_DIR": str(tmp_path / "st")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=os.getcwd(),
                         check=True).stdout.split()
    assert out == ["False", "False"]
    assert not (tmp_path / "st").exists()
