"""lora-accel-delta: compute LoRA deltas (B @ A) on the local accelerator when the weights are on CPU

Why:         vllm-omni 0.27-0.29 compute every LoRA delta ``B @ A`` on CPU, because the state dict comes
             from safetensors on CPU and the weights are still on CPU while the LoRA is fused (pre-sharding);
             a Wan2.2 transformer (800 keys, rank 64) takes 22 min on a 192-core Kunpeng host with
             OMP_NUM_THREADS=1 while the NPU sits idle.
Upstream:    https://github.com/vllm-project/vllm-omni/pull/7590 (``_resolve_lora_compute_device``)
Affected:    vllm-omni >=0.27.0rc1,<0.30.0rc1; fixed upstream in vllm-omni 0.30.0rc1
How:         ``LoraLoaderMixin.load_lora_into_module`` / ``unload_module_lora`` are wrapped to resolve the
             accelerator once per call (``get_local_device()``, probed with a one-element allocation; any
             failure means CPU: stock behaviour). The module global ``_prepare_lora_delta`` is replaced: while
             such a call is active it hands the original a read-only view of the state dict that moves each
             tensor it is asked for to the compute device, so upstream's own key matching runs unchanged and
             ``B @ A`` happens on the device. If the device path raises, the rest of the call uses the CPU
             path. Details: docs/patches.md.
Remove when: the oldest supported vllm-omni is 0.30.0rc1 or later.
"""
import collections.abc
import importlib

from . import _lora_call as lc

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    "requires": {"vllm-omni": ">=0.27.0rc1,<0.30.0rc1"},
    "fixed_in": {"vllm-omni": "0.30.0rc1"},
    "targets": ["vllm_omni.diffusion.lora.loader"],
}

_UTILS = "vllm_omni.diffusion.distributed.utils"


class _DeviceView(collections.abc.Mapping):
    """Read-only view of a state dict whose values are moved to ``device`` when they are looked up.

    Nothing is cached: each tensor lives on the device only as long as upstream's matmul needs it.
    """

    __slots__ = ("_sd", "_device")

    def __init__(self, sd, device):
        self._sd, self._device = sd, device

    def __getitem__(self, key):
        return self._sd[key].to(self._device)

    def __contains__(self, key):
        return key in self._sd

    def __iter__(self):
        return iter(self._sd)

    def __len__(self):
        return len(self._sd)


def _resolve_device():
    """The usable local accelerator, or None (CPU). Called once per load/unload call."""
    try:
        import torch

        dev = torch.device(importlib.import_module(_UTILS).get_local_device())
        if dev.type == "cpu":
            return None
        torch.empty(1, device=dev)  # get_local_device() names a device whether or not one exists
        return dev
    except Exception as exc:
        from .. import log

        log.once(20, ("lora-accel-delta", "probe", type(exc).__name__),
                 "lora-accel-delta: no usable accelerator (%s: %s); LoRA deltas stay on CPU",
                 type(exc).__name__, exc)
        return None


def check(ctx):
    # Upstream's fix, found by feature (a backport may carry it under an older version number).
    if ctx.has("_resolve_lora_compute_device"):
        ctx.fixed_upstream("vllm_omni.diffusion.lora.loader has _resolve_lora_compute_device")
    params = ctx.require_params(ctx.resolve(lc.PREPARE), "lora_state_dict", label=lc.PREPARE)
    if "compute_device" in params:
        ctx.fixed_upstream(f"{lc.PREPARE} already takes compute_device")
    lc.check_loader(ctx)


def apply(ctx):
    ctx.describe(lc.DESCRIBE)
    mixin = ctx.resolve("LoraLoaderMixin")
    call_args = lc.Binder(mixin.load_lora_into_module, skip_first=True)
    prep_args = lc.Binder(ctx.resolve(lc.PREPARE))

    per_call = lc.call_scope(ctx, lc.ACCEL, call_args, _resolve_device)
    for name in lc.CLASSMETHODS:
        ctx.wrap("LoraLoaderMixin", name, per_call)

    def make(original):
        def _prepare_lora_delta(*args, **kwargs):
            call, param = lc.current(lc.ACCEL, prep_args, args, kwargs)
            if param is None:
                return original(*args, **kwargs)
            on_cpu = param.device.type == "cpu"
            device = call.device if on_cpu else param.device
            if device is None:
                return original(*args, **kwargs)
            sd = prep_args.get(args, kwargs, "lora_state_dict")
            a2, k2 = prep_args.swap(args, kwargs, "lora_state_dict", _DeviceView(sd, device))
            try:
                return original(*a2, **k2)
            except Exception as exc:
                from .. import log

                log.once(30, ("lora-accel-delta", "device-failed"),
                         "lora-accel-delta: LoRA delta on %s failed (%s: %s); using the CPU path",
                         device, type(exc).__name__, exc)
                if on_cpu:
                    call.device = None  # the accelerator misbehaves: the rest of this call stays on CPU
                return ctx.stock(f"the LoRA delta on the accelerator failed ({type(exc).__name__}): computed on CPU",
                                 original, args, kwargs)

        return _prepare_lora_delta

    ctx.replace("", lc.PREPARE, make)
