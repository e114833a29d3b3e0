"""omni-diffusion-sleep-wake-errors: raise when a diffusion stage reports a failed sleep or wake_up

Why:         AsyncOmni.sleep() / wake_up() never read what a diffusion stage answers. A worker that fails
             (a wake_up while a colocated trainer still holds the GPU: CUDA out of memory) reports
             OmniACK(status="ERROR"); wake_up() returns it like a success and reopens admission, and the next
             request dies far away ("Pointer argument cannot be accessed from Triton (cpu tensor?)"). A failed
             sleep is committed the same way.
Upstream:    https://github.com/vllm-project/vllm-omni/issues/7809 and
             https://github.com/vllm-project/vllm-omni/pull/7811 (0.31.0rc1: ``_raise_on_diffusion_errors``
             raises ``RuntimeError("handle_sleep_task failed: ...")`` / ``("handle_wake_task failed: ...")``;
             what succeeded is on record first)
Affected:    vllm-omni >=0.28.0rc1,<0.31.0rc1; fixed upstream in vllm-omni 0.31.0rc1 (also found by feature:
             an AsyncOmni that has _raise_on_diffusion_errors); 0.28.0rc1 keeps one engine-wide sleep record.
             0.20.0rc1-0.27.x ignore the ACKs inline in sleep() / wake_up() (not covered: drifted, with that
             reason); 0.18.0 and older have no ACK protocol: "not affected".
How:         AsyncOmni._sleep_diffusion / _wake_diffusion are wrapped (wrapt); the stock methods run
             unchanged and their ACKs are read as 0.31.0rc1 reads them (raise; what failed stays on record, so
             wake_up still reaches it; sleep / wake_up record or clear the AR stages on that failure). The API
             server's POST /v1/omni/sleep and /v1/omni/wakeup route endpoints are wrapped as 0.31.0rc1 writes
             them: a failure is a 500 "Failed to sleep: ..." / "Failed to wake up: ...", a failed sleep still
             lists the stages it left on record (else wakeup answers SKIPPED and admission stays closed), and
             an empty stage_ids or a negative level is a 400. Details: docs/patches.md.
Remove when: the oldest supported vllm-omni is 0.31.0rc1 or later.
"""
import contextvars
import functools
import logging

from ._routes import post_routes

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    "requires": {"vllm-omni": ">=0.28.0rc1,<0.31.0rc1"},
    "fixed_in": {"vllm-omni": "0.31.0rc1"},
    "targets": ["vllm_omni.entrypoints.async_omni", "vllm_omni.entrypoints.openai.api_server"],
}


PATCH_ID = "omni-diffusion-sleep-wake-errors"
_SLEEP_TAGS = ("weights", "kv_cache")  # CuMemTag.WEIGHTS / KV_CACHE values, what sleep() records
_NEEDS = ("sleep", "wake_up", "_sleep_diffusion", "_wake_diffusion", "_split_stage_ids_by_type")
# What the wrapped public call learned from the diffusion helpers (same task: contextvars follow the awaits).
_CALL = contextvars.ContextVar("omni_patches_sleep_wake_call", default=None)


API_SERVER = "vllm_omni.entrypoints.openai.api_server"
# route path -> the module-level handler its route was made from
_ROUTES = {"/v1/omni/sleep": "omni_sleep", "/v1/omni/wakeup": "omni_wakeup"}


def check(ctx):
    if ctx.target == API_SERVER:
        return _check_api(ctx)
    if ctx.has("AsyncOmni._raise_on_diffusion_errors") or ctx.has("AsyncOmni._diffusion_ack_error"):
        ctx.fixed_upstream("AsyncOmni raises on failed diffusion ACKs (_raise_on_diffusion_errors, 0.31.0rc1+)")
    _older_layouts(ctx)
    for name in _NEEDS:
        ctx.resolve(f"AsyncOmni.{name}")
    ctx.require_params(ctx.resolve("AsyncOmni._sleep_diffusion"), "stage_ids", "level")
    ctx.require_params(ctx.resolve("AsyncOmni._wake_diffusion"), "stage_ids", "requested_tags")
    ctx.require_params(ctx.resolve("AsyncOmni.sleep"), "stage_ids", "level")
    ctx.require_params(ctx.resolve("AsyncOmni.wake_up"), "stage_ids", "tags")
    for name in ("_sleep_diffusion", "_wake_diffusion"):
        code = ctx.resolve(f"AsyncOmni.{name}").__code__
        if not {"collective_rpc", "event_resolver"} <= set(code.co_names):
            ctx.drift(f"AsyncOmni.{name} no longer resolves the collective_rpc ACKs itself")
    if ctx.has("AsyncOmni._record_stage_sleep"):
        ctx.resolve("AsyncOmni._clear_stage_sleep")
        record = "per-stage sleep record (0.28.0-0.30.0 layout)"
    else:
        record = "one engine-wide sleep record (0.28.0rc1 layout)"
    ctx.describe(f"AsyncOmni._sleep_diffusion / _wake_diffusion: ACKs returned unread, {record}")


def _older_layouts(ctx):
    """Decided by features, for builds without version metadata: before the ACK protocol there is no ERROR ACK
    to ignore (not affected); 0.20.0rc1-0.27.x ignore them too, in a layout this patch does not cover (drift,
    said plainly: the bug is there)."""
    if ctx.has("AsyncOmni._sleep_diffusion"):
        if not ctx.has("AsyncOmni._record_stage_sleep"):
            for name in ("sleep", "wake_up"):
                code = getattr(ctx.resolve(f"AsyncOmni.{name}"), "__code__", None)
                if "_sleeping_tags" not in getattr(code, "co_names", ()):
                    ctx.drift(f"AsyncOmni.{name} keeps neither a per-stage sleep record (_record_stage_sleep) "
                              "nor the engine-wide _sleeping_tags of 0.28.0rc1")
        return
    sleep = getattr(getattr(ctx.resolve("AsyncOmni.sleep"), "__code__", None), "co_names", ())
    if not ({"OmniSleepTask", "event_resolver"} & set(sleep)) and not ctx.has("OmniSleepTask") \
            and not ctx.has("OmniACK"):
        ctx.not_affected("AsyncOmni.sleep sends no OmniSleepTask and resolves no ACKs (no OmniACK, OmniSleepTask, "
                         "_sleep_diffusion): it predates the sleep ACK protocol (vllm-omni 0.20.0rc1) whose ERROR "
                         "ACKs the bug ignores")
    ctx.drift("AsyncOmni has no _sleep_diffusion (in the vllm-omni 0.20.0rc1-0.27.x layout sleep / wake_up resolve "
              "every stage's ACKs inline; ERROR ACKs are ignored there too, but this patch covers the "
              "0.28.0-0.30.0 layout only)")


def apply(ctx):
    if ctx.target == API_SERVER:
        return _apply_api(ctx)
    ctx.wrap("AsyncOmni", "_sleep_diffusion", functools.partial(_sleep_diffusion, ctx.run))
    ctx.wrap("AsyncOmni", "_wake_diffusion", functools.partial(_wake_diffusion, ctx.run))
    ctx.wrap("AsyncOmni", "sleep", _sleep)
    ctx.wrap("AsyncOmni", "wake_up", _wake_up)


# -- reading ACKs as 0.31.0rc1 does ---------------------------------------------------------------------------
def ack_error(ack):
    """The failure a diffusion stage's answer reports, or None: OmniACK (in-process), its dict form (subprocess),
    a subprocess RPC error ``{"error": True, "reason": ...}``, StagePool's ``{"supported": False, "error": ...}``."""
    if isinstance(ack, dict):
        status, message, failed = ack.get("status"), ack.get("error_msg"), ack.get("error")
        if failed is True:
            failed = ack.get("reason") or "RPC failed"
        if not failed and (ack.get("todo") or ack.get("supported") is False):
            failed = str(ack)
    else:
        status, message, failed = getattr(ack, "status", None), getattr(ack, "error_msg", None), None
    if status == "ERROR":
        return message or "worker reported ERROR"
    return failed


def _failure(method, acks):
    errors = [e for e in (ack_error(a) for a in acks) if e]
    return RuntimeError(f"{method} failed: {'; '.join(errors)}") if errors else None


def _arg(args, kwargs, index, name, default=None):
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


_UNKNOWN = "a diffusion stage answered with something that is neither an ACK nor a dict"


def _acks_ok(acks):
    """What the wrapper was built for: a list of OmniACKs, their dict forms or StagePool's / RPC error dicts."""
    return isinstance(acks, list) and all(isinstance(a, dict) or hasattr(a, "status") for a in acks)


# -- the diffusion helpers -------------------------------------------------------------------------------------
async def _sleep_diffusion(run, wrapped, instance, args, kwargs):
    stage_ids, level = _arg(args, kwargs, 0, "stage_ids"), _arg(args, kwargs, 1, "level")
    call = _CALL.get()
    try:
        acks = await wrapped(*args, **kwargs)
    except BaseException:
        # 0.31.0rc1: a failed sleep may have released part of a stage, so wake_up must still reach it.
        _record(instance, stage_ids)
        if call is not None:
            call["diffusion_failed"] = True
        raise
    if not _acks_ok(acks):
        run.fallback(_UNKNOWN)
        return acks
    if call is not None:
        call["diffusion_acks"] = acks
    error = _failure("handle_sleep_task", acks)
    if error is None:
        return acks
    _record(instance, stage_ids)
    if level == 2 and any(ack_error(a) is None for a in acks):  # weights discarded where a replica finished
        instance._level2_sleeping = True
    if call is not None:
        call["diffusion_failed"] = True
    _report(run, "sleep", error)
    raise error


async def _wake_diffusion(run, wrapped, instance, args, kwargs):
    stage_ids, tags = _arg(args, kwargs, 0, "stage_ids"), _arg(args, kwargs, 1, "requested_tags")
    call = _CALL.get()
    if call is None:  # called on its own: one RPC for the given stages, as upstream's helper does
        acks = await wrapped(*args, **kwargs)
        if not _acks_ok(acks):
            run.fallback(_UNKNOWN)
            return acks
        error = _failure("handle_wake_task", acks)
        if error is not None:
            _report(run, "wake_up", error)
            raise error
        return acks
    # From wake_up: one stage at a time, each cleared once awake (0.31.0rc1's loop).
    call["tags"] = tags
    woken = []
    for sid in list(stage_ids):
        acks = await wrapped([sid], tags)
        if not _acks_ok(acks):  # stock's reading: whatever came back is returned (wake_up clears every stage)
            run.fallback(_UNKNOWN)
            woken.extend(acks)
            continue
        error = _failure("handle_wake_task", acks)
        if error is not None:
            call["diffusion_failed"] = True
            _report(run, "wake_up", error)
            raise error
        _clear(instance, [sid], tags)
        woken.extend(acks)
    return woken


# -- the public calls: what 0.31.0rc1 has on record before a diffusion failure ----------------------------
async def _sleep(wrapped, instance, args, kwargs):
    call = {}
    token = _CALL.set(call)
    had_level2 = instance.__dict__.get("_level2_sleeping", _MISSING)
    try:
        result = await wrapped(*args, **kwargs)
    except BaseException:
        if call.get("diffusion_failed"):
            ar = _ar_stages(instance, args, kwargs)
            if ar:  # their EngineCore sleep had succeeded
                _record(instance, ar)
                if _arg(args, kwargs, 1, "level", 2) == 2:
                    instance._level2_sleeping = True
        raise
    finally:
        _CALL.reset(token)
    # 0.31.0rc1 sets the level-2 flag for AR stages and where a diffusion replica finished; stock always.
    acks = call.get("diffusion_acks")
    if (acks is not None and not acks and _arg(args, kwargs, 1, "level", 2) == 2
            and not _ar_stages(instance, args, kwargs)):
        if had_level2 is _MISSING:
            instance.__dict__.pop("_level2_sleeping", None)
        else:
            instance._level2_sleeping = had_level2
    return result


async def _wake_up(wrapped, instance, args, kwargs):
    call = {}
    token = _CALL.set(call)
    try:
        return await wrapped(*args, **kwargs)
    except BaseException:
        if call.get("diffusion_failed"):
            ar = _ar_stages(instance, args, kwargs)
            if ar:  # their EngineCore wake_up had succeeded
                _clear(instance, ar, call.get("tags") or [])
        raise
    finally:
        _CALL.reset(token)


_MISSING = object()


def _record(instance, stage_ids):
    """Put ``stage_ids`` on the sleep record as 0.31.0rc1 does: 0.28.0-0.30.0 keep one per stage; 0.28.0rc1 keeps
    one engine-wide set of tags, which its sleep() fills the same way after a success."""
    record = getattr(instance, "_record_stage_sleep", None)
    if record is not None:
        record(list(stage_ids), _SLEEP_TAGS)
    else:
        tags = getattr(instance, "_sleeping_tags", None)
        if not isinstance(tags, set):
            tags = instance._sleeping_tags = set()
        tags.update(_SLEEP_TAGS)


def _clear(instance, stage_ids, tags):
    """Take ``stage_ids`` off the record once awake. 0.28.0rc1's one engine-wide record cannot say which stage
    woke: it stays until stock wake_up has woken every stage and clears it (a retry wakes them all again)."""
    clear = getattr(instance, "_clear_stage_sleep", None)
    if clear is not None:
        clear(list(stage_ids), tags)


def _ar_stages(instance, args, kwargs):
    try:
        return list(instance._split_stage_ids_by_type(_arg(args, kwargs, 0, "stage_ids"))[0])
    except Exception:
        return []


def _report(run, kind, error):
    run.tally(kind, f"{kind}: {{n}} diffusion failure(s) raised instead of reported as success",
              log=f"{error} (stock would have returned it as a success)", level=logging.WARNING)


# -- the API server's /v1/omni/sleep and /v1/omni/wakeup: what 0.31.0rc1's handlers add -------------------------
def _check_api(ctx):
    sleep, wakeup = ctx.resolve("omni_sleep"), ctx.resolve("omni_wakeup")
    if "Failed to sleep: " in getattr(getattr(sleep, "__code__", None), "co_consts", ()):
        ctx.fixed_upstream("omni_sleep maps a failed sleep to 'Failed to sleep: ...' itself (0.31.0rc1+)")
    for func in (sleep, wakeup):
        ctx.require_params(func, "request", "raw_request")
    for func, calls in ((sleep, {"sleep", "sleeping_stages"}), (wakeup, {"wake_up", "sleeping_stages"})):
        if not calls <= set(getattr(getattr(func, "__code__", None), "co_names", ())):
            ctx.drift(f"{func.__name__} no longer calls the engine's {sorted(calls)[0]} itself or keeps "
                      "app.state.sleeping_stages")
    ctx.resolve("HTTPException")
    ctx.describe("api_server omni_sleep / omni_wakeup: engine errors unmapped, a failed sleep left out of "
                 "app.state.sleeping_stages (0.28.0-0.30.0 layout)")


def _apply_api(ctx):
    """Wrap the endpoints of the router's two routes (``_routes``: FastAPI calls ``route.endpoint``, not the
    module-level functions)."""
    found = post_routes(ctx, _ROUTES)
    if found is None:
        return None
    http_error = ctx.resolve("HTTPException")
    ctx.wrap(found["omni_sleep"], "endpoint", functools.partial(_omni_sleep, ctx.run, http_error))
    ctx.wrap(found["omni_wakeup"], "endpoint", functools.partial(_omni_wakeup, ctx.run, http_error))


API_UNKNOWN = "an omni sleep / wakeup request or app state of a shape the wrapper was not built for"


def _api_call(args, kwargs):
    """``(request, app.state)`` of a handler call, or None when it is not what 0.28.0-0.30.0 pass (a pydantic
    request with a ``stage_ids`` list, an app state with its ``sleeping_stages`` set)."""
    request, raw = _arg(args, kwargs, 0, "request"), _arg(args, kwargs, 1, "raw_request")
    state = getattr(getattr(raw, "app", None), "state", None)
    if not isinstance(getattr(request, "stage_ids", None), list) or not hasattr(type(request), "model_fields") \
            or state is None or not isinstance(getattr(state, "sleeping_stages", None), set):
        return None
    return request, state


def _validate(run, request):
    """0.31.0rc1's request models: ``stage_ids`` with at least one item, ``level`` >= 0 -- a 400 (FastAPI's
    RequestValidationError, answered by the server's own handler) before anything is paused. A request model this
    cannot tighten is left as stock takes it."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import Field, ValidationError, create_model

    try:
        fields = {"stage_ids": (list[int], Field(..., min_length=1))}
        if "level" in type(request).model_fields:
            fields["level"] = (int, Field(default=2, ge=0))
        strict = create_model(type(request).__name__, __base__=type(request), **fields)
        body = request.model_dump()
    except Exception:
        run.fallback("a request model 0.31.0rc1's limits could not be added to: not validated")
        return
    try:
        strict.model_validate(body)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors, body=body) from None


async def _omni_sleep(run, http_error, wrapped, instance, args, kwargs):
    call = _api_call(args, kwargs)
    recorded = _record_reader(getattr(call[1], "engine_client", None)) if call else None
    if call is None or not callable(recorded):
        return await run.stock(API_UNKNOWN, wrapped, args, kwargs)
    request, state = call
    _validate(run, request)
    sleeping, before, precheck = state.sleeping_stages, set(state.sleeping_stages), False
    try:
        return await wrapped(*args, **kwargs)
    except http_error:  # the handler's own checks (501, worker topology): raised before any sleep RPC
        precheck = True
        raise
    except RuntimeError as exc:
        _api_note(run, "sleep")
        raise http_error(status_code=500, detail=f"Failed to sleep: {exc}") from exc
    finally:
        if not precheck:  # 0.31.0rc1: the stages the engine has on record, whatever the sleep did
            _list_recorded(run, request.stage_ids, recorded, sleeping, before)


def _record_reader(engine):
    """``stage ids -> tags on record`` for the engine's sleep record: 0.28.0-0.30.0's per-stage one, or
    0.28.0rc1's engine-wide set (every stage carries it). None: an engine client of another shape."""
    per_stage = getattr(engine, "_sleeping_tags_for_stages", None)
    if callable(per_stage):
        return per_stage
    if callable(getattr(engine, "_sleep_diffusion", None)) and isinstance(getattr(engine, "_sleeping_tags", None), set):
        return lambda stage_ids: set(engine._sleeping_tags)
    return None


def _list_recorded(run, stage_ids, recorded, sleeping, before):
    try:
        for sid in stage_ids:
            if recorded([sid]):
                sleeping.add(sid)
            elif sid not in before:  # stock lists every requested stage after a return
                sleeping.discard(sid)
    except Exception:  # never replace the call's own outcome: the set stays as stock left it
        run.fallback("the engine's sleep record could not be read after /v1/omni/sleep")


async def _omni_wakeup(run, http_error, wrapped, instance, args, kwargs):
    call = _api_call(args, kwargs)
    if call is None:
        return await run.stock(API_UNKNOWN, wrapped, args, kwargs)
    _validate(run, call[0])
    try:
        return await wrapped(*args, **kwargs)
    except NotImplementedError:
        raise
    except RuntimeError as exc:
        _api_note(run, "wakeup")
        raise http_error(status_code=500, detail=f"Failed to wake up: {exc}") from exc


def _api_note(run, kind):
    try:
        run.note(f"/v1/omni/{kind}: {run.count('api-' + kind)} failure(s) answered 500 as 0.31.0rc1 does",
                 key="api-" + kind)
    except Exception:
        pass
