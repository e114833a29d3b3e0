"""Contract case for ascend-allgather-finalize-order: the REAL prepare_finalize.py of every vllm-ascend release.

Affected: every release file from 0.13.0rc1 to 0.23.0.post1 (``ascend_finalize.AFFECTED``), plus a source
build of 0.23.0.post1's code (version ``0.0.0``: decided by features). Skipped: the first fixed releases by
version, 0.24.0rc1's code as a source build (fixed by feature: the PCP reduce-scatter comes first), 0.12.0rc1
(outside the range). Drifted: 0.23.0.post1 edited (method renamed; DP reduce-scatter along another dim).
"""
from patches.ascend_allgather_finalize_order.ascend_finalize import AFFECTED, FIRST_FIXED, REL, sandbox_dir
from omni_patches.testing import Case, Env, Unexpected


def _env(version, meta=None):
    label = f"ascend-{version}" + (f"-as-{meta}" if meta else "")
    return Env(label, lambda: [str(sandbox_dir(version, metadata_version=meta))])


SOURCE_BUILD = "0.19.1rc2.dev1637+g182b75ea8"  # what a checkout of vllm-ascend main reports (TARGETS.md §7)
V023 = _env("0.23.0.post1")

def _config_without_pcp():
    """A layer whose moe_config has DP but no ``pcp_size`` (a config from another vLLM): the stock method decides,
    and raises where it reads it, as it does without the patch."""
    import types

    import torch
    from vllm_ascend.ops.fused_moe import prepare_finalize as pf

    cls = pf.PrepareAndFinalizeWithAllGather
    layer = cls.__new__(cls)
    layer.moe_config = types.SimpleNamespace(dp_size=2, dp_group=None)
    layer.enable_shared_expert_dp = False
    layer.num_tokens = 2
    return layer._finalize_with_dp_group(torch.arange(8.0).reshape(4, 2), False)


CASE = Case(
    patch_id="ascend-allgather-finalize-order",
    affected=[_env(v) for v in AFFECTED],
    skipped=[
        (_env(FIRST_FIXED), "skipped:version", "fixed upstream in vllm-ascend 0.24.0rc1"),
        (_env("0.25.1rc1"), "skipped:version", "fixed upstream"),
        (_env("0.26.0rc1"), "skipped:version", "fixed upstream"),
        (_env("0.12.0rc1"), "skipped:version", "outside"),
    ],
    source_built=[
        (_env("0.23.0.post1", "0.0.0"), "applied", "is a source build without tags"),
        (_env("0.23.0.post1", SOURCE_BUILD), "applied", "decided by code features"),
        (_env(FIRST_FIXED, SOURCE_BUILD), "skipped:version", "PCP reduce-scatter already comes first"),
        (_env("0.30.0rc2", SOURCE_BUILD), "skipped:version", "PCP reduce-scatter already comes first"),
    ],
    unexpected=[Unexpected(V023, _config_without_pcp, note="DP/PCP configuration or groups raised")],
    drifted=[
        (Env.edited("ascend-0.23-finalize-renamed", V023, REL, "def _finalize_with_dp_group(",
                    "def _finalize_with_dp_group_v2("), "defines no plain method _finalize_with_dp_group"),
        (Env.edited("ascend-0.23-dp-scatter-dim", V023, REL, "get_dp_group().reduce_scatter(hidden_states, 0)",
                    "get_dp_group().reduce_scatter(hidden_states, -1)"), "not a DP or PCP reduce-scatter"),
    ],
)


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here; the words are omni_patches.tools.audit's).
VERDICTS = {
    "vllm-ascend==0.9.1": "skip: out of range", "vllm-ascend==0.9.2rc1": "skip: out of range",
    "vllm-ascend==0.18.0rc1": "would apply", "vllm-ascend==0.22.1rc1": "would apply",
    "vllm-ascend==0.23.0rc1": "would apply", "vllm-ascend==0.23.0.post1": "would apply",
    "vllm-ascend==0.24.0rc1": "skip: fixed upstream", "vllm-ascend==0.26.0rc1": "skip: fixed upstream",
    "vllm-ascend==0.27.1rc1": "skip: fixed upstream", "vllm-ascend==0.30.0rc2": "skip: fixed upstream",
}
