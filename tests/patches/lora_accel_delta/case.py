"""Contract case for lora-accel-delta: the real loader.py of each release (tests/support/omni_loader.py)."""
from omni_patches.testing import Case, Env, Unexpected
from support.omni_loader import LOADER_RELPATH, release


def sandbox(version, **kw):
    return Env(f"omni-{version}", release(version).paths, **kw)


BASE = sandbox("0.28.0")


def _no_module():
    """A load call whose module is not a module: the per-call scope cannot map its parameters; stock's own
    AttributeError is what the caller gets."""
    from vllm_omni.diffusion.lora import loader

    return loader.LoraLoaderMixin.load_lora_into_module({}, None)
META = "vllm_omni-{0}.dist-info/METADATA"

CASE = Case(
    patch_id="lora-accel-delta",
    affected=[sandbox("0.27.0rc1"), BASE, sandbox("0.29.0rc1")],
    skipped=[
        (sandbox("0.30.0"), "skipped:version", "fixed upstream"),
        (sandbox("0.32.0rc1"), "skipped:version", "fixed upstream"),
        # Upstream's fix found by feature although the version says 0.28.0 (a vendor backport).
        (Env.edited("omni-0.28.0-backported-helper", BASE, LOADER_RELPATH, "def _load_lora_state_dict(",
                    "def _resolve_lora_compute_device():\n    return None\n\n\ndef _load_lora_state_dict("),
         "skipped:version", "fixed upstream"),
        (Env.edited("omni-0.28.0-backported-param", BASE, LOADER_RELPATH,
                    '    lora_bias_suffix: str = "bias",\n):\n    used_keys = set()',
                    '    lora_bias_suffix: str = "bias",\n    compute_device=None,\n):\n    used_keys = set()'),
         "skipped:version", "fixed upstream"),
        (sandbox("0.28.0", env={"OMNI_PATCHES_LORA_ACCEL_DELTA": "0"}), "skipped:disabled", "ACCEL_DELTA=0"),
        # 0.26.0 has no diffusion/lora/loader.py: the version gate decides before any import. Only the
        # package metadata is edited; the target is never imported (imports= names what the child imports).
        (Env.edited("omni-0.26.0-metadata", BASE, "vllm_omni-0.28.0.dist-info/METADATA", "Version: 0.28.0",
                    "Version: 0.26.0", imports=["vllm_omni"]), "skipped:version", "outside"),
    ],
    source_built=[
        # A checkout of the 0.28 line (setuptools_scm numbers) and one without tags: the code decides.
        (Env.source_build(BASE, META.format("0.28.0"), "0.28.0", "0.28.1.dev12+g1a2b3c4d"), "applied",
         "is a source build: decided by code features"),
        (Env.source_build(BASE, META.format("0.28.0"), "0.28.0", "0.0.0"), "applied", "decided by code features"),
        # A checkout of 0.30 whose number says 0.19-something: upstream's fix is in the code, so it skips.
        (Env.source_build(sandbox("0.30.0"), META.format("0.30.0"), "0.30.0", "0.19.1rc2.dev1637+g182b75ea8"),
         "skipped:version", "fixed upstream"),
    ],
    unexpected=[Unexpected(BASE, _no_module, note="module has no named_parameters(prefix)")],
    drifted=[
        (Env.edited("omni-0.28.0-renamed-helper", BASE, LOADER_RELPATH, "def _prepare_lora_delta(",
                    "def _prepare_lora_delta_v2("), "no attribute '_prepare_lora_delta'"),
        (Env.edited("omni-0.28.0-renamed-param", BASE, LOADER_RELPATH,
                    "    def unload_module_lora(\n        cls,\n        state_dict,",
                    "    def unload_module_lora(\n        cls,\n        lora_state_dict,"), "no parameter(s) state_dict"),
        (Env.edited("omni-0.28.0-inlined", BASE, LOADER_RELPATH, "delta, used_keys = _prepare_lora_delta(",
                    "delta, used_keys = _prepare_lora_delta_inline("), "no longer calls _prepare_lora_delta"),
    ],
)


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here; the words are omni_patches.tools.audit's).
VERDICTS = {
    "vllm-omni==0.22.0": "skip: out of range", "vllm-omni==0.24.0": "skip: out of range",
    "vllm-omni==0.28.0": "would apply", "vllm-omni==0.30.0": "skip: fixed upstream",
    "vllm-omni==0.32.0rc1": "skip: fixed upstream",
}
