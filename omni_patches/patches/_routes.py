"""Shared by the patches that wrap a route of vllm-omni's API server (not a patch itself).

FastAPI copies a route's ``endpoint`` into the app when the server starts, after the import that applies the
patches: the module-level handler is not what it calls, so a patch wraps ``route.endpoint``. A route is found by
its path, its POST method and its endpoint being the module's handler, or a chain of wrappers (``__wrapped__``)
around it: another patch may have wrapped the same endpoint first.

Used by omni-diffusion-sleep-wake-errors (``/v1/omni/sleep``, ``/v1/omni/wakeup``) and omni-sleep-validate-first
(``/v1/omni/sleep``).
"""


def post_routes(ctx, handlers):
    """``{handler name: route}`` for ``handlers`` (``{path: module-level handler name}``) in the target module's
    ``router``; drift when one is missing. None in a dry run on a file's shape (an audit: no live router)."""
    routes = getattr(ctx.resolve("router"), "routes", None)
    if not isinstance(routes, list):
        if ctx.dry_run:
            ctx.describe("routes not inspected (no live router in a dry run of the file's shape)")
            return None
        ctx.drift("api_server.router has no list of routes")
    found = {}
    for route in routes:
        name = handlers.get(getattr(route, "path", None))
        if name and "POST" in (getattr(route, "methods", None) or ()) \
                and _wraps(getattr(route, "endpoint", None), ctx.resolve(name)):
            found[name] = route
    missing = sorted(set(handlers.values()) - set(found))
    if missing:
        ctx.drift(f"api_server.router has no POST route to {', '.join(missing)}")
    return found


def _wraps(endpoint, handler):
    """``endpoint`` is ``handler`` or a chain of wrappers (``__wrapped__``) around it."""
    for _ in range(16):
        if endpoint is handler:
            return True
        endpoint = getattr(endpoint, "__wrapped__", None)
        if endpoint is None:
            return False
    return False
