"""Contract case for lora-cpu-fused-delta (opt-in): every loader release, also those with upstream's device fix."""
from omni_patches.testing import Case, Env, Unexpected
from support.omni_loader import LOADER_RELPATH, release

# lora-accel-delta off: the contract compares against the objects before activation, and on 0.27-0.29 it
# would stack its own layers under ours (the two together: test_fused_real_loader.py).
ON = {"OMNI_PATCHES_LORA_CPU_FUSED_DELTA": "1", "OMNI_PATCHES_LORA_ACCEL_DELTA": "0"}


def sandbox(version, env=ON, **kw):
    return Env(f"omni-{version}", release(version).paths, dict(env), **kw)


BASE = sandbox("0.28.0")


def _load(weights=None, dtype="bfloat16"):
    """Load a LoRA through the real loader into a fresh tiny transformer (``weights(p)`` converts each 2-D
    weight first); the parameters afterwards."""
    import torch
    from vllm_omni.diffusion.lora import loader

    from support.omni_loader import make_lora_state_dict, tiny_transformer

    torch.manual_seed(0)
    model = tiny_transformer(16).to(getattr(torch, dtype))
    if weights is not None:
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight = weights(mod.weight.detach())
    sd = make_lora_state_dict(model, rank=2, bias=True, seed=1, dtype=torch.bfloat16)
    loader.LoraLoaderMixin.load_lora_into_module(sd, model)
    return {name: p.detach().clone() for name, p in model.named_parameters("transformer")}


def _own_torch_function():
    """Weights held as a tensor subclass with its own __torch_function__ (not one of vLLM's known pass-through
    classes): before issue 19 the stand-in reached add_() through it and raised TypeError."""
    import torch

    class Traced(torch.nn.Parameter):
        calls = 0

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.calls += 1
            return super().__torch_function__(func, types, args, kwargs or {})

    return _load(lambda w: Traced(w, requires_grad=False))


def _int8_weights():
    """int8 weights: the fused path adds into floating weights only; stock converts the delta and adds."""
    import torch

    return _load(lambda w: torch.nn.Parameter((w * 100).to(torch.int8), requires_grad=False))
META = "vllm_omni-{0}.dist-info/METADATA"

CASE = Case(
    patch_id="lora-cpu-fused-delta",
    affected=[sandbox("0.27.0rc1"), BASE, sandbox("0.29.0rc1"), sandbox("0.30.0"), sandbox("0.32.0rc1")],
    skipped=[
        (sandbox("0.28.0", env={"OMNI_PATCHES_LORA_ACCEL_DELTA": "0"}), "skipped:disabled", "off by default"),
        # 0.26.0 has no diffusion/lora/loader.py: the version gate decides before any import (see
        # tests/patches/lora_accel_delta/case.py).
        (Env.edited("omni-0.26.0-metadata", BASE, "vllm_omni-0.28.0.dist-info/METADATA", "Version: 0.28.0",
                    "Version: 0.26.0", imports=["vllm_omni"]), "skipped:version", "outside"),
    ],
    source_built=[
        # Checkouts whose setuptools_scm numbers say nothing useful: the loop's shape decides (every loader
        # since 0.27 has it, upstream's device fix included).
        (Env.source_build(BASE, META.format("0.28.0"), "0.28.0", "0.0.0"), "applied", "decided by code features"),
        (Env.source_build(sandbox("0.30.0"), META.format("0.30.0"), "0.30.0", "0.19.1rc2.dev1637+g182b75ea8"),
         "applied", "is a source build: decided by code features"),
    ],
    unexpected=[
        Unexpected(BASE, _own_torch_function, note="a tensor subclass with its own __torch_function__"),
        Unexpected(sandbox("0.30.0"), _int8_weights, note="int8 weights (the fused path adds into"),
    ],
    drifted=[
        (Env.edited("omni-0.28.0-renamed-param", BASE, LOADER_RELPATH, "    is_bias: bool = False,\n",
                    "    bias_only: bool = False,\n"), "no parameter(s) is_bias"),
        (Env.edited("omni-0.28.0-no-add", BASE, LOADER_RELPATH, "params.add_(delta)",
                    "params.copy_(params + delta)"), "no longer applies the delta with add_"),
        (Env.edited("omni-0.30.0-renamed-method", sandbox("0.30.0"), LOADER_RELPATH, "def unload_module_lora(",
                    "def unload_lora_from_module("), "no attribute 'unload_module_lora'"),
    ],
)


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here; the words are omni_patches.tools.audit's).
VERDICTS = {
    "vllm-omni==0.22.0": "skip: out of range", "vllm-omni==0.24.0": "skip: out of range",
    "vllm-omni==0.28.0": "would apply", "vllm-omni==0.30.0": "would apply", "vllm-omni==0.32.0rc1": "would apply",
}
