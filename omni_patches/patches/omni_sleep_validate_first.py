"""omni-sleep-validate-first: a sleep with a bad stage id fails before it closes admission, and answers 400

Why:         AsyncOmni.sleep() closes frontend admission (``_paused = True``) and only then validates the
             requested stage ids (``_split_stage_ids_by_type`` raises ValueError for an id that is out of range,
             negative or not an int). The sleep fails, nothing was put to sleep, and ``_paused`` stays True:
             every later generate() waits on the pause condition, and wake_up() returns at "nothing is
             sleeping" before the code that reopens admission (POST /v1/omni/wakeup answers SKIPPED). One
             ``POST /v1/omni/sleep {"stage_ids": [5]}`` on a one-stage server (vLLM's ValueError handler answers
             it 400) leaves every image request after it unanswered until a valid sleep and wake_up, or a
             restart.
Upstream:    vllm-omni 0.32.0rc1 validates first (async_omni.py: "Validate before touching admission state")
             and its POST /v1/omni/sleep raises the ValueError as an HTTPException(400) (the id check came with
             https://github.com/vllm-project/vllm-omni/pull/6084, after a review asked for a ValueError). The
             pull request of the fix is not in the index: the release files are the reference.
Affected:    vllm-omni >=0.28.0rc1,<0.32.0rc1 (the first releases whose sleep() validates after pausing);
             fixed upstream in vllm-omni 0.32.0rc1 (also found by feature: the id check runs before
             ``_paused`` is set, or the handler answers a ValueError itself). 0.27.x and older have no
             admission gate in sleep(): "not affected".
How:         AsyncOmni.sleep is wrapped (wrapt): the instance's own ``_split_stage_ids_by_type`` runs on the
             requested ids first; its ValueError is raised before the stock method runs (nothing paused), any
             other outcome runs the stock method unchanged. The API server's POST /v1/omni/sleep route endpoint
             is wrapped to raise a ValueError as 0.32.0rc1 does, an HTTPException(400) with its message (stock's
             reaches vLLM's own handler: a 400 of error type "BadRequestError", not "Bad Request").
Remove when: the oldest supported vllm-omni is 0.32.0rc1 or later.
"""
import dis
import functools
import inspect

from ._routes import post_routes

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    "requires": {"vllm-omni": ">=0.28.0rc1,<0.32.0rc1"},
    "fixed_in": {"vllm-omni": "0.32.0rc1"},
    "targets": ["vllm_omni.entrypoints.async_omni", "vllm_omni.entrypoints.openai.api_server"],
}

PATCH_ID = "omni-sleep-validate-first"
API_SERVER = "vllm_omni.entrypoints.openai.api_server"
SLEEP_ROUTE = "/v1/omni/sleep"
SPLIT = "_split_stage_ids_by_type"


def check(ctx):
    if ctx.target == API_SERVER:
        return _check_api(ctx)
    sleep = ctx.resolve("AsyncOmni.sleep")
    ctx.require_params(sleep, "stage_ids")
    names = set(getattr(getattr(inspect.unwrap(sleep), "__code__", None), "co_names", ()))
    if "_paused" not in names:
        ctx.not_affected("AsyncOmni.sleep closes no admission gate (_paused): a bad stage id cannot wedge it")
    if SPLIT not in names:
        ctx.drift(f"AsyncOmni.sleep no longer validates its stage ids through {SPLIT}")
    # Which comes first needs the function's code (an audit's skeleton of the file keeps its names only: there the
    # version decides, and the API handler's own 400 tells a fixed build).
    if _order(sleep) == ["split", "pause"]:
        ctx.fixed_upstream(f"AsyncOmni.sleep validates its stage ids ({SPLIT}) before closing admission "
                           "(0.32.0rc1+)")
    ctx.require_params(ctx.resolve(f"AsyncOmni.{SPLIT}"), "stage_ids")
    ctx.describe(f"AsyncOmni.sleep: _paused set before {SPLIT} validates the stage ids")


def _order(func):
    """The order in which ``func`` first sets ``self._paused`` ("pause") and first looks up the id check
    ("split")."""
    seen = []
    code = getattr(inspect.unwrap(func), "__code__", None)
    for ins in dis.get_instructions(code) if code is not None else ():
        kind = ("pause" if ins.opname == "STORE_ATTR" and ins.argval == "_paused" else
                "split" if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval == SPLIT else None)
        if kind and kind not in seen:
            seen.append(kind)
    return seen


def _check_api(ctx):
    sleep = ctx.resolve("omni_sleep")
    ctx.require_params(sleep, "request", "raw_request")
    names = set(getattr(getattr(sleep, "__code__", None), "co_names", ()))
    if "ValueError" in names:
        ctx.fixed_upstream("omni_sleep raises a ValueError as an HTTPException(400) itself (0.32.0rc1+)")
    if "sleep" not in names:
        ctx.drift("omni_sleep no longer calls the engine's sleep itself")
    ctx.resolve("HTTPException")
    ctx.describe("api_server omni_sleep: a ValueError of the engine's sleep is left to the server's handlers")


def apply(ctx):
    if ctx.target == API_SERVER:
        return _apply_api(ctx)
    ctx.wrap("AsyncOmni", "sleep", functools.partial(_sleep, ctx.run))


UNVALIDATED = "an AsyncOmni whose stage-id check could not run on this call"


async def _sleep(run, wrapped, instance, args, kwargs):
    split = getattr(instance, SPLIT, None)
    stage_ids = args[0] if args else kwargs.get("stage_ids")
    try:
        split(stage_ids)
    except ValueError:
        run.tally("rejected", "sleep requests refused before closing admission (bad stage ids): {n}",
                  log="refused a sleep with bad stage ids before closing admission")
        raise
    except Exception:  # noqa: BLE001 - not what the wrapper was built for: stock decides, as it would
        return await run.stock(UNVALIDATED, wrapped, args, kwargs)
    return await wrapped(*args, **kwargs)


def _apply_api(ctx):
    """Wrap the endpoint of the router's POST /v1/omni/sleep route (``_routes``: under omni-diffusion-sleep-wake-errors'
    wrapper where that patch applied first)."""
    found = post_routes(ctx, {SLEEP_ROUTE: "omni_sleep"})
    if found is not None:
        ctx.wrap(found["omni_sleep"], "endpoint", functools.partial(_omni_sleep, ctx.run, ctx.resolve("HTTPException")))


async def _omni_sleep(run, http_error, wrapped, instance, args, kwargs):
    try:
        return await wrapped(*args, **kwargs)
    except ValueError as exc:
        run.tally("bad_request", "sleep requests answered 400 (bad stage ids): {n}")
        raise http_error(status_code=400, detail=str(exc)) from exc
