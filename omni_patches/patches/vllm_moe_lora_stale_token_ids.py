"""vllm-moe-lora-stale-token-ids: skip vLLM's fused MoE-LoRA kernel for a batch without LoRA tokens instead of feeding it stale adapter ids

Why:         vLLM's ``LoRAKernelMeta.prepare_tensors`` returns early for a batch in which no token uses an
             adapter: it sets ``no_lora_flag_cpu`` but leaves ``token_lora_mapping`` as the previous batch
             wrote it, and ``PunicaWrapperGPU.add_lora_fused_moe`` hands the kernel those stale adapter slots.
             Base-model requests get a loaded adapter's MoE delta: their output is corrupted.
Upstream:    https://github.com/vllm-project/vllm/pull/42120 (fixes https://github.com/vllm-project/vllm/issues/42008;
             its FP8 half fixes #42007): in ``add_lora_fused_moe``, return before the kernel when the metadata's
             no-LoRA flag is set. First release with it: vLLM 0.24.0. (``PunicaWrapperXPU.add_lora_fused_moe``
             is unchanged in 0.24.0.)
Affected:    vllm >=0.16.0,<0.24.0 (the per-token (naive) kernel path first appears in 0.16.0). Reported
             upstream for 0.20-0.23; fixed upstream in vllm 0.24.0.
How:         wraps ``PunicaWrapperGPU.add_lora_fused_moe`` (``vllm.lora.punica_wrapper.punica_gpu``): when the
             wrapper's ``token_mapping_meta.no_lora_flag_cpu`` -- a one-element host tensor that
             ``prepare_tensors`` rewrites on every update -- says no token uses an adapter, return without
             calling the kernel, exactly as 0.24.0 does; otherwise call the original. Host read only (no device
             sync). An input it was not built for runs the original and is noted once in ``status``. The FP8
             half of #42120 (#42007) is not covered. Details: docs/patches.md.
Remove when: the oldest supported vLLM is 0.24.0
"""
import dis
import types

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    "requires": {"vllm": ">=0.16.0,<0.24.0"},
    "fixed_in": {"vllm": "0.24.0"},
    "targets": ["vllm.lora.punica_wrapper.punica_gpu"],
}

PATCH_ID = "vllm-moe-lora-stale-token-ids"
OWNER = "PunicaWrapperGPU"
METHOD = "add_lora_fused_moe"
META_MODULE = "vllm.lora.ops.triton_ops.lora_kernel_metadata"


def _reads_no_lora(func):
    """Whether ``func``'s own code refers to a no-LoRA flag (the upstream fix unpacks it from ``meta_args``)."""
    code = getattr(func, "__code__", None)
    if not isinstance(code, types.CodeType):
        return False
    names = set(code.co_varnames) | set(code.co_names)
    return any("no_lora" in n for n in names) or any(
        "no_lora" in str(ins.argval) for ins in dis.get_instructions(code) if ins.argval is not None)


def _meta_class(ctx):
    """vLLM's ``LoRAKernelMeta`` (what ``token_mapping_meta`` is): from the target module when it imported it
    (only with Triton), else from its own module (pure torch)."""
    cls = getattr(ctx.module, "LoRAKernelMeta", None)
    if cls is None:
        import importlib

        try:
            cls = importlib.import_module(META_MODULE).LoRAKernelMeta
        except (ImportError, AttributeError) as exc:
            ctx.drift(f"cannot find LoRAKernelMeta ({META_MODULE}): {type(exc).__name__}: {exc}")
    return cls


def check(ctx):
    func = ctx.resolve(f"{OWNER}.{METHOD}")
    if METHOD not in vars(ctx.resolve(OWNER)):  # the base class's NotImplementedError stub is not the target
        ctx.drift(f"{OWNER} no longer defines {METHOD} itself")
    if not isinstance(func, types.FunctionType):
        ctx.drift(f"{OWNER}.{METHOD} is not a plain function: {type(func).__name__}")
    if _reads_no_lora(func):
        ctx.describe(f"{OWNER}.{METHOD} reads the no-LoRA flag (upstream fix)")
        ctx.fixed_upstream(f"{OWNER}.{METHOD} already skips a batch without LoRA tokens (vLLM #42120)")
    # The stale-id shape: prepare_tensors sets no_lora_flag_cpu (and returns early) -- read from its code, which
    # audit skeletons keep too.
    prepare = getattr(_meta_class(ctx), "prepare_tensors", None)
    code = getattr(prepare, "__code__", None)
    if not isinstance(code, types.CodeType) or "no_lora_flag_cpu" not in code.co_names:
        ctx.drift("LoRAKernelMeta.prepare_tensors sets no no_lora_flag_cpu: the stale-id shape changed")
    ctx.describe(f"{OWNER}.{METHOD} calls the MoE-LoRA kernel with the metadata's token_lora_mapping even when "
                 f"no_lora_flag_cpu is set (stale adapter ids) -> skipped for such batches")


def _flag(instance):
    """The no-LoRA flag as a Python bool, or None when ``instance`` does not hold it the way vLLM does."""
    meta = getattr(instance, "token_mapping_meta", None)
    flag = getattr(meta, "no_lora_flag_cpu", None)
    if flag is None:
        return None
    try:
        import torch

        if not isinstance(flag, torch.Tensor) or flag.numel() != 1 or flag.device.type != "cpu":
            return None
        return bool(flag.item())
    except Exception:  # not ours to judge: stock decides
        return None


def apply(ctx):
    def skip_without_lora(wrapped, instance, args, kwargs):
        no_lora = _flag(instance)
        if no_lora is None:
            return ctx.stock("no one-element host no_lora_flag_cpu on token_mapping_meta", wrapped, args, kwargs)
        if no_lora:
            return None  # what 0.24.0 returns: no token uses an adapter, nothing to add
        return wrapped(*args, **kwargs)

    ctx.wrap(OWNER, METHOD, skip_without_lora)
