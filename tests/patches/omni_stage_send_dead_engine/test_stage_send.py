"""omni-stage-send-dead-engine on the REAL StageDiffusionClient of every release, real zmq, real SIGKILL.

Each release runs in its own interpreter (``stage_send_child``): the real ``stage_diffusion_client.py``
from the PyPI wheel (stand-ins around it, ``support.stage_client_sandbox``), pyzmq 27.3.0, spawned peer
processes bound to the client's sockets. ``add_request_async``, ``abort_requests_async`` and
``collective_rpc_async`` run stock, then with the shim activated in the same process, against a live peer
(which answers the RPC), a SIGKILLed peer the client has marked dead, and a SIGKILLed peer it has not yet
marked dead. Upstream's fixed release (0.31.0rc1) runs the same scenarios: the patched old releases must give
exactly its outcomes. All children run at once (they mostly wait).
"""
import asyncio
import threading

import pytest

from support import stage_client_sandbox as sandbox
from support.omni_children import run_children
from support.zmq_sockets import assert_imports_without_zmq, push, zmq  # noqa: F401 (fixtures)

CHILD = "patches.omni_stage_send_dead_engine.stage_send_child"
SWITCH = "OMNI_PATCHES_OMNI_STAGE_SEND_DEAD_ENGINE"
STOCK_WAIT_S = 2.0  # a blocking PUSH send with no peer never returns: any bound proves it did not

# Every release from the first with a bound request socket to the last without the fix (PyPI, verified).
AFFECTED = ["0.24.0rc1", "0.24.0", "0.25.0rc1", "0.26.0rc1", "0.26.0", "0.27.0rc1", "0.28.0rc1", "0.28.0",
            "0.29.0rc1", "0.30.0rc1", "0.30.0"]
FIXED = ["0.31.0rc1", "0.32.0rc1"]
CONNECTS = ["0.23.0rc1"]  # the client connect()s its PUSH socket: the send queues, never blocks
DEAD = [f"{m}/{k}" for m in ("add", "abort", "rpc") for k in ("dead_marked", "dead_unmarked")]
# Stock 0.24.0rc1-0.30.0 on a dead peer: what hangs (abort even once the engine is marked dead: it never checks).
HANGS = {"add/dead_unmarked", "abort/dead_marked", "abort/dead_unmarked", "rpc/dead_unmarked"}


OFF = ("0.30.0-switch-off", "0.30.0", {"stock_wait": STOCK_WAIT_S, "patched_wait": STOCK_WAIT_S,
                                        "env": {SWITCH: "0"}})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    jobs = [(v, v, {"stock_wait": STOCK_WAIT_S}) for v in AFFECTED + FIXED + CONNECTS] + [OFF]
    return run_children("stage-send", CHILD, jobs, sandbox.paths,
                        tmp_path_factory.mktemp("state"))


def _outcome(call):
    """What the caller sees: returned or not, value or exception (type, message, ``from None``), flags after."""
    return {k: call.get(k) for k in ("returned", "value", "error", "suppressed_context", "engine_dead",
                                     "pending_rpcs")}


@pytest.mark.parametrize("version", AFFECTED)
def test_stock_hangs_on_a_dead_peer_and_the_patch_raises_as_upstream_does(runs, version):
    res, fixed = runs[version], runs["0.31.0rc1"]
    for key in DEAD:
        stock = res["stock"][key]
        # The precondition, observed: SIGKILLed, reaped, libzmq dropped the pipe, the monitor thread saw it.
        assert all(stock[k] for k in ("client_binds", "peer_reaped", "peer_dropped", "engine_dead_seen")), (key, stock)
        assert stock["returned"] is (key not in HANGS), (key, stock)
    assert res["stock"]["rpc/dead_unmarked"]["pending_rpcs"] == 1  # stock registers the id before it sends

    assert res["status"]["state"] == "applied", res["status"]
    assert "collective_rpc_async" in res["status"]["reason"]
    for key in DEAD:
        assert res["patched"][key]["returned"] is True, (key, res["patched"][key])
        assert _outcome(res["patched"][key]) == _outcome(fixed["stock"][key]), key
    assert res["patched"]["add/dead_unmarked"]["error"] == "EngineDeadError: "
    assert res["patched"]["rpc/dead_unmarked"]["pending_rpcs"] == 0
    assert "EngineDeadError instead of a blocking send: 2 call(s)" in res["status_after"]["reason"]
    assert "abort dropped instead of blocking: 1 call(s)" in res["status_after"]["reason"]


@pytest.mark.parametrize("version", AFFECTED)
def test_a_live_peer_gets_the_same_messages_and_the_rpc_its_answer(runs, version):
    res = runs[version]
    patched, stock = res["patched"]["live"], res["stock"]["live"]
    assert [m["type"] for m in patched["peer_received"]] == ["add_request", "abort", "collective_rpc"]
    assert patched["peer_received"] == stock["peer_received"]  # byte for byte what stock sends, decoded
    assert patched["rpc"]["value"] == {"ran": "handle_sleep_task"}
    for m in ("add", "abort", "rpc"):
        assert _outcome(patched[m]) == _outcome(stock[m]) == _outcome(runs["0.31.0rc1"]["stock"]["live"][m]), m


def test_live_messages_equal_the_fixed_release(runs):
    """0.30.0 sends the same message fields as 0.31.0rc1 (older releases send fewer add_request fields): patched,
    it sends exactly upstream's messages."""
    assert runs["0.30.0"]["patched"]["live"]["peer_received"] == runs["0.31.0rc1"]["stock"]["live"]["peer_received"]


@pytest.mark.parametrize("version", FIXED)
def test_fixed_release_skips_and_never_hangs(runs, version):
    res = runs[version]
    assert res["status"]["state"] == "skipped:version" and "fixed upstream" in res["status"]["reason"]
    assert all(res["stock"][key]["returned"] for key in DEAD)
    assert _outcome(res["stock"]["abort/dead_marked"])["value"] is None


@pytest.mark.parametrize("version", CONNECTS)
def test_releases_before_the_bound_socket_never_blocked(runs, version):
    res = runs[version]
    assert res["stock"]["add/dead_unmarked"]["client_binds"] is False
    assert all(res["stock"][key]["returned"] for key in DEAD)
    assert res["status"]["state"] == "skipped:version" and "outside" in res["status"]["reason"]


def test_switch_off_leaves_stock(runs):
    res = runs[OFF[0]]
    assert res["status"]["state"] == "skipped:disabled"
    assert res["patched"]["add/dead_unmarked"]["returned"] is False


def test_patch_module_imports_without_zmq():
    assert_imports_without_zmq("omni_patches.patches.omni_stage_send_dead_engine")


# --------------------------------------------------------------------------------------------------
# The wrappers themselves, on real zmq sockets in this process (pyzmq from the cached --target directory).
# --------------------------------------------------------------------------------------------------
class _Proc:
    def __init__(self, alive):
        self.alive = alive

    def is_alive(self):
        return self.alive


class _Manager:
    def __init__(self, alive=True):
        self.proc = _Proc(alive)


def _run():
    """The patch's run-time record, as the engine gives it (ctx.run)."""
    from omni_patches.runs import PatchRun

    return PatchRun.standalone("omni-stage-send-dead-engine")


class _Dead(Exception):
    pass


class _Client:
    stage_id, replica_id = 2, 0

    def __init__(self, sock, alive=True):
        self._request_socket, self._proc_manager = sock, _Manager(alive)
        self._engine_dead, self._pending_rpcs = False, set()


def _send_then(sock, after=None, rpc_id=None):
    """A stand-in for a stock method: register an RPC id, send, then (optionally) await ``after``."""

    async def stock(client):
        if rpc_id:
            client._pending_rpcs.add(rpc_id)
        sock.send(b"msg")
        if after is not None:
            return await after()
        return "sent"

    return stock


def test_no_room_while_the_process_lives_waits_and_sends_once(zmq, push, tmp_path, mocker):
    """Upstream's loop: while the process lives, wait for POLLOUT and try again; the message goes out once."""
    from omni_patches.patches import omni_stage_send_dead_engine as p

    client = _Client(push, alive=True)
    stock = mocker.Mock(side_effect=lambda: _send_then(push, rpc_id=f"id{stock.call_count}")(client))
    pull = push.context.socket(zmq.PULL)
    timer = threading.Timer(0.35, lambda: pull.connect(f"ipc://{tmp_path}/req"))  # the peer comes up late
    timer.start()
    try:
        wrapper = p.sender(_run(), _Dead, zmq, rpc=True)
        assert asyncio.run(wrapper(stock, client, (), {})) == "sent"
        assert stock.call_count >= 2  # at least one try found no room
        assert pull.poll(5000) and pull.recv() == b"msg" and not pull.poll(200)
        # ids of the tries that could not send are gone; the one that went out stays (stock discards it later)
        assert client._pending_rpcs == {f"id{stock.call_count}"}
        assert push.getsockopt(zmq.SNDTIMEO) == -1  # the socket is left as stock had it
    finally:
        timer.join()
        pull.close(linger=0)


def test_resume_forwards_what_the_loop_sends_and_throws(zmq, push, tmp_path):
    """The part of the stock coroutine after its send runs as under ``await``: results and cancellation."""
    from omni_patches.patches import omni_stage_send_dead_engine as p

    pull = push.context.socket(zmq.PULL)
    pull.connect(f"ipc://{tmp_path}/req")
    assert push.poll(5000, zmq.POLLOUT)
    seen = []

    async def later():
        try:
            await asyncio.sleep(0.01)
            fut = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_later(0.01, fut.set_result, 42)
            value = await fut
            await asyncio.sleep(30)  # cancelled here
            return value
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    client = _Client(push)
    wrapper = p.sender(_run(), _Dead, zmq, rpc=False)

    async def main():
        task = asyncio.ensure_future(wrapper(lambda: _send_then(push, later)(client), client, (), {}))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert seen == ["cancelled"] and pull.recv() == b"msg"
    pull.close(linger=0)


@pytest.mark.parametrize("what", ["no-socket", "closed-socket", "no-flag", "no-manager"])
def test_unexpected_clients_run_the_stock_call(zmq, push, what, mocker):
    from omni_patches.patches import omni_stage_send_dead_engine as p

    run = _run()
    client = _Client(push)
    if what == "no-socket":
        client._request_socket = None
    elif what == "closed-socket":
        ctx = zmq.Context()
        client._request_socket = ctx.socket(zmq.PUSH)
        client._request_socket.close()
        ctx.term()
    elif what == "no-flag":
        del client._engine_dead
    else:
        del client._proc_manager

    async def stock(*args, **kwargs):
        return ("stock", args, kwargs)

    wrapped = mocker.Mock(side_effect=stock)
    for wrapper in (p.sender(run, _Dead, zmq, rpc=True), p.aborter(run, zmq)):
        assert asyncio.run(wrapper(wrapped, client, (1,), {"k": 2})) == ("stock", (1,), {"k": 2})
    assert wrapped.call_count == 2
    # one reason for both calls, noted once in status
    assert len(run.fallbacks) == 1 and list(run.notes.values()) == [f"ran the original code: {run.fallbacks[0]}"]


def test_stock_errors_propagate_and_the_socket_option_is_restored(zmq, push):
    from omni_patches.patches import omni_stage_send_dead_engine as p

    push.setsockopt(zmq.SNDTIMEO, 250)

    async def stock():
        raise RuntimeError("upstream's own failure")

    with pytest.raises(RuntimeError, match="upstream's own failure"):
        asyncio.run(p.sender(_run(), _Dead, zmq, rpc=False)(stock, _Client(push), (), {}))
    assert push.getsockopt(zmq.SNDTIMEO) == 250
