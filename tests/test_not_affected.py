"""Builds without version metadata (``git archive`` of a tag, a tagless source install: vllm-omni reports 0.0.0) are
decided by code features. Code that predates a bug is "not affected", never drift; code that has the bug in a
layout a patch does not cover stays "drifted", with a reason that says so; genuine drift stays drift.

The trees are the REAL release files (``wheels.release_root``) without their dist-info, audited with ``--source``
(as tests/test_audit_hardening.py does); the stage-client verdicts are also checked at run time, through the engine,
on the real ``stage_diffusion_client.py`` with real zmq and a SIGKILLed peer, installed as version 0.0.0.
"""
import functools
import json

import pytest

from omni_patches import cli
from omni_patches.tools import audit
from support import stage_client_sandbox as sandbox
from support import wheels
from support.omni_children import run_children

# the child scripts of the two stage-client patches' own tests
SHUTDOWN_CHILD = "patches.omni_stage_shutdown_nonblocking.stage_shutdown_child"
SEND_CHILD = "patches.omni_stage_send_dead_engine.stage_send_child"

APPLY, FIXED, DRIFTED, NOT_AFFECTED, ABSENT = (audit.WOULD_APPLY, audit.FIXED, audit.DRIFTED, audit.NOT_AFFECTED,
                                               audit.ABSENT)
SHUTDOWN, SEND = "omni-stage-shutdown-nonblocking", "omni-stage-send-dead-engine"
SLEEP, TEARDOWN = "omni-diffusion-sleep-wake-errors", "omni-stage-executor-failure-teardown"
CLIENT = "diffusion/stage_diffusion_client.py"
_audits = {}


def _tagless(tmp_path, version, *edits):
    """The release's ``vllm_omni`` files, no metadata (what ``git archive v<version>`` gives), ``edits`` applied."""
    return wheels.tagless(tmp_path, "vllm-omni", version, "vllm_omni", *edits)


def _audit(capsys, tree, cache):
    capsys.readouterr()
    rc = cli.main(["audit", "--json", "--source", str(tree), "--cache", str(cache)])
    out = json.loads(capsys.readouterr().out)
    return rc, {p["id"]: p for p in out.get("patches", [])}


def _release(tmp_path_factory, capsys, version):
    """The tagless audit of a release, once per session (several tests read the same one)."""
    if version not in _audits:
        tmp = tmp_path_factory.mktemp(f"tagless-{version}")
        _audits[version] = _audit(capsys, _tagless(tmp, version), tmp / "cache")
    return _audits[version]


# -- the stage client's request socket (shutdown-nonblocking, send-dead-engine) ---------------------------------
@pytest.mark.parametrize("version,verdict,why", [
    ("0.18.0", NOT_AFFECTED, "runs the diffusion engine in-process"),  # no zmq, no _request_socket
    ("0.20.0", NOT_AFFECTED, "connect()s its PUSH _request_socket"),
    ("0.22.0", NOT_AFFECTED, "connect()s its PUSH _request_socket"),
    ("0.23.0rc1", NOT_AFFECTED, "connect()s its PUSH _request_socket"),  # the last release that connects
    ("0.24.0rc1", APPLY, "bound PUSH _request_socket"),  # the first that binds: affected
    ("0.30.0", APPLY, "bound PUSH _request_socket"),
    ("0.31.0rc1", FIXED, ""),
])
def test_tagless_stage_client(tmp_path_factory, capsys, version, verdict, why):
    _, got = _release(tmp_path_factory, capsys, version)
    for pid in (SHUTDOWN, SEND):
        st = got[pid]
        assert st["verdict"] == verdict and "decided by code features" in st["detail"], (pid, st)
        assert why in st["detail"], (pid, st)


def test_tagless_stage_client_is_decided_by_the_socket_not_the_version(tmp_path, capsys):
    """0.28.0 whose client connect()s instead of binding: not affected (its sends cannot block)."""
    co = _tagless(tmp_path, "0.28.0", (CLIENT, "self._request_socket.bind(request_address)",
                                       "self._request_socket.connect(request_address)"))
    _, got = _audit(capsys, co, tmp_path / "cache")
    assert got[SHUTDOWN]["verdict"] == got[SEND]["verdict"] == NOT_AFFECTED, got


@pytest.mark.parametrize("pid,old,new", [
    (SHUTDOWN, "def shutdown(self) -> None:", "def close_all(self) -> None:"),
    (SHUTDOWN, 'self._request_socket.send(self._encoder.encode({"type": "shutdown"}))', "pass"),
    (SEND, "async def add_request_async(", "async def submit_request_async("),
])
def test_tagless_stage_client_that_drifted_is_still_drifted(tmp_path, capsys, pid, old, new):
    co = _tagless(tmp_path, "0.28.0", (CLIENT, old, new))
    rc, got = _audit(capsys, co, tmp_path / "cache")
    assert got[pid]["verdict"] == DRIFTED and rc == audit.EXIT_DRIFT, got[pid]


# -- omni-diffusion-sleep-wake-errors ---------------------------------------------------------------------------
@pytest.mark.parametrize("version,verdict,why", [
    ("0.18.0", NOT_AFFECTED, "predates the sleep ACK protocol"),  # no OmniACK / OmniSleepTask at all
    # 0.20.0rc1-0.27.x ignore ERROR ACKs too (the bug is there), in a layout the patch does not cover.
    ("0.20.0", DRIFTED, "ERROR ACKs are ignored there too"),
    ("0.27.0rc1", DRIFTED, "ERROR ACKs are ignored there too"),
    ("0.28.0rc1", APPLY, "one engine-wide sleep record"),
    ("0.28.0", APPLY, "ACKs returned unread"),
    ("0.30.0", APPLY, "ACKs returned unread"),
    ("0.31.0rc1", FIXED, "_raise_on_diffusion_errors"),
])
def test_tagless_sleep_wake(tmp_path_factory, capsys, version, verdict, why):
    _, got = _release(tmp_path_factory, capsys, version)
    st = got[SLEEP]
    assert st["verdict"] == verdict and why in st["detail"], st


def test_tagless_sleep_wake_that_drifted_is_still_drifted(tmp_path, capsys):
    co = _tagless(tmp_path, "0.28.0", ("entrypoints/async_omni.py", "async def _wake_diffusion(",
                                       "async def _wake_diffusion_stages("))
    rc, got = _audit(capsys, co, tmp_path / "cache")
    assert got[SLEEP]["verdict"] == DRIFTED and rc == audit.EXIT_DRIFT, got[SLEEP]


# -- omni-stage-executor-failure-teardown -------------------------------------------------------------------------
@pytest.mark.parametrize("version,verdict,why", [
    ("0.18.0", ABSENT, "stage_diffusion_proc"),  # no stage subprocess at all
    # No fatal teardown at all: a dead executor is never torn down (worse than the bug), not covered.
    ("0.20.0", DRIFTED, "never torn down there"),
    ("0.21.0rc1", DRIFTED, "never torn down there"),
    ("0.22.0", APPLY, "fatal teardown only after a failed request"),
    ("0.31.0rc1", FIXED, "_watch_executor_failure"),
])
def test_tagless_executor_failure_teardown(tmp_path_factory, capsys, version, verdict, why):
    _, got = _release(tmp_path_factory, capsys, version)
    st = got[TEARDOWN]
    assert st["verdict"] == verdict and why in st["detail"], st


# -- at run time, through the engine: the real client installed as 0.0.0 ----------------------------------------
TAGLESS = functools.partial(sandbox.paths, metadata_version="0.0.0")


@pytest.fixture(scope="module")
def shutdown_runs(tmp_path_factory):
    jobs = [(v, v, {"stock_wait": 2.0}) for v in ("0.20.0", "0.23.0rc1", "0.28.0")]
    return run_children("tagless stage-shutdown", SHUTDOWN_CHILD, jobs, TAGLESS,
                        tmp_path_factory.mktemp("state"), timeout=240)


@pytest.mark.parametrize("version", ["0.20.0", "0.23.0rc1"])
def test_tagless_connecting_client_is_not_affected_at_run_time(shutdown_runs, version):
    res = shutdown_runs[version]
    # What makes it not affected, observed: the client connects, and stock shutdown() returns on a dead peer.
    assert res["stock_dead"]["client_binds"] is False and res["stock_dead"]["returned"] is True
    assert res["status"]["state"] == "skipped:version", res["status"]
    assert "not affected (predates the bug)" in res["status"]["reason"] and "connect()s" in res["status"]["reason"]


def test_tagless_binding_client_is_patched_at_run_time(shutdown_runs):
    res = shutdown_runs["0.28.0"]
    assert res["stock_dead"]["client_binds"] is True and res["stock_dead"]["returned"] is False  # the bug
    assert res["status"]["state"] == "applied" and "decided by code features" in res["status"]["reason"]
    assert res["patched_dead"]["returned"] is True


@pytest.fixture(scope="module")
def send_runs(tmp_path_factory):
    return run_children("tagless stage-send", SEND_CHILD, [("0.23.0rc1", "0.23.0rc1", {"stock_wait": 2.0})],
                        TAGLESS, tmp_path_factory.mktemp("state"))


def test_tagless_connecting_client_sends_are_not_affected_at_run_time(send_runs):
    res = send_runs["0.23.0rc1"]
    assert res["stock"]["add/dead_unmarked"]["client_binds"] is False
    assert all(call["returned"] for key, call in res["stock"].items() if key != "live"), res["stock"]
    assert res["status"]["state"] == "skipped:version" and "not affected" in res["status"]["reason"], res["status"]
