"""lora-cpu-fused-delta: fuse CPU LoRA deltas into the weight in place (one multiply-accumulate, no temporary)

Fixes:       on CPU the stock loader materialises ``delta = B @ A`` (a full weight-sized temporary, rounded to
             the weight dtype), then adds it (rounded again). The patch accumulates ``B @ A`` into the
             weight in place and rounds once, with the kernel that is fastest on the CPU it runs on
             (omni_patches/patches/_lora_cpu_kernels.py): ``W.addmm_(B, A)`` in the weight dtype where the
             CPU multiplies it natively (AMD EPYC with avx512_bf16: 0.23-0.25 of stock for 5120x5120 bf16,
             rank 64), else an fp32 row-blocked accumulate (~2.5 MiB blocks, one rounding; Intel Xeon
             without avx512_bf16: 0.35 of stock, where a bf16 ``addmm_`` is emulated and only 0.80-0.86).
             fp32 weights always use ``addmm_``. Error against a float64 reference is no larger than
             stock's. Opt-in: it changes how the weights are rounded (more accurately, but not
             bit-identically to stock).
Upstream:    https://github.com/vllm-project/vllm-omni (no upstream PR: an optimisation beyond the seed fix
             https://github.com/vllm-project/vllm-omni/pull/7590, which only moves the matmul to an accelerator)
Affected:    vllm-omni >=0.27.0rc1 (every loader version; on 0.30.0rc1+ only upstream's CPU branch changes)
How:         the ``LoraLoaderMixin`` load/unload classmethods are wrapped to open a per-call context; the module
             global ``_prepare_lora_delta`` is replaced so that, for a CPU parameter whose delta would be
             computed on CPU (no ``compute_device`` from upstream 0.30+, no accelerator chosen by
             lora-accel-delta), the original runs on a view of the state dict whose tensors are tensor-like
             stand-ins (``__torch_function__``): upstream's own key matching and ``torch.matmul``/``concat``
             calls record ``B @ A`` (per shard for stacked qkv params) instead of computing it, the loop's
             ``.to(param.device, param.dtype)`` is a no-op when nothing changes, and the loop's
             ``param.add_(delta)`` / ``sub_`` becomes ``param[rows] += +1/-1 * B @ A`` per shard by the
             chosen kernel (bias: ``add_``/``sub_`` per shard). The kernel is decided once per process and
             dtype at first use: ``OMNI_PATCHES_LORA_CPU_FUSED_KERNEL=addmm|fp32`` if set, else the CPU's
             capability (cpuinfo flags, oneDNN ISA cap, torch's CPU capability) confirmed by a timed probe
             of both kernels (a few ms); the choice is logged once and noted in ``status``. Any other use of
             a stand-in (dtype change, broadcasting, unknown op) computes the real delta exactly as stock
             does, so behaviour never depends on it.
Remove when: upstream fuses LoRA deltas in place on CPU, or vllm-omni stops merging LoRA on CPU.
"""
import collections.abc

from . import _lora_call as lc
from . import _lora_cpu_kernels as kernels

# torch and the op tables are set on first use: the module must import without torch (omni-patches audit
# imports every patch module in a plain venv).
torch = None
_CAT = _ACCUMULATE = None


def _load_torch():
    global torch, _CAT, _ACCUMULATE
    if _ACCUMULATE is None:
        import torch as t

        _CAT = {t.cat, t.concat, t.concatenate}
        torch = t
        _ACCUMULATE = {t.Tensor.add_: 1, t.Tensor.sub_: -1}  # last: the others are set when this is


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
        # The loop's `delta.to(device=param.device, dtype=param.dtype)`: nothing to do when both match.
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
        if (device is None or torch.device(device).type == "cpu") and (dtype is None or dtype == self.dtype):
            return self
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
            if _accumulate(args[0], args[1], _ACCUMULATE[func]):
                return args[0]
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
        dst.add_(self.t, alpha=sign)


class _Product(_Node):
    """``B @ A``, to be accumulated into the weight by one ``addmm_``."""

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
        _, kernel = kernels.kernel_for(dst.dtype)  # decided once per process and dtype
        kernel(dst, self.b, self.a, sign)


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


def _accumulate(param, node, sign):
    """``param += sign * node`` in place, shard by shard. False (nothing written) when the stock op must run."""
    if not isinstance(param, torch.Tensor) or param.device.type != "cpu" or param.dim() == 0:
        return False
    if param.requires_grad and torch.is_grad_enabled():
        return False  # stock's in-place add raises here; let it
    parts = node.parts()
    rows = 0
    for p in parts:
        shape = p.shape
        if p.dtype != param.dtype or len(shape) != param.dim() or shape[1:] != param.shape[1:]:
            return False
        if isinstance(p, _Product) and param.dim() != 2:
            return False
        rows += shape[0]
    if rows != param.shape[0]:
        return False  # a broadcast or a shape error: exactly stock's behaviour, via the real delta
    start = 0
    with torch.no_grad():
        for i, p in enumerate(parts):
            n = p.shape[0]
            dst = param if len(parts) == 1 else param.narrow(0, start, n)
            try:
                p.accumulate(dst, sign)
            except Exception:
                if i == 0:
                    return False  # nothing written yet (e.g. a dtype without a CPU addmm kernel)
                raise
            start += n
    return True


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

    per_call = lc.call_scope(lc.FUSED, call_args)
    for name in lc.CLASSMETHODS:
        ctx.wrap("LoraLoaderMixin", name, per_call)

    def make(original):
        def _prepare_lora_delta(*args, **kwargs):
            _, param = lc.current(lc.FUSED, prep_args, args, kwargs)
            if param is None or param.device.type != "cpu":
                return original(*args, **kwargs)
            _load_torch()
            if has_compute_device:
                dev = prep_args.get(args, kwargs, "compute_device")
                if dev is not None and torch.device(dev).type != "cpu":
                    return original(*args, **kwargs)  # upstream computes this one on an accelerator
            accel = lc.ACCEL.get()
            if accel is not None and accel.device is not None:
                return original(*args, **kwargs)  # lora-accel-delta computes this one on an accelerator
            sd = prep_args.get(args, kwargs, "lora_state_dict")
            a2, k2 = prep_args.swap(args, kwargs, "lora_state_dict", _LazyView(sd))
            try:
                return original(*a2, **k2)
            except Exception:  # our stand-ins met something unexpected: the stock computation decides
                return original(*args, **kwargs)

        return _prepare_lora_delta

    ctx.replace("", lc.PREPARE, make)
