"""omni-diffusion-sleep-wake-errors on the REAL AsyncOmni.sleep / wake_up of every affected release, real OmniACKs.

Each release runs in its own interpreter (``sleep_wake_child``): the real ``async_omni.py`` (and
``async_omni_base.py``) from the PyPI wheel with the release's real ``OmniACK`` / ``OmniSleepTask`` /
``OmniWakeTask`` / ``CuMemTag`` (``support.omni_sleep_sandbox``), its real ``AsyncEventResolver``, and diffusion
stages that answer with a real ERROR ACK, its dict form, an RPC error or StagePool's failed-RPC result. Every
scenario runs stock, then with the shim activated; upstream's fixed release (0.31.0rc1, #7811) runs the same
scenarios: each patched release must give exactly its outcomes, step by step (raise or return, message, sleep
record, level-2 flag, admission, RPCs sent).
"""
import pytest

from support import omni_sleep_sandbox as sandbox
from support.omni_children import run_children
from patches.omni_diffusion_sleep_wake_errors.sleep_wake_child import SCENARIOS

SWITCH = "OMNI_PATCHES_OMNI_DIFFUSION_SLEEP_WAKE_ERRORS"
AFFECTED = ["0.28.0rc1", "0.28.0", "0.29.0rc1", "0.30.0rc1", "0.30.0"]  # every release with _sleep_diffusion, before the fix
ENGINE_WIDE = ["0.28.0rc1"]  # one engine-wide sleep record (_sleeping_tags), no per-stage one
FIXED = ["0.31.0rc1", "0.32.0rc1"]
BEFORE = ["0.27.0rc1"]  # ignores the ACKs too, inline in sleep() / wake_up(): not covered
FAILING = [n for n in SCENARIOS if n not in ("wake_ok",)]


OFF = ("0.30.0-switch-off", "0.30.0", {"env": {SWITCH: "0"}})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    jobs = [(v, v, {"env": {}}) for v in AFFECTED + FIXED + BEFORE] + [OFF]
    return run_children("sleep/wake", "patches.omni_diffusion_sleep_wake_errors.sleep_wake_child", jobs, sandbox.paths,
                        tmp_path_factory.mktemp("state"))


@pytest.mark.parametrize("version", AFFECTED)
def test_stock_reports_a_failed_wake_up_as_success(runs, version):
    """The bug, on the release's own code: an ERROR ACK is returned, the stage is marked awake, admission reopens."""
    step = runs[version]["stock"]["wake_error"][1]
    assert step["returned"] == [{"OmniACK": ["ERROR", 0, "CUDA Error: out of memory"]}], step
    assert step["is_sleeping"] is False and step["paused"] is False and step["stage_tags"] == {}
    sleep = runs[version]["stock"]["sleep_error"][0]
    assert "returned" in sleep and sleep["is_sleeping"] is True  # a failed sleep committed as done


@pytest.mark.parametrize("version", AFFECTED)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_patched_equals_the_fixed_release(runs, version, scenario):
    res = runs[version]
    assert res["status"]["state"] == "applied", res["status"]
    assert _comparable(version, res["patched"][scenario]) == _comparable(version, runs["0.31.0rc1"]["stock"][scenario])
    if scenario in FAILING:
        assert res["stock"][scenario] != res["patched"][scenario]  # the scenario does exercise the fix


def _comparable(version, steps):
    """Steps as a release can record them: 0.28.0rc1 has no per-stage record to compare (its engine-wide tags,
    the level-2 flag, admission, is_sleeping and the RPCs sent still are)."""
    if version not in ENGINE_WIDE:
        return steps
    return [{k: v for k, v in step.items() if k != "stage_tags"} for step in steps]


@pytest.mark.parametrize("version", AFFECTED)
def test_patched_wake_up_raises_and_keeps_the_stage_asleep(runs, version):
    res = runs[version]
    failed, retry = res["patched"]["wake_error"][1:]
    assert failed["raised"] == "RuntimeError: handle_wake_task failed: CUDA Error: out of memory"
    assert failed["is_sleeping"] is True and failed["paused"] is True
    assert "returned" in retry and retry["is_sleeping"] is False and retry["paused"] is False  # a later wake works
    assert res["patched"]["wake_rpc_error"][1]["raised"].startswith("RuntimeError: handle_wake_task failed: ")
    assert "wake_up: 7 diffusion failure(s)" in res["status_after"]["reason"]
    assert res["patched"]["wake_ok"] == res["stock"]["wake_ok"]  # success: stock's outcome


@pytest.mark.parametrize("version", FIXED)
def test_fixed_release_skips(runs, version):
    res = runs[version]
    assert res["status"]["state"] == "skipped:version" and "fixed upstream" in res["status"]["reason"]
    assert res["stock"] == res["patched"] == runs["0.31.0rc1"]["stock"]


@pytest.mark.parametrize("version", BEFORE)
def test_older_release_is_outside_the_range(runs, version):
    res = runs[version]
    assert res["status"]["state"] == "skipped:version" and "outside" in res["status"]["reason"]
    assert "returned" in res["stock"]["wake_error"][1]  # the bug is there too; the patch does not cover it


def test_switch_off_leaves_stock(runs):
    res = runs[OFF[0]]
    assert res["status"]["state"] == "skipped:disabled"
    assert res["patched"] == res["stock"]


# -- the ACK reading itself, against upstream's shapes -------------------------------------------------------------
@pytest.mark.parametrize("ack,expected", [
    ({"status": "SUCCESS", "error_msg": None, "task_id": "t"}, None),
    ({"status": "ERROR", "error_msg": "oom", "task_id": "t"}, "oom"),
    ({"status": "ERROR", "error_msg": None}, "worker reported ERROR"),
    ({"error": True, "reason": "died"}, "died"),
    ({"error": True}, "RPC failed"),
    ({"supported": False, "error": "gone"}, "gone"),
    ({"supported": False}, "{'supported': False}"),
    ({"todo": True}, "{'todo': True}"),
    ({"supported": True}, None),
])
def test_ack_error_reads_upstreams_shapes(ack, expected):
    from omni_patches.patches.omni_diffusion_sleep_wake_errors import ack_error

    assert ack_error(ack) == expected
