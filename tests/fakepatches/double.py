"""Test patch: doubles ``fakeomni.loader.compute`` and tags every kind of method on ``Mixin``."""


def _double(wrapped, instance, args, kwargs):
    return 2 * wrapped(*args, **kwargs)


def _tag(wrapped, instance, args, kwargs):
    return ("patched", wrapped(*args, **kwargs))


def check(ctx):
    if ctx.target == "fakeomni.loader":
        ctx.require_params(ctx.resolve("compute"), "x", "scale")
        if ctx.has("ALREADY_FIXED"):
            ctx.fixed_upstream("fakeomni.loader.ALREADY_FIXED is set")


def apply(ctx):
    if ctx.target == "fakeomni.loader":
        ctx.describe("loader.compute(x, scale)")
        ctx.wrap("", "compute", _double)
        for name in ("load", "helper", "method"):
            ctx.wrap("Mixin", name, _tag)
    elif ctx.target == "fakeomni.consumer":
        ctx.wrap("", "compute", _double)  # re-bound by `from fakeomni.loader import compute`
