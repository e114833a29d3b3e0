"""lora-cpu-fused-delta: fuse CPU LoRA deltas into the weight in place (one multiply-accumulate, no temporary)

Why:         on CPU the stock loader materialises ``delta = B @ A`` (a full weight-sized temporary, rounded to
             the weight dtype), then adds it (rounded again). The patch accumulates ``B @ A`` into the weight
             in place and rounds once, with the kernel that is fastest on the CPU it runs on (measured in
             docs/patches.md). Opt-in: it changes how the weights are rounded (more accurately, but not
             bit-identically to stock).
Upstream:    https://github.com/vllm-project/vllm-omni (no upstream PR: an optimisation beyond the seed fix,
             vllm-omni #7590 of ``lora-accel-delta``, which only moves the matmul to an accelerator)
Affected:    vllm-omni >=0.27.0rc1 (every loader version; on 0.30.0rc1+ only upstream's CPU branch changes)
How:         the ``LoraLoaderMixin`` load/unload classmethods are wrapped to open a per-call context; the module
             global ``_prepare_lora_delta`` is replaced so that, for a CPU parameter whose delta would be
             computed on CPU, upstream's own loop runs on tensor-like stand-ins that record ``B @ A`` (per
             shard) instead of computing it, and the loop's ``param.add_(delta)`` / ``sub_`` becomes an
             in-place accumulate by the kernel chosen once per process and dtype: ``W.addmm_(B, A)`` where the
             CPU multiplies the dtype natively, else fp32 row blocks (omni_patches/patches/_lora_cpu_kernels.py;
             ``OMNI_PATCHES_LORA_CPU_FUSED_KERNEL=addmm|fp32`` overrides). vLLM's parameter classes are
             written through a ``TorchFunctionMode``; other tensor subclasses, non-float weights and any
             unknown use of a stand-in take the stock path. Details: docs/patches.md.
Remove when: upstream fuses LoRA deltas in place on CPU, or vllm-omni stops merging LoRA on CPU.
"""
import collections
import collections.abc

from . import _lora_call as lc
from . import _lora_cpu_kernels as kernels

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": False,
    "requires": {"vllm-omni": ">=0.27.0rc1"},
    "targets": ["vllm_omni.diffusion.lora.loader"],
}

PATCH_ID = "lora-cpu-fused-delta"

# torch and the op tables are set on first use: the module must import without torch (omni-patches audit
# imports every patch module in a plain venv).
torch = None
_CAT = _ACCUMULATE = _MODE = _DISABLED = _OWN = None

# Tensor subclasses whose __torch_function__ is known to run the op unchanged: vLLM's parameter classes
# (vllm/model_executor/parameter.py; vllm 0.24-0.32): BasevLLMParameter's only fills in kwargs and defers
# to Parameter's, which runs the op with torch functions disabled -- a stand-in handed to add_() through it
# never gets its own turn, so a TorchFunctionMode (which goes first) takes the add_ while such a module loads.
PASS_THROUGH_MODULES = ("vllm.model_executor.parameter",)
# What a subclass may not define for the fused path to write into its storage as stock's add_ would.
_OVERRIDES = ("__torch_function__", "__torch_dispatch__", "add_", "sub_", "data")


def load_torch():
    global torch, _CAT, _ACCUMULATE, _MODE, _DISABLED, _OWN
    if _ACCUMULATE is None:
        import torch as t
        from torch.overrides import TorchFunctionMode

        class _AccumulateMode(TorchFunctionMode):
            """Active for one load/unload call of a module holding pass-through subclasses (see above): takes
            ``param.add_(stand-in)`` / ``sub_`` before the parameter's own __torch_function__; everything else
            runs as without it."""

            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func in _ACCUMULATE and len(args) == 2 and not kwargs and isinstance(args[1], _Node):
                    return _Node.__torch_function__(func, types, args, kwargs)
                return func(*args, **(kwargs or {}))

        _CAT = {t.cat, t.concat, t.concatenate}
        _MODE = _AccumulateMode
        _DISABLED = t._C._disabled_torch_function_impl
        _OWN = {t.Tensor, t.nn.Parameter, getattr(t._C, "TensorBase", t.Tensor), object}
        torch = t
        _ACCUMULATE = {t.Tensor.add_: 1, t.Tensor.sub_: -1}  # last: the others are set when this is


# ----------------------------------------------------------------------------------------------- weights

_holders = {}  # tensor type -> "plain" | "mode" | why the fused path leaves it to stock


def holder(cls):
    """How the fused path writes into a weight of type ``cls``: ``"plain"`` (torch.Tensor, nn.Parameter and
    subclasses that change nothing torch sees), ``"mode"`` (a known pass-through __torch_function__: the
    accumulate mode takes the add_), or why it cannot (the stock path runs). Decided once per type."""
    got = _holders.get(cls)
    if got is None:
        got = _holders[cls] = _judge(cls)
    return got


def _judge(cls):
    kind = "plain"
    for c in cls.__mro__:
        if c in _OWN:
            continue
        for name in _OVERRIDES:
            if name not in vars(c):
                continue
            if name == "__torch_function__":
                impl = vars(c)[name]
                if getattr(impl, "__func__", impl) is _DISABLED:
                    continue
                if c.__module__ in PASS_THROUGH_MODULES:
                    kind = "mode"
                    continue
            return f"weight held as {cls.__module__}.{cls.__qualname__}, a tensor subclass with its own {name}"
    return kind


def _unsupported(param):
    """Why the fused path leaves ``param`` to stock, or None."""
    if not kernels.supported(param.dtype):
        return f"{kernels.short(param.dtype)} weights (the fused path adds into bf16/fp16/fp32/fp64)"
    kind = holder(type(param))
    if kind not in ("plain", "mode"):
        return kind
    return None


def _storage(param):
    """``param`` as a plain tensor over the same storage (no subclass code runs on our writes)."""
    if type(param) is torch.Tensor:
        return param
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.detach(param)


# ----------------------------------------------------------------------------------------------- stand-ins

def _real(x):
    if isinstance(x, _Node):
        return x.materialize()
    if isinstance(x, (list, tuple)):
        return type(x)(_real(i) for i in x)
    if isinstance(x, dict):
        return {k: _real(v) for k, v in x.items()}
    return x


class _Node:
    """A delta not computed yet. Tensor-like (``__torch_function__``): torch functions given one either
    build another node (matmul of two leaves, concat along rows) or get the materialised tensor."""

    __slots__ = ()

    def parts(self):
        return [self]

    @property
    def device(self):
        return torch.device("cpu")

    def to(self, *args, **kwargs):
        # The loop's `delta.to(device=param.device, dtype=param.dtype)`: nothing to do when both match; a
        # dtype change (an fp32 LoRA on bf16 weights) is remembered, so the kernel rounds once into it.
        device = dtype = None
        for a in args:
            if isinstance(a, torch.dtype):
                dtype = a
            elif isinstance(a, (str, torch.device)):
                device = a
            else:
                return self.materialize().to(*args, **kwargs)
        if set(kwargs) - {"device", "dtype", "non_blocking"}:
            return self.materialize().to(*args, **kwargs)
        device, dtype = kwargs.get("device", device), kwargs.get("dtype", dtype)
        if device is not None and torch.device(device).type != "cpu":
            return self.materialize().to(*args, **kwargs)
        if dtype is None or dtype == self.dtype:
            return self
        if not isinstance(self, _Cast) and kernels.supported(dtype) and kernels.supported(self.dtype):
            return _Cast(self, dtype)
        return self.materialize().to(*args, **kwargs)

    def __getattr__(self, name):  # anything else upstream might do with a delta: the real tensor
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.matmul and len(args) == 2 and not kwargs:
            b, a = args
            if _Product.fits(b, a):
                return _Product(b.t, a.t)
        elif func in _CAT and args and not kwargs.keys() - {"dim"}:
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            parts = args[0]
            if dim == 0 and len(args) <= 2 and isinstance(parts, (list, tuple)) and parts \
                    and all(isinstance(p, (_Leaf, _Product)) for p in parts) \
                    and len({type(p) for p in parts}) == 1 and len({p.dtype for p in parts}) == 1:
                return _Stack(list(parts))
        elif func in _ACCUMULATE and len(args) == 2 and not kwargs and isinstance(args[1], _Node):
            why = _accumulate(args[0], args[1], _ACCUMULATE[func])
            if why is None:
                return args[0]
            run = _run()
            if run is not None:
                run.fallback(why)
            _count("original code")
        return func(*_real(args), **_real(kwargs))


class _Leaf(_Node):
    """A state-dict tensor as upstream reads it (an A or B matrix, or a bias delta)."""

    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t

    dtype = property(lambda self: self.t.dtype)
    shape = property(lambda self: self.t.shape)

    def materialize(self):
        return self.t

    def accumulate(self, dst, sign):
        dst.add_(self.t, alpha=sign)  # one rounding, also from a wider delta into the weight's dtype
        return f"{kernels.short(self.t.dtype)} bias delta on {kernels.short(dst.dtype)}: add_ in place"


class _Product(_Node):
    """``B @ A``, to be accumulated into the weight by one kernel call."""

    __slots__ = ("b", "a")

    def __init__(self, b, a):
        self.b, self.a = b, a

    @staticmethod
    def fits(b, a):
        return (isinstance(b, _Leaf) and isinstance(a, _Leaf) and b.t.dim() == 2 and a.t.dim() == 2
                and b.t.shape[1] == a.t.shape[0] and b.t.dtype == a.t.dtype
                and b.t.device.type == "cpu" and a.t.device.type == "cpu")

    dtype = property(lambda self: self.b.dtype)
    shape = property(lambda self: torch.Size((self.b.shape[0], self.a.shape[1])))

    def materialize(self):
        return torch.matmul(self.b, self.a)

    def accumulate(self, dst, sign):
        # decided once per process and dtype pair
        run = _run()
        name, kernel = kernels.kernel_for(dst.dtype, self.b.dtype, note=None if run is None else run.note)
        kernel(dst, self.b, self.a, sign)
        w, lora = kernels.short(dst.dtype), kernels.short(self.b.dtype)
        return f"{lora} LoRA on {w} weights: {kernels.LABELS.get(name, name).format(dtype=w)}"


class _Stack(_Node):
    """Shards of a stacked (qkv-style) parameter, concatenated along rows."""

    __slots__ = ("items",)

    def __init__(self, items):
        self.items = items

    def parts(self):
        return self.items

    dtype = property(lambda self: self.items[0].dtype)
    shape = property(lambda self: torch.Size((sum(p.shape[0] for p in self.items), *self.items[0].shape[1:])))

    def materialize(self):
        return torch.concat([p.materialize() for p in self.items])

    def accumulate(self, dst, sign):  # not reached: _accumulate walks the parts
        raise NotImplementedError


class _Cast(_Node):
    """A delta the loop converted to the weight's dtype (``.to(dtype=param.dtype)``), where stock rounds the
    product once before its add rounds again; the kernels round once, into the weight."""

    __slots__ = ("inner", "dtype")

    def __init__(self, inner, dtype):
        self.inner, self.dtype = inner, dtype

    def parts(self):
        return self.inner.parts()

    shape = property(lambda self: self.inner.shape)

    def materialize(self):
        return self.inner.materialize().to(self.dtype)

    def accumulate(self, dst, sign):  # not reached: _accumulate walks the parts
        raise NotImplementedError


def _accumulate(param, node, sign):
    """``param += sign * node`` in place, shard by shard. None when done, else why stock's op must run
    (nothing written then)."""
    if not isinstance(param, torch.Tensor) or param.device.type != "cpu" or param.dim() == 0:
        return "the delta's target is not a CPU tensor of at least one dimension"
    why = _unsupported(param)
    if why is not None:
        return why
    if param.requires_grad and torch.is_grad_enabled():
        return "weight requires grad with grad enabled (stock's in-place add raises)"
    if node.dtype != param.dtype:
        return "delta not converted to the weight's dtype before the add"
    parts = node.parts()
    rows = 0
    for p in parts:
        shape = p.shape
        if not kernels.supported(p.dtype):
            return f"{kernels.short(p.dtype)} LoRA tensors (the fused path multiplies bf16/fp16/fp32/fp64)"
        if len(shape) != param.dim() or shape[1:] != param.shape[1:] or (isinstance(p, _Product) and
                                                                          param.dim() != 2):
            return "delta shape does not match the weight (stock broadcasts or raises)"
        rows += shape[0]
    if rows != param.shape[0]:
        return "delta shape does not match the weight (stock broadcasts or raises)"
    target = _storage(param)
    start = 0
    with torch.no_grad():
        for i, p in enumerate(parts):
            n = p.shape[0]
            dst = target if len(parts) == 1 else target.narrow(0, start, n)
            try:
                label = p.accumulate(dst, sign)
            except Exception as exc:
                if i == 0:  # nothing written yet (e.g. a dtype without a CPU addmm kernel)
                    return f"the kernel failed ({type(exc).__name__})"
                raise
            start += n
    _count(label)
    return None


# ----------------------------------------------------------------------------------------------- status

def _run():
    """The patch's record for the load/unload call under way (notes, fallbacks, the path totals); None outside
    one (a test driving the stand-ins directly: nothing to note on)."""
    call = lc.FUSED.get()
    return None if call is None else call.run


def _count(label):
    call = lc.FUSED.get()
    if call is not None and call.tally is not None:
        call.tally[label] += 1


def _report(call):
    """After each load/unload call: which path ran for how many parameters (one ``status`` note)."""
    if not call.tally or call.run is None:
        return
    totals = call.run.data.setdefault("paths", collections.Counter())  # path label -> parameters, this activation
    totals.update(call.tally)
    paths = sorted(totals.items(), key=lambda kv: (kv[0] == "original code", kv[0]))
    text = "; ".join(f"{label} x{n}" for label, n in paths)
    call.run.note(f"paths so far (parameters, per load and unload): {text}", key="paths")


class _Scope:
    """Around one load/unload call: the tally, and the accumulate mode when the module needs it."""

    def __init__(self, call):
        self.call, self.mode = call, None
        call.tally = collections.Counter()

    def __enter__(self):
        try:
            load_torch()
            if any(holder(type(p)) == "mode" for p in self.call.params.values()):
                mode = _MODE()
                mode.__enter__()
                self.mode = self.call.mode = mode
        except Exception as exc:  # then pass-through subclasses take the stock path (see _prepare)
            self.call.run.fallback(f"could not enter the accumulate mode ({type(exc).__name__})")
        return self

    def __exit__(self, *exc):
        if self.mode is not None:
            self.mode.__exit__(*exc)
        try:
            _report(self.call)
        except Exception:  # pragma: no cover - a note never breaks the call
            pass
        return False


class _LazyView(collections.abc.Mapping):
    """Read-only view of a state dict handing out CPU tensors as :class:`_Leaf` stand-ins."""

    __slots__ = ("_sd",)

    def __init__(self, sd):
        self._sd = sd

    def __getitem__(self, key):
        value = self._sd[key]
        if isinstance(value, torch.Tensor) and value.device.type == "cpu" and type(value) is torch.Tensor:
            return _Leaf(value)
        return value

    def __contains__(self, key):
        return key in self._sd

    def __iter__(self):
        return iter(self._sd)

    def __len__(self):
        return len(self._sd)


def check(ctx):
    lc.check_loader(ctx)
    for name, op in zip(lc.CLASSMETHODS, ("add_", "sub_")):
        code = getattr(getattr(getattr(ctx.resolve("LoraLoaderMixin"), name), "__func__", None), "__code__", None)
        if code is not None and op not in code.co_names:
            ctx.drift(f"LoraLoaderMixin.{name} no longer applies the delta with {op}")


def apply(ctx):
    ctx.describe(lc.DESCRIBE)
    mixin = ctx.resolve("LoraLoaderMixin")
    call_args = lc.Binder(mixin.load_lora_into_module, skip_first=True)
    prep_args = lc.Binder(ctx.resolve(lc.PREPARE))
    has_compute_device = "compute_device" in prep_args.pos  # upstream's device logic (0.30.0rc1+)

    per_call = lc.call_scope(ctx, lc.FUSED, call_args, around=_Scope)
    for name in lc.CLASSMETHODS:
        ctx.wrap("LoraLoaderMixin", name, per_call)

    def make(original):
        def _prepare_lora_delta(*args, **kwargs):
            call, param = lc.current(lc.FUSED, prep_args, args, kwargs)
            if param is None or param.device.type != "cpu":
                return original(*args, **kwargs)
            load_torch()
            if has_compute_device:
                dev = prep_args.get(args, kwargs, "compute_device")
                if dev is not None and torch.device(dev).type != "cpu":
                    return original(*args, **kwargs)  # upstream computes this one on an accelerator
            accel = lc.ACCEL.get()
            if accel is not None and accel.device is not None:
                return original(*args, **kwargs)  # lora-accel-delta computes this one on an accelerator
            why = _unsupported(param)
            if why is None and holder(type(param)) == "mode" and call.mode is None:
                why = "the accumulate mode is not active for this weight's tensor subclass"
            if why is not None:
                _count("original code")
                return ctx.stock(why, original, args, kwargs)
            sd = prep_args.get(args, kwargs, "lora_state_dict")
            a2, k2 = prep_args.swap(args, kwargs, "lora_state_dict", _LazyView(sd))
            try:
                return original(*a2, **k2)
            except Exception:  # our stand-ins met something unexpected: the stock computation decides
                why = "the loader did something with the stand-ins they do not model"
                _count("original code")
                return ctx.stock(why, original, args, kwargs)

        return _prepare_lora_delta

    ctx.replace("", lc.PREPARE, make)
