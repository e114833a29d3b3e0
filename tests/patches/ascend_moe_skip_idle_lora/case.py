"""Contract case for ascend-moe-skip-idle-lora: REAL vllm-ascend releases with the REAL vLLM each was built for
(``support.ascend_real``: torch_npu / CANN stubbed as vllm-ascend's own CPU unit tests do). One release per
layout; test_ascend_skip.py drives every release."""
from support.ascend_real import deps_preload, paths
from omni_patches.testing import Case, Env, Unexpected

FM = "vllm_ascend/ops/fused_moe/fused_moe.py"
RE = "vllm_ascend/ops/fused_moe/routed_experts.py"
MLP = "vllm_ascend/ops/fused_moe/moe_mlp.py"
FM_MOD, MLP_MOD = "vllm_ascend.ops.fused_moe.fused_moe", "vllm_ascend.ops.fused_moe.moe_mlp"

# vLLM's deps imported once per zygote (Env.preload); by layout: AscendFusedMoE.forward_impl (0.23.0),
# AscendMoERunner.no_shared_forward_impl (0.26.0rc1), AscendRoutedExperts.forward_impl (0.30.0rc2).
V023 = Env("ascend-0.23.0-vllm-0.23.0", lambda: paths("0.23.0"), preload=deps_preload)
V026 = Env("ascend-0.26.0rc1-vllm-0.26.0", lambda: paths("0.26.0rc1"), preload=deps_preload)
V030 = Env("ascend-0.30.0rc2-vllm-0.30.0", lambda: paths("0.30.0rc2"), preload=deps_preload)
# No runner method matches: the narrow fallback on moe_mlp.unquant_apply_mlp applies instead (moe_mlp is no
# target of its own: the contract snapshots it too).
# Issue 14: the same real files installed with the metadata a source checkout carries (setuptools_scm from the
# nearest reachable tag: main reports 0.19.1rc2.dev1637+g182b75ea8; no tags: 0.0.0).
SOURCE_BUILDS = ("0.19.1rc2.dev1637+g182b75ea8", "0.0.0", "0.27.0.dev12+gabc")
ASSUME = "OMNI_PATCHES_ASSUME_VERSION"


def _as(release, metadata, **env):
    label = f"ascend-{release}-as-{metadata}" + "".join(f"-{v}" for v in env.values())
    return Env(label, lambda: paths(release, metadata_version=metadata), env, preload=deps_preload)


FALLBACK = Env.edited("ascend-0.26.0rc1-runner-renamed", V026, FM, "def no_shared_forward_impl(",
                      "def routed_forward_impl(", imports=[FM_MOD, MLP_MOD])

def _unreadable_punica_wrapper():
    """A context whose punica wrapper cannot say ``no_lora`` (a property that raises): the forward must run as
    stock's does -- here the real method's own error, as no forward context is set."""
    import torch.nn as nn
    from vllm_ascend.ops.fused_moe import routed_experts

    class Unready:
        @property
        def no_lora(self):
            raise RuntimeError("punica metadata not initialised")

    class Context:
        punica_wrapper = Unready()

    obj = routed_experts.AscendRoutedExperts.__new__(routed_experts.AscendRoutedExperts)
    nn.Module.__init__(obj)
    obj.__dict__["_ascend_moe_lora_context"] = Context()
    return obj.forward_impl(hidden_states=None, router_logits=None)


CASE = Case(
    patch_id="ascend-moe-skip-idle-lora",
    affected=[V023, V026, V030, FALLBACK],
    skipped=[
        (Env("ascend-0.22.1rc1-vllm-0.22.1", lambda: paths("0.22.1rc1"), preload=deps_preload), "skipped:version",
         "outside"),
        # The unquantized LoRA branch gated on the batch's LoRA tokens upstream: skipped as fixed, by feature.
        (Env.edited("ascend-0.26.0rc1-unquant-gated", V026, MLP, "    if lora_context is not None:  # LoRA applied",
                    "    if lora_context is not None and not lora_context.punica_wrapper.no_lora:  # LoRA applied"),
         "skipped:version", "moe_mlp.unquant_apply_mlp already gates"),
        (Env.edited("ascend-0.30.0rc2-apply-gmm1-gated", V030, RE, "        if lora_context is not None:  # LoRA applied",
                    "        if has_lora(lora_context):  # LoRA applied"),
         "skipped:version", "AscendUnquantizedFusedMoEMethod.apply_gmm1 already gates"),
    ],
    source_built=[
        *((_as(release, version), "applied", f"vllm-ascend {version} is a source build")
          for release in ("0.26.0rc1", "0.30.0rc2") for version in SOURCE_BUILDS),
        *((_as("0.30.0rc2", version), "applied", "decided by code features (AscendRoutedExperts.forward_impl")
          for version in SOURCE_BUILDS[:1]),
        # The same files with a release number keep the version rule ...
        (_as("0.30.0rc2", "0.19.1rc1"), "skipped:version", "vllm-ascend 0.19.1rc1 is outside >=0.23.0"),
        # ... and an explicit version wins over both the number and the code features.
        (_as("0.30.0rc2", SOURCE_BUILDS[0], **{ASSUME: "vllm-ascend=0.22.0"}), "skipped:version",
         "vllm-ascend 0.22.0 assumed (OMNI_PATCHES_ASSUME_VERSION; installed 0.19.1rc2.dev1637+g182b75ea8)"),
        (_as("0.30.0rc2", "0.19.1rc1", **{ASSUME: "vllm-ascend=0.30.0rc2"}), "applied",
         "vllm-ascend 0.30.0rc2 assumed"),
    ],
    unexpected=[Unexpected(V030, _unreadable_punica_wrapper, note="punica_wrapper.no_lora / is_prefill raised")],
    drifted=[
        (Env.edited("ascend-0.26.0rc1-runner-and-mlp-renamed", FALLBACK, MLP, "    lora_context=None,\n",
                    "    moe_lora_context=None,\n"), "no runner method matches"),
        (Env.edited("ascend-0.30.0rc2-forward-renamed", V030, RE, "    def forward_impl(\n        self,\n        *,",
                    "    def routed_forward_impl(\n        self,\n        *,"), "AscendRoutedExperts has neither"),
    ],
)


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here; the words are omni_patches.tools.audit's).
VERDICTS = {
    "vllm-omni==0.22.0": "absent", "vllm-omni==0.24.0": "absent", "vllm-omni==0.28.0": "absent",
    "vllm-omni==0.30.0": "absent", "vllm-omni==0.32.0rc1": "absent", "vllm-ascend==0.9.1": "skip: out of range",
    "vllm-ascend==0.9.2rc1": "skip: out of range", "vllm-ascend==0.18.0rc1": "skip: out of range",
    "vllm-ascend==0.22.1rc1": "skip: out of range", "vllm-ascend==0.23.0rc1": "would apply",
    "vllm-ascend==0.23.0.post1": "would apply", "vllm-ascend==0.24.0rc1": "would apply",
    "vllm-ascend==0.26.0rc1": "would apply", "vllm-ascend==0.27.1rc1": "would apply",
    "vllm-ascend==0.30.0rc2": "would apply",
}
