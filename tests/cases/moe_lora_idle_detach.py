"""Contract case for moe-lora-idle-detach: the REAL DiffusionLoRAManager of vllm-omni wheels (vLLM stand-ins)."""
from support.contract import Case, Env
from support.moe_sandboxes import omni_manager_dir

MANAGER = "vllm_omni/diffusion/lora/manager.py"
OMNI_032 = Env("omni-0.32.0rc1", lambda: [str(omni_manager_dir("0.32.0rc1"))])

CASE = Case(
    patch_id="moe-lora-idle-detach",
    affected=[OMNI_032],
    skipped=[
        # No MoE LoRA in the manager before 0.32.0rc1: the version gate says so before anything is imported.
        (Env("omni-0.31.0rc1", lambda: [str(omni_manager_dir("0.31.0rc1"))]), "skipped:version", "outside"),
        # A manager that learned to detach by itself: found by feature, not by version.
        (Env.edited("omni-0.32.0rc1-own-detach", OMNI_032, MANAGER,
                    "    def _publish_moe_lora_context(self) -> None:",
                    "    def _detach_moe_lora_context(self) -> None:\n        pass\n\n"
                    "    def _publish_moe_lora_context(self) -> None:"),
         "skipped:version", "fixed upstream"),
    ],
    source_built=[
        (Env.source_build(OMNI_032, "vllm_omni-0.32.0rc1.dist-info/METADATA", "0.32.0rc1", "0.32.0rc2.dev40+gabcdef12"),
         "applied", "is a source build: decided by code features"),
        (Env.source_build(OMNI_032, "vllm_omni-0.32.0rc1.dist-info/METADATA", "0.32.0rc1", "0.0.0"), "applied",
         "decided by code features"),
    ],
    drifted=[
        (Env.edited("omni-0.32.0rc1-renamed", OMNI_032, MANAGER,
                    "def _ensure_max_lora_rank(", "def _ensure_max_lora_rank_v2("), "_ensure_max_lora_rank"),
        (Env.edited("omni-0.32.0rc1-no-publish", OMNI_032, MANAGER,
                    "def _publish_moe_lora_context(", "def _publish_lora_context("), "_publish_moe_lora_context"),
    ],
)
