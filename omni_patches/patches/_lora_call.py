"""Shared by ``lora_accel_delta`` and ``lora_cpu_fused_delta`` (not a patch itself).

Both patches work the same way on ``vllm_omni.diffusion.lora.loader``: a wrapper around the two
``LoraLoaderMixin`` classmethods opens a per-call context (a contextvar, so threads and nested
calls never see each other's), and a replacement of the module-level ``_prepare_lora_delta`` -- which
the classmethods look up as a global on every parameter -- consults it. The loop itself stays
upstream's: key matching (0.28's substring rule vs 0.29+'s ``endswith``), used-key bookkeeping and
logging are never re-implemented here.
"""
import contextlib
import contextvars
import inspect

# lora-accel-delta's per-call state (a _Call) or None; lora-cpu-fused-delta reads it to leave the
# parameters that accel routes to a device alone.
ACCEL = contextvars.ContextVar("omni_patches_lora_accel", default=None)
FUSED = contextvars.ContextVar("omni_patches_lora_fused", default=None)

CLASSMETHODS = ("load_lora_into_module", "unload_module_lora")
CLASSMETHOD_PARAMS = ("state_dict", "module", "prefix", "lora_a_suffix", "lora_b_suffix", "lora_bias_suffix")
PREPARE = "_prepare_lora_delta"
# What both patches change (ctx.describe): the two classmethods get a per-call scope, the global is replaced.
DESCRIBE = ("LoraLoaderMixin.load_lora_into_module/unload_module_lora (per-call scope) and "
            "loader._prepare_lora_delta (module global the loop looks up per parameter)")
PREPARE_PARAMS = ("lora_state_dict", "base_key", "param_to_weight_names", "is_bias", "lora_a_suffix",
                  "lora_b_suffix", "lora_bias_suffix")


class _Call:
    """One load/unload call: its parameters by name (as the loop names them) and the compute device (plus
    what lora-cpu-fused-delta keeps per call: paths taken, the accumulate mode)."""

    __slots__ = ("params", "device", "tally", "mode", "run")

    def __init__(self, params, device=None, run=None):
        self.params, self.device, self.run = params, device, run  # run: the patch's record (ctx.run)
        self.tally = self.mode = None


class Binder:
    """Finds arguments by name in ``(args, kwargs)`` of a call, using positions read once from a signature."""

    def __init__(self, func, *, skip_first=False):
        params = list(inspect.signature(getattr(func, "__func__", func)).parameters.values())
        if skip_first:
            params = params[1:]  # cls: wrapt hands classmethod wrappers the args without it
        self.pos = {p.name: i for i, p in enumerate(params)}
        self.default = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}

    def get(self, args, kwargs, name):
        i = self.pos[name]
        if i < len(args):
            return args[i]
        if name in kwargs:
            return kwargs[name]
        return self.default.get(name)

    def swap(self, args, kwargs, name, value):
        """``(args, kwargs)`` with argument ``name`` replaced by ``value``."""
        i = self.pos[name]
        if i < len(args):
            args = args[:i] + (value,) + args[i + 1:]
        else:
            kwargs = {**kwargs, name: value}
        return args, kwargs


def check_loader(ctx):
    """Drift checks both patches share: the shape of the loop they hook into."""
    mixin = ctx.resolve("LoraLoaderMixin")
    for name in CLASSMETHODS:
        raw = ctx.resolve(f"LoraLoaderMixin.{name}")
        if not isinstance(raw, classmethod) and not isinstance(getattr(raw, "__wrapped__", None), classmethod):
            ctx.drift(f"LoraLoaderMixin.{name} is no longer a classmethod")
        ctx.require_params(getattr(mixin, name), *CLASSMETHOD_PARAMS, label=f"LoraLoaderMixin.{name}")
        # The hook point: the loop must still look _prepare_lora_delta up as a module global.
        code = getattr(getattr(getattr(mixin, name), "__func__", None), "__code__", None)
        if code is not None and PREPARE not in code.co_names:
            ctx.drift(f"LoraLoaderMixin.{name} no longer calls {PREPARE}")
    ctx.require_params(ctx.resolve(PREPARE), *PREPARE_PARAMS, label=PREPARE)


def call_scope(ctx, var, call_args, device=lambda: None, around=None):
    """wrapt wrapper for the two classmethods: a _Call in ``var`` for the duration of one load/unload
    (inside ``around(call)``, a context manager that never raises, when given)."""

    def per_call(wrapped, instance, args, kwargs):
        try:
            module = call_args.get(args, kwargs, "module")
            call = _Call(param_map(module, call_args.get(args, kwargs, "prefix")), device(), ctx.run)
            scope = around(call) if around is not None else contextlib.nullcontext()
        except Exception:  # a call shape we do not understand: upstream decides what happens
            return ctx.stock("a load/unload call whose module has no named_parameters(prefix)", wrapped, args,
                             kwargs)
        token = var.set(call)
        try:
            with scope:
                return wrapped(*args, **kwargs)
        finally:
            var.reset(token)

    return per_call


def param_map(module, prefix):
    """``{name: parameter}`` named exactly as upstream's loop names them (``named_parameters(prefix)``)."""
    return dict(module.named_parameters(prefix))


def current(var, prep_args, args, kwargs):
    """``(call, parameter)`` this ``_prepare_lora_delta`` call is about, inside a ``var`` scope; else Nones."""
    call = var.get()
    if call is None:
        return None, None
    return call, param_for(call, prep_args.get(args, kwargs, "base_key"), prep_args.get(args, kwargs, "is_bias"))


def param_for(call, base_key, is_bias):
    return call.params.get(base_key + (".bias" if is_bias else ".weight"))
