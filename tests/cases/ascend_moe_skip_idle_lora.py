"""Contract case for ascend-moe-skip-idle-lora: REAL vllm-ascend 0.23.0.post1 MoE files (torch_npu stubbed)."""
from support.contract import Case, Env
from support.moe_sandboxes import VLLM_ENV, ascend_dir

FM_023 = "vllm_ascend/ops/fused_moe/fused_moe_0_23_0.py"
FM = "vllm_ascend/ops/fused_moe/fused_moe.py"
MLP = "vllm_ascend/ops/fused_moe/moe_mlp.py"
V023 = Env("ascend-0.23.0.post1", lambda: [str(ascend_dir())])  # vLLM 0.23: AscendFusedMoE.forward_impl
V024 = Env("ascend-0.23.0.post1-vllm-0.24", lambda: [str(ascend_dir())],  # in-file AscendMoERunner (v0.24-0.26)
           env={VLLM_ENV: "0.24.0"})
RUNNER_RENAMED = Env.edited("ascend-0.23-runner-renamed", V023, FM_023,
                            "    def forward_impl(  # type: ignore[override]",
                            "    def forward_impl_v2(  # type: ignore[override]",
                            # the fallback changes moe_mlp, which is no target: snapshot it too
                            imports=["vllm_ascend.ops.fused_moe.fused_moe", "vllm_ascend.ops.fused_moe.moe_mlp"])

CASE = Case(
    patch_id="ascend-moe-skip-idle-lora",
    affected=[
        V023,
        V024,
        # No runner method matches: the narrow fallback on moe_mlp.unquant_apply_mlp applies instead.
        RUNNER_RENAMED,
    ],
    skipped=[
        (Env("ascend-0.22.0", lambda: [str(ascend_dir(metadata_version="0.22.0"))]), "skipped:version", "outside"),
    ],
    drifted=[
        (Env.edited("ascend-0.23-runner-and-mlp-renamed", RUNNER_RENAMED, MLP,
                    "    lora_context=None,\n", "    moe_lora_context=None,\n"), "no runner method matches"),
        (Env.edited("ascend-0.24-runner-and-mlp-renamed",
                    Env.edited("ascend-0.24-runner-renamed", V024, FM,
                               "def no_shared_forward_impl(", "def routed_forward_impl("),
                    MLP, "    lora_context=None,\n", "    moe_lora_context=None,\n"), "no runner method matches"),
    ],
)
