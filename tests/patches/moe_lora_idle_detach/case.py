"""Contract case for moe-lora-idle-detach: the REAL DiffusionLoRAManager of vllm-omni wheels (vLLM stand-ins)."""
from omni_patches.testing import Case, Env, Unexpected
from patches.moe_lora_idle_detach.moe_sandboxes import omni_manager_dir

MANAGER = "vllm_omni/diffusion/lora/manager.py"
OMNI_032 = Env("omni-0.32.0rc1", lambda: [str(omni_manager_dir("0.32.0rc1"))])



def _runner_refuses_none():
    """An Ascend-like runner whose set_lora_context rejects None: stock never detaches, so the manager works; the
    patch's sync fails there, and the manager's calls return as stock's do (the runner keeps its context)."""
    from patches.moe_lora_idle_detach import omni_manager as om

    import vllm_omni.diffusion.lora.manager as manager

    class KeepsContext(om.AscendLikeMoERunner):
        def set_lora_context(self, lora_context):
            if lora_context is None:
                raise TypeError("this runner keeps its MoE-LoRA context")
            super().set_lora_context(lora_context)

    pipe = om.FakePipeline({"/adapters/a": 8})
    runner = pipe.transformer.moe_ascend = KeepsContext()
    mgr = manager.DiffusionLoRAManager(pipe, om.torch.device("cpu"), om.torch.float32, max_num_batched_tokens=64)
    got = [mgr.set_active_adapter(om.LoRARequest("a", 1, "/adapters/a"), 1.0)]
    got.append(mgr.set_active_adapter(None))
    return [*got, mgr._active_adapter_id, runner.lora_context is not None, len(runner.lora_context_calls)]


CASE = Case(
    patch_id="moe-lora-idle-detach",
    affected=[OMNI_032],
    skipped=[
        # No MoE LoRA in the manager before 0.32.0rc1: the version gate says so before anything is imported.
        (Env("omni-0.31.0rc1", lambda: [str(omni_manager_dir("0.31.0rc1"))]), "skipped:version", "outside"),
        # The real 0.32.0rc1 manager without vllm-ascend (GPU, or this CPU): no runner takes a MoE-LoRA context.
        (Env("omni-0.32.0rc1-no-ascend", lambda: [str(omni_manager_dir("0.32.0rc1", ascend=None))]),
         "skipped:absent", "vllm-ascend is not installed"),
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
    unexpected=[Unexpected(OMNI_032, _runner_refuses_none, note="could not sync the MoE-LoRA context")],
    drifted=[
        (Env.edited("omni-0.32.0rc1-renamed", OMNI_032, MANAGER,
                    "def _ensure_max_lora_rank(", "def _ensure_max_lora_rank_v2("), "_ensure_max_lora_rank"),
        (Env.edited("omni-0.32.0rc1-no-publish", OMNI_032, MANAGER,
                    "def _publish_moe_lora_context(", "def _publish_lora_context("), "_publish_moe_lora_context"),
    ],
)


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here, alone; the words are omni_patches.tools.audit's). In range, the omni release alone
# lacks vllm-ascend: "absent"; with a real vllm-ascend beside it, "would apply" (test_audit.py's
# test_real_ascend_sdist_0_23_with_omni_0_32).
VERDICTS = {
    "vllm-omni==0.22.0": "skip: out of range", "vllm-omni==0.24.0": "skip: out of range",
    "vllm-omni==0.28.0": "skip: out of range", "vllm-omni==0.30.0": "skip: out of range",
    "vllm-omni==0.32.0rc1": "absent",
}
