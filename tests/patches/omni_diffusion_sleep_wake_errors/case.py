"""Contract case for omni-diffusion-sleep-wake-errors: the REAL async_omni.py of each release (support.omni_sleep_sandbox).

Affected: every release from 0.28.0rc1 (the first with _sleep_diffusion / _wake_diffusion) to 0.30.0, the last before #7811.
"""
from omni_patches.testing import Case, Env, Unexpected
from support.omni_cases import sandboxes, skipped, source_built
from support.omni_sleep_sandbox import paths

AFFECTED = ["0.28.0rc1", "0.28.0", "0.29.0rc1", "0.30.0rc1", "0.30.0"]
ASYNC_OMNI = "vllm_omni/entrypoints/async_omni.py"


sandbox = sandboxes(paths)
BASE = sandbox("0.30.0")


def _sleep_answered_true():
    """A diffusion stage answering the sleep RPC with a bare ``True`` (not an ACK): stock returns it as is."""
    import asyncio

    from patches.omni_diffusion_sleep_wake_errors.sleep_wake_child import build
    from vllm_omni.entrypoints import async_omni

    async def run():
        omni, _ = build(async_omni, ["diffusion"], lambda task, sid: True)
        acks = await omni.sleep(level=1)
        return [acks, await omni.is_sleeping(), omni._paused]

    return asyncio.run(run())


CASE = Case(
    patch_id="omni-diffusion-sleep-wake-errors",
    affected=[sandbox(v) for v in AFFECTED],
    skipped=skipped(
        sandbox, "0.30.0", "OMNI_PATCHES_OMNI_DIFFUSION_SLEEP_WAKE_ERRORS",
        # Upstream's fix found by feature although the version says 0.30.0 (a vendor backport).
        backport=(ASYNC_OMNI, "    async def _sleep_diffusion(",
                  "    @classmethod\n    def _raise_on_diffusion_errors(cls, method, acks):\n        return None\n\n"
                  "    async def _sleep_diffusion("),
        # 0.27.0rc1 reads the ACKs inline in sleep() / wake_up() (no _sleep_diffusion): outside the range.
        outside="0.27.0rc1"),
    source_built=source_built(sandbox, "0.30.0", "0.30.1.dev4+g1a2b3c4d", fixed="0.31.0rc1"),
    drifted=[
        (Env.edited("omni-0.30.0-renamed", BASE, ASYNC_OMNI, "    async def _wake_diffusion(",
                    "    async def _wake_diffusion_stages("), "no attribute '_wake_diffusion'"),
        (Env.edited("omni-0.30.0-new-signature", BASE, ASYNC_OMNI,
                    "    async def _sleep_diffusion(self, stage_ids: list[int], level: int)",
                    "    async def _sleep_diffusion(self, stage_ids: list[int], mode: int)"), "no parameter(s) level"),
    ],
    unexpected=[Unexpected(BASE, _sleep_answered_true,
                           note="a diffusion stage answered with something that is neither an ACK nor a dict")],
)


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here; the words are omni_patches.tools.audit's).
VERDICTS = {
    "vllm-omni==0.24.0": "skip: out of range", "vllm-omni==0.28.0": "would apply",
    "vllm-omni==0.30.0": "would apply", "vllm-omni==0.32.0rc1": "skip: fixed upstream",
    "vllm-omni==0.31.0rc1": "skip: fixed upstream", "vllm-omni==0.28.0rc1": "would apply",
    "vllm-omni==0.27.0rc1": "skip: out of range",
}
