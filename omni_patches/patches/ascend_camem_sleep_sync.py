"""ascend-camem-sleep-sync: synchronize the NPU before CaMemAllocator.sleep copies out and unmaps its memory

Why:         CaMemAllocator.sleep() offloads tagged allocations (a D2H copy) and unmaps and releases every
             allocation while NPU kernels or an ACLGraph replay may still be in flight: the work still running
             reads or writes memory that is gone (rtMemcpy failures, aivec "DDR address out of range"
             errors) and the offloaded copy can miss what it had not yet written (seen in verl RL rollouts).
Upstream:    https://github.com/vllm-project/vllm-ascend/pull/13757 (``torch.npu.synchronize()`` after the
             tags are normalised and logged, before the offload/unmap loop); the v0.23 backport
             https://github.com/vllm-project/vllm-ascend/pull/15702 is in no release
Affected:    vllm-ascend >=0.7.3,<0.27.1rc1: every release on the index with device_allocator/camem.py
             (0.7.3 is the first); fixed upstream in vllm-ascend 0.27.1rc1 (also found by feature: a
             ``sleep`` whose code calls ``synchronize``).
How:         CaMemAllocator.sleep is wrapped (wrapt): the wrapper calls the camem module's own
             ``torch.npu.synchronize()``, then the stock method, so the fence comes before the first offload
             copy and the first unmap, where 0.27.1rc1 puts it. Inputs on which 0.27.1rc1 fails before its
             fence (offload_tags not None / a str / a tuple, no ``pointer_to_data`` dict), other arguments,
             a torch without ``torch.npu.synchronize`` or a synchronize that raises: the stock method alone
             (noted once in status). Details: docs/patches.md.
Remove when: the oldest supported vllm-ascend is 0.27.1rc1 or later.
"""
import types

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    "requires": {"vllm-ascend": ">=0.7.3,<0.27.1rc1"},
    "fixed_in": {"vllm-ascend": "0.27.1rc1"},
    "targets": ["vllm_ascend.device_allocator.camem"],
}

PATCH_ID = "ascend-camem-sleep-sync"
TARGET = "vllm_ascend.device_allocator.camem"
CLASS = "CaMemAllocator"
METHOD = "sleep"
PARAMS = ("self", "offload_tags")
# What the stock sleep must still do itself for a fence in front of it to be the fix.
_DOES = {"unmap_and_release": "unmap", "memcpy": "offload copy", "pointer_to_data": "allocation table"}
_NO_TAGS = object()


def _names(code):
    """Every name the code object (and the code nested in it) looks up."""
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names(const)
    return out


def check(ctx):
    func = ctx.own_function(CLASS, METHOD)
    names = _names(func.__code__)
    if "synchronize" in names:
        ctx.fixed_upstream(f"{CLASS}.{METHOD} already synchronizes the device before it unmaps (0.27.1rc1+)")
    params = tuple(ctx.require_params(func, *PARAMS, label=f"{CLASS}.{METHOD}"))
    if params != PARAMS:
        ctx.drift(f"{CLASS}.{METHOD} takes {params}, expected {PARAMS}")
    missing = [what for name, what in _DOES.items() if name not in names]
    if missing:
        ctx.drift(f"{CLASS}.{METHOD} no longer does its own {', '.join(missing)} ({', '.join(_DOES)})")
    if not ctx.has("torch"):
        ctx.drift(f"{TARGET} no longer imports torch (the fence is its torch.npu.synchronize)")
    ctx.describe(f"{CLASS}.{METHOD}: offload copies and unmaps with no device synchronize before them")


def apply(ctx):
    ctx.wrap(CLASS, METHOD, fenced_sleep(ctx.run, ctx.module))


def _offload_tags(args, kwargs):
    """The ``offload_tags`` of a call, or ``_NO_TAGS`` when the arguments are not ``([offload_tags])``."""
    if len(args) > 1 or set(kwargs) - {"offload_tags"} or (args and kwargs):
        return _NO_TAGS
    return args[0] if args else kwargs.get("offload_tags")


def unexpected(instance, args, kwargs):
    """Why this call is not one the fence was built for (None: it is). 0.27.1rc1 fails on these before it
    synchronizes (its tag assert, its log of ``pointer_to_data``), so the stock call alone is its outcome too."""
    tags = _offload_tags(args, kwargs)
    if tags is _NO_TAGS:
        return "sleep() called with other arguments than offload_tags"
    if not (tags is None or isinstance(tags, (str, tuple))):
        return "offload_tags is not None, a str or a tuple"
    if not isinstance(getattr(instance, "pointer_to_data", None), dict):
        return "the allocator has no pointer_to_data dict"
    return None


def synchronizer(module):
    """The target module's ``torch.npu.synchronize`` at call time, or None."""
    torch = vars(module).get("torch")
    sync = getattr(getattr(torch, "npu", None), "synchronize", None)
    return sync if callable(sync) else None


def fenced_sleep(run, module):
    """The wrapper of ``CaMemAllocator.sleep``: ``torch.npu.synchronize()``, then the stock method."""

    def sleep(wrapped, instance, args, kwargs):
        try:
            why, sync = unexpected(instance, args, kwargs), synchronizer(module)
        except Exception:  # an attribute that raises when read: the stock method reads it too and decides
            why, sync = "reading the allocator or torch.npu raised", None
        if why is not None:
            return run.stock(why, wrapped, args, kwargs)
        if sync is None:
            return run.stock("torch.npu has no synchronize", wrapped, args, kwargs)
        try:
            sync()
        except Exception:  # a device error the stock call meets on its own: never raised from here
            return run.stock("torch.npu.synchronize() raised", wrapped, args, kwargs)
        run.tally("fenced", "device synchronized before the offload/unmap of {n} sleep(s)")
        return wrapped(*args, **kwargs)

    return sleep
