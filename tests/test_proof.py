"""Proof in production: per-process records, ``status --all-processes``, the INFO line and the gauge."""
import contextlib
import importlib.util
import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys

import pytest

import omni_patches
from omni_patches import cli, fleet, proof
from omni_patches.testing import standins
from support import proof_child
from support.fake_gcs import FakeCluster, ray_record
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
    procs, readies = proof_child.start_workers(ctx, 4, proof_child.serve, str(stop), "fakeomni.loader")
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
        proof_child.stop_workers(procs, stop)
    # The others exited normally: atexit removed their records; the killed one's is left, marked gone.
    left = sorted(f.name for f in state.iterdir() if f.name != "stop")
    assert left == [f"{victim.pid}.json"]


def test_one_info_line_per_process_and_atomic_record(shim, logs, tmp_path, monkeypatch):
    proof.forget()
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
        for r in fleet.collect(tmp_path):
            if r.get("status") == "unreadable":
                bad.append(r)
    assert all(w.wait() == 0 for w in writers)
    assert not bad
    assert sorted(f.name for f in tmp_path.iterdir()) == ["4000000.json", "4000001.json"]
    assert {r["status"] for r in fleet.collect(tmp_path)} == {"gone"}  # no such pids


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


# -- instance id, roles, Ray KV, ghosts (issue 15) ---------------------------------------------------------
def test_instance_id_is_minted_at_the_first_vllm_family_import_and_inherited(tmp_path):
    """Activation alone mints nothing (``OMNI_PATCHES=1 ray start`` must not give its node an id); the first
    watched import mints one, kept in os.environ so every child (and Ray's env copy) inherits it."""
    code = ("import os, sys, subprocess, omni_patches; omni_patches.activate(force=True)\n"
            "before = os.environ.get('OMNI_PATCHES_INSTANCE')\n"
            "try:\n    import vllm  # the first watched import starts the shim, installed or not\nexcept ImportError:\n    pass\n"
            "minted = os.environ.get('OMNI_PATCHES_INSTANCE')\n"
            "child = subprocess.run([sys.executable, '-c', 'import os; print(os.environ[\"OMNI_PATCHES_INSTANCE\"])'],"
            " capture_output=True, text=True).stdout.strip()\n"
            "print(before, minted, child)")
    env = {**os.environ, "OMNI_PATCHES": "1", "OMNI_PATCHES_STATE_DIR": str(tmp_path / "st")}
    env.pop("OMNI_PATCHES_INSTANCE", None)
    before, minted, child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                           cwd=os.getcwd(), check=True).stdout.split()
    assert before == "None"
    assert len(minted) == 12 and int(minted, 16) >= 0
    assert child == minted
    # An inherited id is kept, never replaced.
    env["OMNI_PATCHES_INSTANCE"] = "given-by-driver"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=os.getcwd(),
                         check=True).stdout.split()
    assert out == ["given-by-driver"] * 3


def test_ensure_instance():
    env = {}
    first = proof.ensure_instance(env)
    assert env == {"OMNI_PATCHES_INSTANCE": first} and proof.ensure_instance(env) == first
    assert proof.ensure_instance({"OMNI_PATCHES_INSTANCE": " x "}) == "x"
    assert proof.ensure_instance({}) != first  # random per instance


def test_spawned_children_share_the_parents_instance(shim, tmp_path, monkeypatch, capsys):
    shim.omni("0.28.0")
    overlay = shim.registry(entry(), name="overlay.toml")
    state = tmp_path / "state"
    for k, v in {"OMNI_PATCHES": "1", "OMNI_PATCHES_CONFIG": str(overlay), "OMNI_PATCHES_STATE_DIR": str(state),
                 "OMNI_PATCHES_INSTANCE": "inst-1"}.items():
        monkeypatch.setenv(k, v)
    ctx = multiprocessing.get_context("spawn")
    stop = tmp_path / "stop"
    ready = ctx.Event()
    p = ctx.Process(target=proof_child.serve, args=(ready, str(stop), "fakeomni.loader"), name="VllmWorker-0")
    p.start()
    try:
        assert ready.wait(60)
        rc, records = _all_processes(capsys, state)
        assert [(r["pid"], r["instance"], r["role"]) for r in records] == [(p.pid, "inst-1", "worker 0")]
        assert records[0]["boot_id"] and records[0]["started"] <= records[0]["updated"]
    finally:
        stop.touch()
        p.join(30)


class FakeKV:
    """Stands in for ``ray.experimental.internal_kv`` (the real one is exercised by tests/test_ray_cluster.py)."""

    def __init__(self):
        self.store = {}

    def _internal_kv_initialized(self):
        return True

    def _internal_kv_put(self, key, value, overwrite=False, namespace=None):
        self.store[(namespace, key)] = value
        return True

    def _internal_kv_del(self, key, del_by_prefix=False, namespace=None):
        return self.store.pop((namespace, key), None) is not None


@pytest.fixture
def fake_ray(mocker):
    """A connected Ray worker as far as proof can tell: modules in sys.modules, nothing imported for real."""
    import types

    ctx = mocker.Mock(**{"get_node_id.return_value": "n" * 56, "get_job_id.return_value": "01000000",
                         "get_actor_id.return_value": "a" * 32, "get_worker_id.return_value": "w" * 56})
    kv = FakeKV()
    global_worker = types.SimpleNamespace(connected=True, mode=1, node_ip_address="127.0.0.2")
    with standins.modules({
        "ray": {"get_runtime_context": mocker.Mock(return_value=ctx)},
        "ray._private.worker": {"WORKER_MODE": 1, "SCRIPT_MODE": 0, "global_worker": global_worker},
        "ray.experimental.internal_kv": {name: getattr(kv, name) for name in (
            "_internal_kv_initialized", "_internal_kv_put", "_internal_kv_del")},
    }, permissive=False) as made:
        yield types.SimpleNamespace(kv=kv, kv_module=made["ray.experimental.internal_kv"],
                                    worker=made["ray._private.worker"], ctx=ctx)


@pytest.fixture
def parallel_state():
    """``parallel_state(rank=1)``: vLLM's parallel state as a worker rank holds it, in sys.modules until the end."""
    import types

    with contextlib.ExitStack() as stack:
        def install(rank, local_rank=0, world_size=2):
            attrs = {"_WORLD": types.SimpleNamespace(rank=rank, local_rank=local_rank, world_size=world_size),
                     "_TP": types.SimpleNamespace(rank_in_group=rank)}
            stack.enter_context(standins.modules({"vllm.distributed.parallel_state": attrs}, permissive=False))

        yield install


def test_role_of_a_ray_worker_with_its_vllm_rank(fake_ray, parallel_state):
    info = proof.ray_info()
    assert info["node_id"] == "n" * 56 and info["actor_id"] == "a" * 32 and info["node_ip"] == "127.0.0.2"
    assert proof.role(info=info)["role"] == "ray worker"  # rank not known yet: vLLM's state not initialised
    parallel_state(rank=1)
    got = proof.role(info=info)
    assert (got["role"], got["rank"], got["local_rank"], got["world_size"], got["tp_rank"]) == (
        "ray worker 1", "1", "0", "2", "1")


def test_ray_worker_recognised_by_argv0_or_raylet_env(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/x/site-packages/ray/_private/workers/default_worker.py", "--node-ip"])
    assert proof.role()["role"] == "ray worker"
    monkeypatch.setattr(sys, "argv", ["serve.py"])
    assert proof.role()["role"] != "ray worker"
    with standins.modules({} if "ray" in sys.modules else {"ray": {}}, permissive=False):
        assert proof.is_ray_worker({"RAY_RAYLET_PID": "123"})
        assert not proof.is_ray_worker({})


def test_driver_is_not_a_ray_worker(fake_ray, monkeypatch):
    fake_ray.worker.global_worker.mode = 0  # SCRIPT_MODE: the driver (engine core) connected to the cluster
    assert proof.role(info=proof.ray_info(), environ={})["role"] == "main"


def test_no_ray_no_info_and_nothing_imported(monkeypatch):
    for name in [n for n in sys.modules if n == "ray" or n.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    assert proof.ray_info() is None and proof.internal_kv() is None
    assert not any(n == "ray" or n.startswith("ray.") for n in sys.modules)


def test_applied_publishes_the_record_to_rays_kv(shim, fake_ray, parallel_state, tmp_path, monkeypatch, mocker):
    monkeypatch.setenv("OMNI_PATCHES_STATE_DIR", str(tmp_path / "st"))
    monkeypatch.setenv("OMNI_PATCHES_INSTANCE", "inst-7")
    proof.forget()
    parallel_state(rank=1)
    put = mocker.spy(fake_ray.kv_module, "_internal_kv_put")
    shim.omni("0.28.0")
    shim.registry(entry())
    shim.env(OMNI_PATCHES="1")
    omni_patches.activate()
    import fakeomni.consumer  # noqa: F401 -- started, then two targets: three puts of the same key

    key = f"inst-7/{'n' * 56}/{os.getpid()}"
    assert [c.args[0] for c in put.call_args_list] == [key, key, key]
    assert {c.kwargs["namespace"] for c in put.call_args_list} == {"omni_patches"}
    rec = json.loads(fake_ray.kv.store[("omni_patches", key)])
    assert rec["role"] == "ray worker 1" and rec["instance"] == "inst-7" and rec["rank"] == "1"
    assert rec["ray"]["actor_id"] == "a" * 32 and rec["ray"]["node_ip"] == "127.0.0.2"
    assert rec["patches"]["fake-double"]["targets"] == ["fakeomni.loader", "fakeomni.consumer"]
    local = json.loads((tmp_path / "st" / f"{os.getpid()}.json").read_text())
    assert local["ray"] == rec["ray"]
    proof.remove()  # what atexit does: the cluster's entry goes with the local file
    assert fake_ray.kv.store == {} and not (tmp_path / "st" / f"{os.getpid()}.json").exists()


def test_a_failing_kv_never_reaches_the_host(shim, fake_ray, tmp_path, monkeypatch, mocker, logs):
    monkeypatch.setenv("OMNI_PATCHES_STATE_DIR", str(tmp_path / "st"))
    mocker.patch.object(fake_ray.kv_module, "_internal_kv_put", side_effect=ConnectionError("GCS down"))
    shim.omni("0.28.0")
    shim.registry(entry())
    shim.env(OMNI_PATCHES="1")
    omni_patches.activate()
    import fakeomni.loader  # noqa: F401

    assert shim.status()["fake-double"].state == "applied"
    assert (tmp_path / "st" / f"{os.getpid()}.json").exists()  # the local record is still written
    assert any("cannot publish" in m and "GCS down" in m for m in logs.messages(logging.WARNING))


def _rec(directory, pid, *, instance, updated, started=None, start=None, **extra):
    rec = {"pid": pid, "instance": instance, "updated": updated, "started": started, "start": start,
           "role": "worker", "patches": {"p": {"state": "applied"}}, **extra}
    (directory / f"{pid}.json").write_text(json.dumps(rec))
    return rec


def _ghost_dir(tmp_path):
    """Instance A: this process (live), a dead worker it replaced, a worker that died while A serves;
    instance B: finished before A started."""
    me = os.getpid()
    start = proof.start_time(me)
    started = proof.started_at(start)
    d = tmp_path / "ghosts"
    d.mkdir()
    _rec(d, me, instance="A", updated=started + 5, started=started, start=start)
    _rec(d, 4_000_001, instance="A", updated=started - 50)  # replaced: older than A's live process
    _rec(d, 4_000_002, instance="A", updated=started + 1)   # died while A serves: news
    _rec(d, 4_000_003, instance="B", updated=started - 10)  # B finished before A started
    return d, me


def test_ghosts_are_hidden_by_default_all_shows_them(tmp_path, capsys):
    d, me = _ghost_dir(tmp_path)
    rc, shown = _all_processes(capsys, d)
    assert rc == 0
    assert {(r["pid"], r["status"]) for r in shown} == {(4_000_002, "gone"), (me, "running")}
    capsys.readouterr()
    cli.main(["status", "--all", "--json", "--state-dir", str(d)])  # --all implies --all-processes
    out = json.loads(capsys.readouterr().out)
    assert sorted(r["pid"] for r in out["processes"]) == sorted([me, 4_000_001, 4_000_002, 4_000_003])
    assert out["hidden"] == 0
    cli.main(["status", "--all-processes", "--state-dir", str(d)])
    text = capsys.readouterr().out
    assert "2 record(s) of dead processes older than their instance's live ones hidden (--all shows them)" in text
    assert "1 record(s) of processes that are gone" in text and "instance" in text


def test_a_dead_instance_alone_is_shown(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    _rec(d, 4_000_005, instance="Z", updated=100.0)
    _rec(d, 4_000_006, instance="Z", updated=50.0)
    assert len(fleet.visible(fleet.collect(d))) == 2  # nothing newer is alive: the operator must see them


def test_prune_removes_dead_records_only(tmp_path, capsys):
    d, me = _ghost_dir(tmp_path)
    assert cli.main(["status", "--prune", "--state-dir", str(d)]) == 0
    assert "removed 3 record(s)" in capsys.readouterr().out
    assert sorted(f.name for f in d.iterdir() if f.name != fleet.PRUNED) == [f"{me}.json"]
    assert cli.main(["status", "--prune", "--json", "--state-dir", str(d)]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == []


def _cluster():
    records = [ray_record(11, "N1", "A1", rank="0"),              # alive actor, same pid
               ray_record(12, "N2", "A2", rank="1"),              # alive actor on the other node
               ray_record(13, "N2", "A3", rank="1", updated=10),  # its predecessor: the actor was restarted
               ray_record(14, "N3", "A4", updated=10),            # node dead
               ray_record(15, "N1", "A5", job="02000000", updated=10),  # job finished
               ray_record(16, "N1", None)]                        # a task worker: not knowable from here
    nodes = {"N1": {"alive": True, "ip": "127.0.0.1"}, "N2": {"alive": True, "ip": "127.0.0.2"},
             "N3": {"alive": False, "ip": "127.0.0.3"}}
    actors = {"A1": {"alive": True, "pid": 11, "name": "vllm_Worker_x_TP0"},
              "A2": {"alive": True, "pid": 12, "name": "vllm_Worker_x_TP1"},
              "A3": {"alive": True, "pid": 99, "name": "vllm_Worker_y_TP1"},
              "A5": {"alive": False, "pid": 15, "name": None}}
    return FakeCluster(records, nodes, {"01000000": False, "02000000": True}, actors)


def test_collect_ray_judges_liveness_from_the_clusters_tables():
    got = {r["pid"]: r for r in fleet.collect_ray(cluster=_cluster())}
    assert {p: r["status"] for p, r in got.items()} == {11: "running", 12: "running", 13: "gone", 14: "gone",
                                                        15: "gone", 16: "unknown"}
    assert [r["pid"] for r in fleet.collect_ray(cluster=_cluster())] == [11, 15, 16, 12, 13, 14]  # node, rank
    assert got[12]["node_ip"] == "127.0.0.2" and got[12]["actor_name"] == "vllm_Worker_x_TP1"
    assert sorted(r["pid"] for r in fleet.visible(list(got.values()))) == [11, 12, 16]


def test_status_ray_lists_every_node_and_prunes_the_clusters_ghosts(tmp_path, monkeypatch, capsys):
    cluster = _cluster()
    monkeypatch.setattr(fleet, "Cluster", lambda address: cluster)
    d = tmp_path / "local"
    d.mkdir()
    me = os.getpid()
    _rec(d, me, instance="I", updated=999.0, start=proof.start_time(me), role="main")  # the driver, same instance
    _rec(d, 4_000_010, instance="other", updated=999.0)  # another instance's record on this host: not ours
    capsys.readouterr()
    assert cli.main(["status", "--ray", "127.0.0.1:6379", "--json", "--state-dir", str(d)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ray"] == "127.0.0.1:6379"
    assert sorted(r["pid"] for r in out["processes"]) == [11, 12, 16, me]
    assert {r["source"] for r in out["processes"]} == {"ray", "local"}
    cli.main(["status", "--ray", "127.0.0.1:6379", "--state-dir", str(d)])
    text = capsys.readouterr().out
    assert "127.0.0.1" in text and "127.0.0.2" in text and "ray worker 1" in text and "this host" in text

    assert cli.main(["status", "--prune", "--ray", "127.0.0.1:6379", "--json", "--state-dir", str(d)]) == 0
    removed = json.loads(capsys.readouterr().out)["removed"]
    assert sorted(k.rsplit("/", 1)[1] for k in removed) == ["13", "14", "15", "4000010.json"]
    assert sorted(int(k.rsplit("/", 1)[1]) for k in (c.decode() for c in cluster.kv)) == [11, 12, 16]
    assert sorted(f.name for f in d.iterdir() if f.name != fleet.PRUNED) == [f"{me}.json"]  # the local one too


def test_status_ray_without_ray_installed_says_so(tmp_path, capsys):
    if importlib.util.find_spec("ray") is not None:  # pragma: no cover - the test venv has no ray
        pytest.skip("ray is installed here")
    assert cli.main(["status", "--ray", "--state-dir", str(tmp_path)]) == 2
    assert "ray is not importable here" in capsys.readouterr().err
    assert "ray" not in sys.modules


def test_ray_address_default(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert fleet.ray_address() == "auto"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert fleet.ray_address() == "10.0.0.1:6379" and fleet.ray_address("h:1") == "h:1"
