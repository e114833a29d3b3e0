"""Contract case for lora-cpu-fused-delta (opt-in): every loader release, also those with upstream's device fix."""
from support.contract import Case, Env
from support.omni_loader import LOADER_RELPATH, loader_sandbox

# lora-accel-delta off: the contract compares against the objects before activation, and on 0.27-0.29 it
# would stack its own layers under ours (the two together: tests/test_lora_patches.py).
ON = {"OMNI_PATCHES_LORA_CPU_FUSED_DELTA": "1", "OMNI_PATCHES_LORA_ACCEL_DELTA": "0"}


def sandbox(version, env=ON, **kw):
    return Env(f"omni-{version}", lambda: [str(loader_sandbox(version))], dict(env), **kw)


BASE = sandbox("0.28.0")
META = "vllm_omni-{0}.dist-info/METADATA"

CASE = Case(
    patch_id="lora-cpu-fused-delta",
    affected=[sandbox("0.27.0rc1"), BASE, sandbox("0.29.0rc1"), sandbox("0.30.0"), sandbox("0.32.0rc1")],
    skipped=[
        (sandbox("0.28.0", env={"OMNI_PATCHES_LORA_ACCEL_DELTA": "0"}), "skipped:disabled", "off by default"),
        # 0.26.0 has no diffusion/lora/loader.py: the version gate decides before any import (see
        # tests/cases/lora_accel_delta.py).
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
    drifted=[
        (Env.edited("omni-0.28.0-renamed-param", BASE, LOADER_RELPATH, "    is_bias: bool = False,\n",
                    "    bias_only: bool = False,\n"), "no parameter(s) is_bias"),
        (Env.edited("omni-0.28.0-no-add", BASE, LOADER_RELPATH, "params.add_(delta)",
                    "params.copy_(params + delta)"), "no longer applies the delta with add_"),
        (Env.edited("omni-0.30.0-renamed-method", sandbox("0.30.0"), LOADER_RELPATH, "def unload_module_lora(",
                    "def unload_lora_from_module("), "no attribute 'unload_module_lora'"),
    ],
)
