"""Records and their readers as an operator meets them (issue 20): fork / forkserver workers that exit cleanly, a
killed worker not yet reaped, a relative state directory and a host that changes directory, state directories and
files the reader cannot use, writers killed mid-write, and the instance view (every process the shim knows of,
the expected worker count, the empty view after a prune, only the patches that apply, the Ray hints)."""
import contextlib
import io
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

import omni_patches
from omni_patches import cli, fleet, proof
from omni_patches.testing import standins
from support import proof_child
from support.fake_gcs import FakeCluster, ray_record
from support.fakes import entry


@pytest.fixture
def fresh_proof():
    """This (pytest) process has recorded nothing yet, whatever earlier tests did."""
    proof.forget()
    yield
    proof.forget()


def _serving_env(shim, tmp_path, monkeypatch, **extra):
    shim.omni("0.28.0")
    overlay = shim.registry(entry(), name="overlay.toml")
    env = {"OMNI_PATCHES": "1", "OMNI_PATCHES_CONFIG": str(overlay), "OMNI_PATCHES_STATE_DIR": str(tmp_path / "state"),
           "OMNI_PATCHES_INSTANCE": "inst-1", **extra}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def _status(capsys, *args):
    """``omni-patches status ...`` in this process: (exit code, stdout, stderr). A traceback fails the test."""
    capsys.readouterr()
    rc = cli.main(["status", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _records(state):
    return sorted(f.name for f in state.iterdir() if f.name.endswith(".json")) if state.exists() else []


# -- 1. fork and forkserver workers that exit cleanly -------------------------------------------------------------
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_fork_and_forkserver_workers_that_exit_cleanly_leave_no_record(method, shim, fresh_proof, tmp_path, monkeypatch,
                                                                     capsys):
    """vLLM starts its workers with fork by default. Two ``VllmWorker-<i>`` children exit 0: their records go
    with them (a fork / forkserver child ends in os._exit: atexit never runs), none is shown ``gone``."""
    env = _serving_env(shim, tmp_path, monkeypatch)
    state = tmp_path / "state"
    if method == "fork":  # the engine core imported (and patched) its modules before it forked the workers
        omni_patches.activate()
        import fakeomni.loader  # noqa: F401
        assert _records(state) == [f"{os.getpid()}.json"]
    ctx = multiprocessing.get_context(method)
    stop = tmp_path / "stop"
    procs, readies = proof_child.start_workers(ctx, 2, proof_child.worker, str(stop), "fakeomni.loader", env,
                                               sys.path[:3])
    try:
        for ready in readies:
            assert ready.wait(60), "a worker did not record itself in time"
        rc, out, _ = _status(capsys, "--all-processes", "--json", "--state-dir", str(state))
        workers = {r["pid"]: r for r in json.loads(out)["processes"] if r["pid"] != os.getpid()}
        assert sorted(workers) == sorted(p.pid for p in procs)
        assert sorted(r["role"] for r in workers.values()) == ["worker 0", "worker 1"]
        assert {r["status"] for r in workers.values()} == {"running"}
        assert {r["patches"]["fake-double"]["state"] for r in workers.values()} == {"applied"}
    finally:
        proof_child.stop_workers(procs, stop)
        if method == "forkserver":  # the fork server this test started (the suite's own: stop it, leave nothing)
            server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
            getattr(server, "_stop", lambda: None)()
    assert [p.exitcode for p in procs] == [0, 0]
    assert not {f"{p.pid}.json" for p in procs} & set(_records(state))
    rc, out, _ = _status(capsys, "--all-processes", "--all", "--json", "--state-dir", str(state))
    assert [r for r in json.loads(out)["processes"] if r["status"] == "gone"] == []


# -- 2. a killed worker its parent has not reaped ----------------------------------------------------------------
def _proc_state(pid):
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rpartition(")")[2].split()[0]


def test_a_killed_worker_not_yet_reaped_is_gone_not_running(shim, tmp_path, monkeypatch, capsys):
    env = _serving_env(shim, tmp_path, monkeypatch)
    state = tmp_path / "state"
    ctx = multiprocessing.get_context("spawn")
    stop = tmp_path / "stop"
    ready = ctx.Event()
    p = ctx.Process(target=proof_child.worker, args=(ready, str(stop), "fakeomni.loader", env, sys.path[:3]),
                    name="VllmWorker-0")
    p.start()
    try:
        assert ready.wait(60)
        os.kill(p.pid, signal.SIGKILL)  # the parent (this process) does not join it yet: a zombie
        deadline = time.monotonic() + 30
        while _proc_state(p.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _proc_state(p.pid) == "Z"
        rc, out, _ = _status(capsys, "--all-processes", "--json", "--state-dir", str(state))
        assert [(r["pid"], r["status"]) for r in json.loads(out)["processes"]] == [(p.pid, "gone")]
        assert fleet.prune(str(state)) == [str(state / f"{p.pid}.json")]
    finally:
        proof_child.stop_workers([p], stop)


# -- 3. a relative OMNI_PATCHES_STATE_DIR and a host that changes directory ------------------------------------------
def test_relative_state_dir_is_resolved_once_and_the_record_removed_after_chdir(shim, tmp_path, monkeypatch):
    env = _serving_env(shim, tmp_path, monkeypatch, OMNI_PATCHES_STATE_DIR="rel-state")
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(work)  # the spawned host starts in this directory
    ctx = multiprocessing.get_context("spawn")
    stop = tmp_path / "stop"
    ready, report = ctx.Event(), tmp_path / "report"
    p = ctx.Process(target=proof_child.worker, name="VllmWorker-0",
                    args=(ready, str(stop), "fakeomni.loader", env, sys.path[:3], str(elsewhere), str(report)))
    p.start()
    try:
        assert ready.wait(60)
        assert _records(work / "rel-state") == [f"{p.pid}.json"]
    finally:
        proof_child.stop_workers([p], stop)
    assert p.exitcode == 0
    assert _records(work / "rel-state") == []  # removed at the clean exit, after the host's os.chdir
    assert not (elsewhere / "rel-state").exists()
    # What the host's children inherit: the absolute directory, whatever their own working directory.
    assert report.read_text() == str(work / "rel-state")


def test_writer_dir_pins_a_relative_state_dir(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMNI_PATCHES_STATE_DIR", "st")
    assert proof.writer_dir() == str(tmp_path / "st")
    assert os.environ["OMNI_PATCHES_STATE_DIR"] == str(tmp_path / "st")
    monkeypatch.chdir("/")
    assert proof.writer_dir() == str(tmp_path / "st")


# -- 4. readers that cannot use what they find ------------------------------------------------------------------------
def test_state_dir_that_is_a_file(tmp_path, capsys):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    rc, out, err = _status(capsys, "--all-processes", "--state-dir", str(not_a_dir))
    assert rc == 2 and "cannot read the state directory" in err and "Not a directory" in err
    assert "no process record could be read" in out
    rc, out, err = _status(capsys, "--prune", "--state-dir", str(not_a_dir))
    assert rc == 2 and "cannot read the state directory" in err and "removed 0 record(s)" in out
    rc, out, err = _status(capsys, "--all-processes", "--json", "--state-dir", str(not_a_dir))
    assert rc == 2 and json.loads(out)["problems"] and json.loads(out)["processes"] == []


def _as_another_user(func):
    """Run ``func()`` (which returns text) in a forked child under uid/gid 65534 (nobody); returns its result.
    Run as root (this test machine), that is another user; run as a user, dropping privileges is impossible and
    the caller's chmod 000 alone makes the directory unreadable."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(rfd)
            if os.getuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            result = func()
        except BaseException as exc:
            result = json.dumps({"crash": f"{type(exc).__name__}: {exc}"})
        with os.fdopen(wfd, "w") as fh:
            fh.write(result)
        os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd) as fh:
        text = fh.read()
    os.waitpid(pid, 0)
    return json.loads(text)


def test_another_users_private_state_dir(tmp_path):
    """Another user's 0700 state directory (status and --prune): a message, no traceback."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    (theirs / "4000001.json").write_text(json.dumps({"pid": 4_000_001, "patches": {}}))
    if os.getuid() != 0:
        theirs.chmod(0)
    tmp_path.chmod(0o755)

    def reader():
        out = {}
        for args in (["--all-processes"], ["--prune"]):
            so, se = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
                rc = cli.main(["status", *args, "--state-dir", str(theirs)])
            out[args[0]] = [rc, so.getvalue(), se.getvalue()]
        return json.dumps(out)

    try:
        got = _as_another_user(reader)
    finally:
        theirs.chmod(0o700)
    assert "crash" not in got, got
    for args, (rc, out, err) in got.items():
        assert rc == 2, (args, out, err)
        assert "cannot read the state directory" in err and "Permission denied" in err
    assert (theirs / "4000001.json").exists()


FOREIGN = {"list.json": [1, 2], "updated.json": {"pid": 4_000_020, "updated": "x"},
           "patches.json": {"pid": 4_000_021, "patches": ["fake-double"]}, "nopid.json": {"updated": 1.0},
           "instance.json": {"pid": 4_000_022, "instance": ["a"], "patches": {}}}


def test_foreign_json_files_are_reported_and_the_rest_is_read_and_pruned(tmp_path, capsys):
    d = tmp_path / "state"
    d.mkdir()
    for name, doc in FOREIGN.items():
        (d / name).write_text(json.dumps(doc))
    me = os.getpid()
    good = {"pid": me, "instance": "A", "start": proof.start_time(me), "updated": time.time(), "role": "main",
            "patches": {"p": {"state": "applied"}}}
    (d / f"{me}.json").write_text(json.dumps(good))
    (d / "4000030.json").write_text(json.dumps({**good, "pid": 4_000_030, "start": None}))  # died while A serves
    rc, out, err = _status(capsys, "--all-processes", "--json", "--state-dir", str(d))
    assert rc == 0
    procs = json.loads(out)["processes"]
    assert sorted((r.get("pid"), r["status"]) for r in procs if "error" not in r) == [(me, "running"),
                                                                                   (4_000_030, "gone")]
    bad = {os.path.basename(r["file"]): r["error"] for r in procs if "error" in r}
    assert sorted(bad) == sorted(FOREIGN) and all("not an omni-patches record" in e for e in bad.values())
    rc, out, err = _status(capsys, "--all-processes", "--state-dir", str(d))
    assert rc == 0 and "unreadable" in out and "running" in out
    rc, out, err = _status(capsys, "--prune", "--state-dir", str(d))
    assert rc == 0 and "removed 1 record(s)" in out
    assert sorted(_records(d)) == sorted([*FOREIGN, f"{me}.json"])  # foreign files are not ours to delete


def test_foreign_values_in_the_clusters_store_are_reported(tmp_path):
    cluster = FakeCluster([ray_record(11, "N1", "A1", rank="0")], *_tables())
    cluster.kv[b"I/N1/12"] = b"[1, 2]"
    cluster.kv[b"I/N1/13"] = json.dumps({"pid": 13, "ray": {"node_id": ["x"]}}).encode()
    got = fleet.collect_ray(cluster=cluster)
    assert sorted((r["key"], r.get("pid"), r["status"]) for r in got) == [
        ("I/N1/11", 11, "running"), ("I/N1/12", None, "unreadable"), ("I/N1/13", None, "unreadable")]


def test_with_ray_an_unreadable_local_dir_does_not_hide_the_cluster(tmp_path, monkeypatch, capsys):
    cluster = FakeCluster([ray_record(11, "N1", "A1", rank="0")], *_tables())
    monkeypatch.setattr(fleet, "Cluster", lambda address: cluster)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    rc, out, err = _status(capsys, "--ray", "127.0.0.1:6379", "--state-dir", str(not_a_dir))
    assert rc == 0 and "cannot read the state directory" in err and "ray worker 0" in out


# -- 5. a writer killed mid-write ------------------------------------------------------------------------------
WRITER = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})
from omni_patches import fleet, proof

def stuck(obj, fh):
    fh.write('{{"pid": ')
    fh.flush()
    print("writing", flush=True)
    time.sleep(120)

json.dump = stuck
proof.write({{"pid": os.getpid(), "patches": {{}}}}, {directory!r})
"""


def test_temp_files_of_a_writer_killed_mid_write_are_pruned(tmp_path, capsys):
    d = tmp_path / "state"
    d.mkdir()
    code = WRITER.format(root=os.getcwd(), directory=str(d))
    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
        tmp = [f.name for f in d.iterdir()]
        assert len(tmp) == 1 and tmp[0].startswith(f".{writer.pid}.") and tmp[0].endswith(".tmp")
        assert fleet.prune(str(d)) == [] and [f.name for f in d.iterdir()] == tmp  # a live writer's: kept
        writer.send_signal(signal.SIGKILL)
        writer.wait(30)
    finally:
        if writer.poll() is None:  # pragma: no cover
            writer.kill()
            writer.wait()
        writer.stdout.close()
    rc, out, err = _status(capsys, "--all-processes", "--state-dir", str(d))
    assert "1 temp file(s) of writers killed mid-write" in out
    rc, out, err = _status(capsys, "--prune", "--state-dir", str(d))
    assert rc == 0 and "removed 1 record(s)" in out and tmp[0] in out
    assert [f.name for f in d.iterdir() if f.name != fleet.PRUNED] == []


def test_a_temp_file_older_than_the_process_that_now_holds_its_pid_is_stale(tmp_path):
    """The writer died mid-write and its pid was reused by a later process: the temp file is still stale."""
    stale = tmp_path / f".{os.getpid()}.abc.tmp"
    stale.write_text('{"pid": ')
    os.utime(stale, (1.0, 1.0))  # written long before this process started
    fresh = tmp_path / f".{os.getpid()}.def.tmp"
    fresh.write_text('{"pid": ')  # being written by this (live) process now
    assert fleet.leftovers(str(tmp_path)) == [str(stale)]


def test_a_record_of_an_earlier_boot_is_gone_and_another_machines_unknown(tmp_path):
    """A state directory that outlived a reboot (or is shared with another machine): the pid says nothing."""
    me = os.getpid()
    for name, host in (("1.json", os.uname().nodename), ("2.json", "other-machine")):
        (tmp_path / name).write_text(json.dumps({"pid": me, "boot_id": "an-earlier-boot", "host": host,
                                                 "instance": "A", "updated": 1.0, "patches": {}}))
    assert [(os.path.basename(r["file"]), r["status"]) for r in fleet.collect(str(tmp_path))] == [
        ("1.json", "gone"), ("2.json", "unknown")]


# -- 18. every process of the instance, and the expected worker count ------------------------------------------------
def test_processes_where_nothing_applies_or_the_shim_is_off_are_listed(shim, fresh_proof, tmp_path, monkeypatch,
                                                                       capsys):
    """A worker where every patch skips, and one where the shim stays off (the node's OMNI_PATCHES=0 wins over
    the driver's: vLLM's V2 Ray executor), both of the same instance: listed, the second with its reason."""
    env = _serving_env(shim, tmp_path, monkeypatch)
    overlay = shim.registry(entry(requires={"fake-omni": ">=0.40"}, fixed_in={}), name="other.toml")
    state = tmp_path / "state"
    ctx = multiprocessing.get_context("spawn")
    stop = tmp_path / "stop"
    ready_skip, ready_off = ctx.Event(), ctx.Event()
    skipping = ctx.Process(target=proof_child.worker, name="VllmWorker-0",
                           args=(ready_skip, str(stop), "fakeomni.loader", {**env, "OMNI_PATCHES_CONFIG": str(overlay)},
                                 sys.path[:3]))
    off = ctx.Process(target=proof_child.plugin_only, name="VllmWorker-1",
                      args=(ready_off, str(stop), {**env, "OMNI_PATCHES": "0"}))
    procs = [skipping, off]
    skipping.start()
    monkeypatch.setenv("OMNI_PATCHES", "0")  # that worker's interpreter starts with the shim off (its .pth too)
    off.start()
    try:
        assert ready_skip.wait(60) and ready_off.wait(60)
        rc, out, _ = _status(capsys, "--all-processes", "--json", "--state-dir", str(state))
        by_pid = {r["pid"]: r for r in json.loads(out)["processes"]}
        assert rc == 0 and sorted(by_pid) == sorted(p.pid for p in procs)
        assert by_pid[skipping.pid]["patches"]["fake-double"]["state"] == "skipped:version"
        assert by_pid[skipping.pid]["role"] == "worker 0" and by_pid[skipping.pid]["status"] == "running"
        assert "OMNI_PATCHES is off" in by_pid[off.pid]["inactive"] and by_pid[off.pid]["role"] == "worker 1"
        rc, out, _ = _status(capsys, "--all-processes", "--state-dir", str(state))
        assert f"pid {off.pid} (worker 1): omni-patches is not active in this process: OMNI_PATCHES is off" in out
    finally:
        proof_child.stop_workers(procs, stop)
    assert _records(state) == []  # both exited cleanly


def test_plugin_outside_a_serving_instance_records_nothing(fresh_proof, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_PATCHES_STATE_DIR", str(tmp_path / "st"))
    monkeypatch.setenv("OMNI_PATCHES", "0")
    monkeypatch.delenv("OMNI_PATCHES_INSTANCE", raising=False)
    from omni_patches import plugin

    plugin.register()
    assert not (tmp_path / "st").exists()


def test_workers_record_the_parallel_layout():
    import types

    group = types.SimpleNamespace
    with standins.modules({"vllm.distributed.parallel_state": {
            "_WORLD": group(rank=3, local_rank=1, world_size=4), "_TP": group(rank_in_group=1, world_size=2),
            "_PP": group(rank_in_group=0, world_size=1), "_DP": group(rank_in_group=1, world_size=2)}},
            permissive=False):
        got = proof.vllm_rank()
    assert got == {"rank": 3, "local_rank": 1, "world_size": 4, "tp_rank": 1, "tp_size": 2,
                                 "pp_size": 1, "dp_size": 2}


def test_the_view_counts_the_workers_the_layout_expects(monkeypatch, tmp_path, capsys):
    records = [ray_record(11, "N1", "A1", rank="0"), ray_record(12, "N2", "A2", rank="2")]
    for r in records:
        r.update(world_size="4", tp_size="2", pp_size="1", dp_size="2")
    cluster = FakeCluster(records, *_tables())
    monkeypatch.setattr(fleet, "Cluster", lambda address: cluster)
    rc, out, _ = _status(capsys, "--ray", "127.0.0.1:6379", "--state-dir", str(tmp_path))
    assert rc == 0
    assert ("instance I: 2 of 4 worker rank(s) recorded (vLLM world size 4: TP 2 × PP 1 × DP 2); missing rank(s) "
            "1, 3") in out
    rc, out, _ = _status(capsys, "--ray", "127.0.0.1:6379", "--json", "--state-dir", str(tmp_path))
    assert json.loads(out)["instances"]["I"] == {"processes": 2, "expected_workers": 4, "tp_size": 2, "pp_size": 1,
                                                 "dp_size": 2, "workers_found": 2, "missing_ranks": [1, 3]}


def test_ray_view_lists_the_driver_when_no_worker_could_record(tmp_path, monkeypatch, capsys):
    """VLLM_PLUGINS leaves omni_patches out on the workers: nothing of the instance is in the cluster's store,
    the driver's local record is listed, and the view says no worker recorded itself."""
    cluster = FakeCluster([ray_record(11, "N1", "A1", rank="0", instance="other")], *_tables())
    monkeypatch.setattr(fleet, "Cluster", lambda address: cluster)
    me = os.getpid()
    (tmp_path / f"{me}.json").write_text(json.dumps({"pid": me, "instance": "J", "start": proof.start_time(me),
                                                     "updated": time.time(), "role": "main", "patches": {}}))
    rc, out, _ = _status(capsys, "--ray", "127.0.0.1:6379", "--state-dir", str(tmp_path))
    assert rc == 0 and "this host" in out
    assert "instance J: no worker rank recorded: a worker where the shim never ran records nothing" in out


# -- 19. the empty view after a prune ----------------------------------------------------------------------------
def test_the_empty_view_tells_all_cleaned_from_never_recorded(tmp_path, capsys):
    d = tmp_path / "state"
    d.mkdir()
    (d / "4000040.json").write_text(json.dumps({"pid": 4_000_040, "instance": "A", "updated": 1.0, "patches": {}}))
    rc, out, _ = _status(capsys, "--prune", "--state-dir", str(d))
    assert rc == 0 and "removed 1 record(s)" in out
    rc, out, _ = _status(capsys, "--all-processes", "--state-dir", str(d))
    assert rc == 0, out
    assert "have exited" in out and "`--prune` removed the last 1 record(s)" in out and "is OMNI_PATCHES=1" not in out
    rc, out, _ = _status(capsys, "--all-processes", "--json", "--state-dir", str(d))
    assert rc == 0 and json.loads(out)["processes"] == []
    rc, out, _ = _status(capsys, "--all-processes", "--state-dir", str(tmp_path / "never"))
    assert rc == 1 and "is OMNI_PATCHES=1 set" in out


# -- 20. only the patches that apply on this stack -----------------------------------------------------------------
def test_the_table_shows_the_patches_that_apply_and_the_rest_on_request(tmp_path, capsys):
    d = tmp_path / "state"
    d.mkdir()
    me = os.getpid()
    patches = {f"skipped-patch-{i}": {"state": "skipped:absent"} for i in range(8)}
    patches.update({"applies-here": {"state": "applied"}, "drifts-here": {"state": "drifted"}})
    (d / f"{me}.json").write_text(json.dumps({"pid": me, "instance": "A", "start": proof.start_time(me),
                                              "updated": time.time(), "role": "main", "patches": patches}))
    rc, out, _ = _status(capsys, "--all-processes", "--state-dir", str(d))
    assert rc == 0 and "applies-here" in out and "drifts-here" in out and "skipped-patch" not in out
    assert "8 patch(es) skipped in every process listed are not shown (--all-patches shows them)" in out
    assert max(len(line) for line in out.splitlines()) < 130
    rc, out, _ = _status(capsys, "--all-patches", "--state-dir", str(d))  # implies --all-processes
    assert all(f"skipped-patch-{i}" in out for i in range(8)) and "not shown" not in out
    rc, out, _ = _status(capsys, "--all-processes", "--json", "--state-dir", str(d))
    assert json.loads(out)["processes"][0]["patches"] == patches  # --json is always complete


# -- 17. the Ray view's hints ------------------------------------------------------------------------------------
def test_ray_view_names_the_ray_prune_and_each_nodes_own_files(tmp_path, monkeypatch, capsys):
    records = [ray_record(11, "N1", "A1", rank="0"), ray_record(14, "N2", "A4", rank="1")]
    nodes, jobs, actors = _tables()
    actors["A4"] = {"alive": False, "pid": 14, "name": None}  # killed: its node's local file stays behind
    cluster = FakeCluster(records, nodes, jobs, actors)
    monkeypatch.setattr(fleet, "Cluster", lambda address: cluster)
    rc, out, _ = _status(capsys, "--ray", "127.0.0.1:6379", "--state-dir", str(tmp_path))
    assert "1 record(s) of processes that are gone" in out
    assert "`omni-patches status --prune --ray` removes them" in out
    assert "every other node keeps its own local record files until `omni-patches status --prune` runs there" in out
    rc, out, _ = _status(capsys, "--prune", "--ray", "127.0.0.1:6379", "--state-dir", str(tmp_path))
    assert rc == 0 and "I/N2/14" in out
    assert "their nodes (127.0.0.2) keep their own local record files: run `omni-patches status --prune` on each" in out
    # On that node, the local reader points at both cleanups.
    local = tmp_path / "node2"
    local.mkdir()
    (local / "4000014.json").write_text(json.dumps({**records[1], "pid": 4_000_014, "boot_id": proof.boot("boot_id")}))
    rc, out, _ = _status(capsys, "--all-processes", "--state-dir", str(local))
    assert "`omni-patches status --prune` removes them here" in out and "--prune --ray" in out


def _tables():
    nodes = {"N1": {"alive": True, "ip": "127.0.0.1"}, "N2": {"alive": True, "ip": "127.0.0.2"}}
    actors = {"A1": {"alive": True, "pid": 11, "name": None}, "A2": {"alive": True, "pid": 12, "name": None}}
    return nodes, {"01000000": False}, actors


def test_the_view_lists_call_time_notes_per_process(tmp_path, capsys):
    """Under the table, each distinct note a patch made in a live process, with the processes (and ranks) holding
    it: per-rank facts stay per rank, a note every rank made is one line; skipped patches' notes are not shown."""
    me, parent = os.getpid(), os.getppid()
    for pid, rank in ((me, 0), (parent, 1)):
        patches = {"moe-ep-parallel-mapping": {"state": "applied", "notes": [f"mapped: vLLM EP rank {rank} of 2"]},
                   "p": {"state": "applied", "notes": ["the same everywhere"]},
                   "q": {"state": "skipped:version", "notes": ["a skipped patch's note"]}}
        (tmp_path / f"{pid}.json").write_text(json.dumps({
            "pid": pid, "instance": "K", "start": proof.start_time(pid), "updated": time.time(), "rank": rank,
            "role": f"rank {rank}", "patches": patches}))
    rc, out, _ = _status(capsys, "--all-processes", "--state-dir", str(tmp_path))
    assert rc == 0, out
    notes = out.split("noted at call time:\n", 1)[1].splitlines()
    assert f"  moe-ep-parallel-mapping in {me} (rank 0): mapped: vLLM EP rank 0 of 2" in notes
    assert f"  moe-ep-parallel-mapping in {parent} (rank 1): mapped: vLLM EP rank 1 of 2" in notes
    [shared] = [line for line in notes if line.endswith(": the same everywhere")]
    assert shared.startswith("  p in ") and sorted(shared[len("  p in "):].split(": ")[0].split(", ")) == \
        sorted([f"{me} (rank 0)", f"{parent} (rank 1)"]), shared
    assert "a skipped patch's note" not in out


def test_all_patches_says_why_each_patch_skipped_everywhere_is_skipped(tmp_path, capsys):
    """``--all-patches``: under the table, each patch skipped in every live process with its reason (once when all
    give the same; a count when they differ); patches applied somewhere are not listed there."""
    me, parent = os.getpid(), os.getppid()
    for pid, rank in ((me, 0), (parent, 1)):
        patches = {"a": {"state": "applied", "reason": "wrapped"},
                   "s": {"state": "skipped:absent", "reason": "vllm-ascend is not installed"},
                   "d": {"state": "skipped:version", "reason": f"outside its range on rank {rank}"},
                   "m": {"state": "skipped:version" if rank else "applied", "reason": "mixed"}}
        (tmp_path / f"{pid}.json").write_text(json.dumps({
            "pid": pid, "instance": "K", "start": proof.start_time(pid), "updated": time.time(), "rank": rank,
            "role": f"rank {rank}", "patches": patches}))
    rc, out, _ = _status(capsys, "--all-processes", "--all-patches", "--state-dir", str(tmp_path))
    assert rc == 0, out
    why = out.split("skipped in every process, and why:\n", 1)[1].splitlines()
    assert "  s: skipped:absent — vllm-ascend is not installed" in why, out
    assert "  d: skipped for 2 different reasons across the processes (--json lists them)" in why, out
    assert not any(line.startswith(("  a:", "  m:")) for line in why), out
    rc, out, _ = _status(capsys, "--all-processes", "--state-dir", str(tmp_path))
    assert "and why:" not in out  # without --all-patches the skipped columns and their reasons stay out
