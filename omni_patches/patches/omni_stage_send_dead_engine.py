"""omni-stage-send-dead-engine: raise EngineDeadError instead of hanging when a diffusion stage's subprocess is gone

Why:         StageDiffusionClient.add_request_async, abort_requests_async and collective_rpc_async send on the
             PUSH _request_socket the client binds, with a blocking send. When the StageDiffusionProc dies
             before the client's monitor thread marks the engine dead, the send never returns: request
             submission, aborts, sleep / wake_up and LoRA RPCs hang the orchestrator's event loop instead of
             failing with EngineDeadError.
Upstream:    https://github.com/vllm-project/vllm-omni/issues/7810 and
             https://github.com/vllm-project/vllm-omni/pull/7812 (released in 0.31.0rc1 together with the
             shutdown fix: one ``_send_request`` helper sends with ``zmq.NOBLOCK``)
Affected:    vllm-omni >=0.24.0rc1,<0.31.0rc1; fixed upstream in vllm-omni 0.31.0rc1 (also found by feature:
             a ``_send_request`` method, or one of the three sending with NOBLOCK / DONTWAIT / SNDTIMEO).
             Before 0.24.0rc1 the client connect()s that socket (no hang); an untagged build is told apart by
             that feature ("not affected").
How:         the three coroutine methods are wrapped (wrapt). The stock coroutine's first step, which holds
             its send, runs with SNDTIMEO=0 on the request socket; only its ``zmq.Again`` is handled, as
             0.31.0rc1 does: dead process -> ``_engine_dead = True`` and ``EngineDeadError()``; live process
             -> wait for POLLOUT (100 ms) and run the stock method again; abort -> skipped while
             ``_engine_dead``, dropped on ``zmq.Again``; an RPC id registered for an unsent request is
             discarded. The rest of the coroutine is driven as ``await`` would. A client without an open zmq
             request socket, ``_engine_dead`` or ``_proc_manager`` runs stock (noted once in status). Shared
             helpers: omni_patches/patches/_stage_client.py.
Remove when: the oldest supported vllm-omni is 0.31.0rc1 or later.
"""

from . import _stage_client as sc

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    "requires": {"vllm-omni": ">=0.24.0rc1,<0.31.0rc1"},
    "fixed_in": {"vllm-omni": "0.31.0rc1"},
    "targets": ["vllm_omni.diffusion.stage_diffusion_client"],
}

PATCH_ID = "omni-stage-send-dead-engine"
_METHODS = ("add_request_async", "abort_requests_async", "collective_rpc_async")
_RETRY_POLL_MS = 100  # upstream's wait for POLLOUT between two tries while the process lives


def check(ctx):
    if ctx.has("StageDiffusionClient._send_request"):
        ctx.fixed_upstream("StageDiffusionClient sends through _send_request (0.31.0rc1+)")
    sc.not_affected_unless_bound(ctx)  # in-process (0.18.0) or connect()ed (0.20.0rc1-0.23.0rc1): never blocks
    for name in _METHODS:
        names = sc.send_names(ctx, f"StageDiffusionClient.{name}")
        if not {"_request_socket", "send"} <= names:
            ctx.drift(f"StageDiffusionClient.{name} no longer sends on self._request_socket")
        if not ctx.resolve(f"StageDiffusionClient.{name}").__code__.co_flags & 0x80:  # CO_COROUTINE
            ctx.drift(f"StageDiffusionClient.{name} is no longer a coroutine function")
    for name in ("EngineDeadError", "zmq"):
        if not ctx.has(name):
            ctx.drift(f"{ctx.target} no longer imports {name}")
    ctx.describe("StageDiffusionClient.add_request_async / abort_requests_async / collective_rpc_async: blocking "
                 "sends on the bound PUSH _request_socket (0.24.0rc1-0.30.0 layout)")


def apply(ctx):
    dead_error, zmq = ctx.module.EngineDeadError, ctx.module.zmq
    ctx.wrap("StageDiffusionClient", "add_request_async", sender(ctx.run, dead_error, zmq, rpc=False))
    ctx.wrap("StageDiffusionClient", "collective_rpc_async", sender(ctx.run, dead_error, zmq, rpc=True))
    ctx.wrap("StageDiffusionClient", "abort_requests_async", aborter(ctx.run, zmq))


def _unexpected(client):
    """Why ``client`` is not what the wrappers were built for (None: it is)."""
    if getattr(client, "_engine_dead", None) not in (True, False):
        return "the client has no _engine_dead flag"
    if not hasattr(client, "_proc_manager"):
        return "the client has no _proc_manager"
    sock = getattr(client, "_request_socket", None)
    if sock is None or getattr(sock, "closed", True):
        return "the client has no open zmq request socket"
    return None


def _first_step(client, wrapped, args, kwargs):
    """Create the stock coroutine and run its first step (the send) without blocking.

    Returns ``(coroutine, what it yielded)`` to resume, or ``(None, return value)`` if it finished; raises
    what the step raised (``zmq.Again``: the send found no room). ``None`` when the socket cannot be set:
    the caller runs stock."""
    sock = client._request_socket
    previous = sc.nonblocking(sock, PATCH_ID)
    if previous is None:
        return None
    coro = wrapped(*args, **kwargs)
    try:
        return coro, coro.send(None)
    except StopIteration as done:
        return None, done.value
    finally:
        sc.restore(sock, previous)


def sender(run, dead_error, zmq, *, rpc):
    """Wrapper for the methods 0.31.0rc1 sends through ``_send_request`` (add_request_async, collective_rpc_async)."""

    async def send_or_raise(wrapped, instance, args, kwargs):
        why = _unexpected(instance)
        if why is not None:
            run.fallback(why)
            return await wrapped(*args, **kwargs)
        while True:
            pending = set(getattr(instance, "_pending_rpcs", ())) if rpc else None
            try:
                step = _first_step(instance, wrapped, args, kwargs)
            except zmq.Again:
                if rpc:  # the stock method registered its RPC id before the send; 0.31.0rc1 only after it
                    instance._pending_rpcs.difference_update(set(instance._pending_rpcs) - pending)
                manager = instance._proc_manager
                if manager is not None and not manager.proc.is_alive():
                    instance._engine_dead = True
                    _report(run, instance, "send")
                    raise dead_error() from None
                instance._request_socket.poll(_RETRY_POLL_MS, zmq.POLLOUT)
                continue
            if step is None:  # the option could not be set: run stock as it is
                run.fallback("the request socket's send timeout cannot be set")
                return await wrapped(*args, **kwargs)
            coro, value = step
            return value if coro is None else await sc.resume(coro, value)

    return send_or_raise


def aborter(run, zmq):
    async def abort_or_drop(wrapped, instance, args, kwargs):
        why = _unexpected(instance)
        if why is not None:
            run.fallback(why)
            return await wrapped(*args, **kwargs)
        if instance._engine_dead:  # 0.31.0rc1: nothing to abort on a dead engine
            return None
        try:
            step = _first_step(instance, wrapped, args, kwargs)
        except zmq.Again:
            _report(run, instance, "abort")
            return None
        if step is None:
            run.fallback("the request socket's send timeout cannot be set")
            return await wrapped(*args, **kwargs)
        coro, value = step
        return value if coro is None else await sc.resume(coro, value)

    return abort_or_drop


def _report(run, client, kind):
    """Count what would have hung in stock (status note; logged once per kind)."""
    text = {"send": "EngineDeadError instead of a blocking send: {n} call(s) whose diffusion subprocess was gone",
            "abort": "abort dropped instead of blocking: {n} call(s) that found no peer"}[kind]
    where = f"stage-{getattr(client, 'stage_id', '?')} replica-{getattr(client, 'replica_id', '?')}"
    run.tally(kind, text, log=f"{where}: {text.format(n=1)}")
