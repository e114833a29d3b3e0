"""Shared by the patches on vllm-omni's ``StageDiffusionClient`` request socket (not a patch itself).

vllm-omni 0.24.0rc1-0.30.0 bind the client's PUSH ``_request_socket`` and send on it with no flags; once the
diffusion subprocess is gone a send has no peer and never returns. 0.31.0rc1 sends every message with
``zmq.NOBLOCK``. Our patches get the same effect without editing upstream's code: while the stock method
runs its send, the socket's ``SNDTIMEO`` is 0, which libzmq treats exactly like ``ZMQ_DONTWAIT`` (no peer:
``zmq.Again`` at once), and the wrapper then does with ``zmq.Again`` what 0.31.0rc1 does.

Used by omni-stage-shutdown-nonblocking (``shutdown``) and omni-stage-send-dead-engine (``add_request_async``,
``abort_requests_async``, ``collective_rpc_async``). Nothing here imports zmq before the target did.
"""
import ast
import inspect
import logging
import textwrap
import types

_LOG = logging.getLogger("omni_patches")
# How a non-blocking send reads in a method's code (``co_names``): upstream's fix names one of these.
SEND_FIX = ("NOBLOCK", "DONTWAIT", "SNDTIMEO")


def send_names(ctx, path):
    """``co_names`` of the plain function at ``path`` in the target (drift if it is not one); fixed upstream
    (``ctx.fixed_upstream``) when it already sends without blocking: it names one of :data:`SEND_FIX`, as
    upstream's fix does."""
    fn = ctx.resolve(path)
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
        ctx.drift(f"{path} is not a plain function")
    names = set(code.co_names)
    found = sorted(names.intersection(SEND_FIX))
    if found:
        ctx.fixed_upstream(f"{path} already sends without blocking ({', '.join(found)})")
    return names


def request_socket_wiring(cls):
    """How ``cls`` sets up its ``_request_socket``: the subset of {"bind", "connect"} called right on it
    (``self._request_socket.bind(...)``) in its methods, read from their source (audit skeletons keep upstream's
    source and ``co_names``, not its bytecode). Empty when no method does either (e.g. a helper such as vLLM's
    ``make_zmq_socket`` builds the socket) or the source cannot be read."""
    seen = set()
    for code, fn in _method_codes(cls):
        if "_request_socket" not in code.co_names or not {"bind", "connect"} & set(code.co_names):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            func = getattr(node, "func", None) if isinstance(node, ast.Call) else None
            if (isinstance(func, ast.Attribute) and func.attr in ("bind", "connect")
                    and isinstance(func.value, ast.Attribute) and func.value.attr == "_request_socket"):
                seen.add(func.attr)
    return seen


def _method_codes(cls):
    """``(code, function)`` of every plain, class- or static method defined on ``cls`` itself."""
    found = []
    for value in vars(cls).values():
        fn = getattr(value, "__func__", value)
        code = getattr(fn, "__code__", None)
        if code is not None:
            found.append((code, fn))
    return found


def not_affected_unless_bound(ctx):
    """``ctx.not_affected`` where the client cannot hang on its request socket, decided by features: a client
    that runs the engine in-process (vllm-omni 0.18.0: no zmq in the module, no ``_request_socket``), or one
    that ``connect()``s its PUSH socket (0.20.0rc1-0.23.0rc1: for a dead peer the message is queued in the
    socket's pipe, up to the high-water mark, and the send returns). Only 0.24.0rc1+ bind it (no peer: no pipe:
    the send blocks). Anything else is left to the caller's drift checks."""
    cls = ctx.resolve("StageDiffusionClient")
    if not ctx.has("zmq") and not any("_request_socket" in code.co_names for code, _ in _method_codes(cls)):
        ctx.not_affected("StageDiffusionClient runs the diffusion engine in-process (no zmq, no _request_socket): "
                         "it predates the stage subprocess and its request socket (vllm-omni 0.20.0rc1; bound, "
                         "and able to block, from 0.24.0rc1)")
    if request_socket_wiring(cls) == {"connect"}:
        ctx.not_affected("StageDiffusionClient connect()s its PUSH _request_socket (vllm-omni 0.20.0rc1-0.23.0rc1 "
                         "layout): a message for a dead peer is queued and the send returns; the bound socket "
                         "whose send blocks came in 0.24.0rc1")


def nonblocking(sock, patch_id):
    """Make every send on ``sock`` non-blocking; return the previous SNDTIMEO, or None if left untouched
    (no socket, a closed one, not a zmq socket: the caller then runs the stock code as it is)."""
    if sock is None or getattr(sock, "closed", True):
        return None
    try:
        import zmq  # the target imported it already

        previous = sock.getsockopt(zmq.SNDTIMEO)
        sock.setsockopt(zmq.SNDTIMEO, 0)
    except Exception as exc:  # never fail the host's call for our own reasons
        _LOG.debug("%s: request socket left as is (%s: %s)", patch_id, type(exc).__name__, exc)
        return None
    return previous


def restore(sock, previous):
    """Put back the SNDTIMEO that :func:`nonblocking` returned (a closed socket is left alone)."""
    try:
        if not sock.closed:
            import zmq

            sock.setsockopt(zmq.SNDTIMEO, previous)
    except Exception:
        pass


@types.coroutine
def resume(coro, pending):
    """Run the rest of ``coro``, whose first step already ran and yielded ``pending``, exactly as ``await``
    would: what the event loop sends or throws goes to ``coro``; closing this closes ``coro``."""
    try:
        while True:
            try:
                sent = yield pending
            except GeneratorExit:
                raise
            except BaseException as exc:  # cancellation and the like belong to the stock coroutine
                pending = coro.throw(exc)
            else:
                pending = coro.send(sent)
    except StopIteration as done:
        return done.value
    finally:
        coro.close()
