"""omni-stagepool-cancelled-submit: abort an AR stage request whose submission failed or was cancelled after EngineCore took it

Why:         StagePool.submit_initial adds an AR (LLM) stage's request to EngineCore and, when that call fails,
             only drops the replica binding and the output-processor state (``except Exception``); a cancelled
             submission (asyncio.CancelledError, a BaseException) is not handled at all. A request the engine
             already accepted is never aborted: it runs to the end holding KV cache and a scheduler slot.
Upstream:    https://pypi.org/project/vllm-omni/0.32.0rc1/ (vllm_omni/engine/stage_pool.py
             ``StagePool.submit_initial``: on any failure of the add, ``except BaseException``, it first awaits
             ``self.abort_requests([request_id])``; no upstream PR or issue found, see docs/patches.md)
Affected:    vllm-omni >=0.21.0rc1,<0.32.0rc1; fixed upstream in vllm-omni 0.32.0rc1 (also found by feature:
             submit_initial calls abort_requests). 0.20.0 has the same rollback but adds through
             ``self.clients[replica_id]``, with no ``_llm_client`` to guard (not covered; drifted as a source
             build); 0.20.0rc1 and older have no StagePool.
How:         submit_initial is wrapped (wrapt) for non-diffusion stages: during the stock call a context
             variable makes StagePool._llm_client hand out, once, a guard whose add_request_async does what
             0.32.0rc1 does when the add raises anything: await the pool's abort_requests (the binding still
             routes it); on success release the binding and roll the output processor back; on failure
             (Exception, CancelledError) log and keep both for the owner's cleanup; re-raise the add's error.
             Stock's ``except Exception`` rollback is skipped for it (a private BaseException carries it out).
             A client without add_request_async: stock, noted once in status.
Remove when: the oldest supported vllm-omni is 0.32.0rc1 or later.
"""
import asyncio
import contextvars
import functools
import logging

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    "requires": {"vllm-omni": ">=0.21.0rc1,<0.32.0rc1"},
    "fixed_in": {"vllm-omni": "0.32.0rc1"},
    "targets": ["vllm_omni.engine.stage_pool"],
}

PATCH_ID = "omni-stagepool-cancelled-submit"
_LOG = logging.getLogger("omni_patches")
_CO_COROUTINE = 0x80
#: The submit_initial call of this task: set by the submit_initial wrapper, read by the _llm_client wrapper.
_SUBMITTING = contextvars.ContextVar("omni_stagepool_cancelled_submit", default=None)


def check(ctx):
    submit = ctx.resolve("StagePool.submit_initial")
    names = set(getattr(getattr(submit, "__code__", None), "co_names", ()))
    if "abort_requests" in names:
        ctx.fixed_upstream("StagePool.submit_initial aborts a rejected submission (abort_requests, 0.32.0rc1+)")
    if not submit.__code__.co_flags & _CO_COROUTINE:
        ctx.drift("StagePool.submit_initial is no longer a coroutine function")
    if "_llm_client" not in names:
        ctx.drift("StagePool.submit_initial does not add through self._llm_client (the vllm-omni 0.20.0 layout "
                  "adds through self.clients[replica_id]): the same missing abort, with nothing this patch can guard")
    missing = {"add_request_async", "release_binding", "output_processor", "Exception"} - names
    if missing or "BaseException" in names:
        ctx.drift("StagePool.submit_initial no longer rolls a failed add back with except Exception "
                  f"(missing: {sorted(missing) or 'none'}; BaseException: {'BaseException' in names})")
    ctx.require_params(submit, "request_id")
    for name in ("_llm_client", "abort_requests", "release_binding"):
        ctx.resolve(f"StagePool.{name}")
    ctx.describe("StagePool.submit_initial: an AR add that fails or is cancelled is rolled back without an abort "
                 "(0.21.0rc1-0.31.0rc1 layout)")


def apply(ctx):
    logger = getattr(ctx.module, "logger", None)
    if not callable(getattr(logger, "warning", None)):
        logger = _LOG
    ctx.wrap("StagePool", "submit_initial", _submit_initial)
    ctx.wrap("StagePool", "_llm_client", functools.partial(_llm_client, ctx.run, logger))


class _Submission:
    """One stock submit_initial call: which pool, which request, and whether its add was guarded yet."""

    __slots__ = ("pool", "request_id", "guarded")

    def __init__(self, pool, request_id):
        self.pool, self.request_id, self.guarded = pool, request_id, False


class _Handled(BaseException):
    """Carries a submission error the guard already handled past stock's ``except Exception`` rollback (which
    would drop what 0.32.0rc1 keeps after a failed abort, or roll back twice); the wrapper raises ``error``."""

    def __init__(self, error):
        super().__init__(error)
        self.error = error


async def _submit_initial(wrapped, instance, args, kwargs):
    try:
        diffusion = instance.stage_type == "diffusion"
    except Exception:  # stock reads it too, after its own first steps: let stock fail where and as it does
        diffusion = True
    if diffusion:  # 0.32.0rc1 leaves the diffusion branch as it was
        return await wrapped(*args, **kwargs)
    request_id = args[0] if args else kwargs.get("request_id")
    token = _SUBMITTING.set(_Submission(instance, request_id))
    try:
        return await wrapped(*args, **kwargs)
    except _Handled as handled:
        error = handled.error
    finally:
        _SUBMITTING.reset(token)
    raise error  # outside the handler: the error keeps its own context and traceback


def _llm_client(run, logger, wrapped, instance, args, kwargs):
    client = wrapped(*args, **kwargs)
    submission = _SUBMITTING.get()
    if submission is None or submission.pool is not instance or submission.guarded:
        return client  # not the add of a submit_initial (submit_update, polls, a task it spawned): stock
    submission.guarded = True
    if not callable(getattr(client, "add_request_async", None)):
        run.fallback("the stage client has no add_request_async")
        return client
    return _GuardedClient(client, submission, run, logger)


class _GuardedClient:
    """The replica's client as submit_initial's add sees it: add_request_async guarded, the rest the client's."""

    def __init__(self, client, submission, run, logger):
        self._client, self._submission, self._run, self._logger = client, submission, run, logger

    def __getattr__(self, name):
        return getattr(self._client, name)

    async def add_request_async(self, *args, **kwargs):
        try:
            return await self._client.add_request_async(*args, **kwargs)
        except BaseException as exc:  # 0.32.0rc1: a failed or cancelled send may follow the engine's accept
            error = exc
        await _abort_rejected(self._submission, error, self._run, self._logger)
        if isinstance(error, Exception):
            raise _Handled(error)
        raise error  # stock has no handler for a BaseException: it leaves submit_initial as it is


async def _abort_rejected(submission, error, run, logger):
    """0.32.0rc1's handling of a rejected submission: abort while the binding routes it, then roll back."""
    pool, request_id = submission.pool, submission.request_id
    try:
        await pool.abort_requests([request_id])
    except (Exception, asyncio.CancelledError) as abort_error:
        # Binding and processor state stay for the owner's cleanup; the submission error is what propagates.
        logger.warning("[StagePool] Failed to abort rejected submission for req=%s stage-%s: %r",
                       request_id, getattr(pool, "stage_id", None), abort_error)
        _report(run, "abort-failed", "rejected submission(s) whose abort failed too (binding kept)")
        return
    pool.release_binding(request_id)
    rollback = getattr(pool.output_processor, "remove_request", None)
    if callable(rollback):
        try:
            rollback(request_id)
        except Exception as rollback_error:
            logger.warning("[StagePool] Failed to rollback output processor state for req=%s stage-%s: %s",
                           request_id, getattr(pool, "stage_id", None), rollback_error)
    kind = "cancelled" if isinstance(error, asyncio.CancelledError) else "failed"
    _report(run, kind, f"{kind} submission(s) aborted in EngineCore")


def _report(run, key, text):
    run.tally(key, "{n} " + text, log=f"first {text}")
