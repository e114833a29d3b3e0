"""omni-stage-shutdown-nonblocking: never block a diffusion stage client's shutdown on a dead subprocess

Why:         when a StageDiffusionProc dies (SIGKILL, OOM kill, segfault), StageDiffusionClient.shutdown()
             first sends "shutdown" with a blocking send on a PUSH socket the client *binds*, whose only peer
             was that subprocess: the send never returns. The orchestrator loop hangs while it evicts the dead
             replica (0.27.0rc1+: control RPCs such as AsyncOmni.sleep() never complete), and so does engine
             shutdown (0.26.0rc1+ logs "Orchestrator did not stop within 30.0 seconds"; the server never exits).
Upstream:    https://github.com/vllm-project/vllm-omni/issues/7810 and
             https://github.com/vllm-project/vllm-omni/pull/7812 (the send gets ``flags=zmq.NOBLOCK``; the
             ``zmq.Again`` raised without a peer is swallowed by the ``except Exception: pass`` already there)
Affected:    vllm-omni >=0.24.0rc1,<0.31.0rc1; fixed upstream in vllm-omni 0.31.0rc1 (also found by feature:
             a shutdown() that names NOBLOCK / DONTWAIT / SNDTIMEO). Before 0.24.0rc1 the client connect()s
             that socket and never hangs; a build without version metadata is told apart by that feature.
How:         StageDiffusionClient.shutdown is wrapped (wrapt). Before the stock method runs, the client's
             request socket gets SNDTIMEO=0 (libzmq's exact equivalent of ZMQ_DONTWAIT): with no peer the
             stock send raises zmq.Again, which upstream's own ``except`` swallows, and the stock method goes
             on to stop the process manager and close the sockets and the context. A live peer still gets
             the message; a dropped one is logged once per client and noted in status. If the option cannot
             be set the stock call runs as is. Helpers: omni_patches/patches/_stage_client.py.
Remove when: the oldest supported vllm-omni is 0.31.0rc1 or later.
"""
import functools
import logging

from . import _stage_client as sc

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    "requires": {"vllm-omni": ">=0.24.0rc1,<0.31.0rc1"},
    "fixed_in": {"vllm-omni": "0.31.0rc1"},
    "targets": ["vllm_omni.diffusion.stage_diffusion_client"],
}

PATCH_ID = "omni-stage-shutdown-nonblocking"
_LOG = logging.getLogger("omni_patches")


def check(ctx):
    names = sc.send_names(ctx, "StageDiffusionClient.shutdown")
    sc.not_affected_unless_bound(ctx)  # in-process (0.18.0) or connect()ed (0.20.0rc1-0.23.0rc1): never blocks
    if not {"_request_socket", "send"} <= names:
        ctx.drift("StageDiffusionClient.shutdown no longer sends on self._request_socket")
    ctx.describe("StageDiffusionClient.shutdown: the shutdown message on the bound PUSH _request_socket "
                 "(0.24.0rc1-0.30.0 layout)")


def apply(ctx):
    ctx.wrap("StageDiffusionClient", "shutdown", functools.partial(shutdown, ctx.run))


def _nonblocking(run, client, sock):
    """Make every send on ``sock`` non-blocking; return the previous SNDTIMEO, or None if untouched."""
    previous = sc.nonblocking(sock, PATCH_ID)
    if previous is not None:
        import zmq

        _report_dead_peer(run, client, sock, zmq)
    return previous


def _report_dead_peer(run, client, sock, zmq):
    """Say so when the stock send is about to find no peer (it would have blocked forever)."""
    try:
        if sock.poll(0, zmq.POLLOUT):
            return
        run.tally("dropped", "shutdown message dropped instead of blocking: {n} client(s) whose diffusion "
                  "subprocess was gone")
        _LOG.info("%s: stage-%s replica-%s: no peer takes the shutdown message (subprocess gone); dropped "
                  "instead of blocking", PATCH_ID, getattr(client, "stage_id", "?"), getattr(client, "replica_id", "?"))
    except Exception:
        pass


def shutdown(run, wrapped, instance, args, kwargs):
    sock = getattr(instance, "_request_socket", None)
    previous = _nonblocking(run, instance, sock)
    if previous is None:  # e.g. a second shutdown(): stock's send fails on the closed socket and goes on
        run.fallback("the client has no open zmq request socket")
        return wrapped(*args, **kwargs)
    try:
        return wrapped(*args, **kwargs)
    finally:
        sc.restore(sock, previous)
