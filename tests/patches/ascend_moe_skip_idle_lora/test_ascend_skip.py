"""ascend-moe-skip-idle-lora on the REAL files of every vllm-ascend release on PyPI, each with the REAL vLLM it
was built for (``support.ascend_real``), driven by REAL punica wrappers (``ascend_skip_child``).

Per release, one fresh interpreter: the shim activated before the first import, the wrap point it chose, the
method it replaced, and six mappings applied in turn to the release's ``PunicaWrapperNPU`` and to vLLM's
``PunicaWrapperCPU`` (``PunicaWrapperBase.update_metadata``), each followed by a forward of the real runner
method in three variants: stock, a gate on ``no_lora`` alone (the previous version of this patch) and the patch.
"""
from __future__ import annotations

import inspect
import json
import types

import pytest

from omni_patches.patches import ascend_moe_skip_idle_lora as patch
from omni_patches.runs import PatchRun
from support import ascend_real
from patches.ascend_moe_skip_idle_lora.ascend_skip_child import OMNI_ONLY, SEQUENCE

FM, RE = "vllm_ascend.ops.fused_moe.fused_moe", "vllm_ascend.ops.fused_moe.routed_experts"
V023 = dict(module=FM, cls="AscendFusedMoE", method="forward_impl", setter=FM + ".AscendFusedMoE", routed=False,
            found="AscendFusedMoE.forward_impl (v0.23 layout, vLLM 0.23)")
V024 = dict(module=FM, cls="AscendMoERunner", method="no_shared_forward_impl", setter=FM + ".AscendMoERunner",
            routed=True, found="AscendMoERunner.no_shared_forward_impl (v0.24-v0.26 layout, context on routed_experts)")
V027 = dict(module=RE, cls="AscendRoutedExperts", method="forward_impl", setter=FM + ".AscendMoERunner", routed=True,
            found="AscendRoutedExperts.forward_impl (v0.27.1rc1+ layout, context on the routed experts)")
# Every release on PyPI -> (layout, how its PunicaWrapperNPU keeps no_lora). 0.27.1rc1 brought vllm-ascend #13365:
# has_lora() (quantized path only) and an update_metadata that recomputes no_lora on every mapping.
LAYOUTS = {
    "0.23.0rc1": (V023, patch.PREFILL), "0.23.0": (V023, patch.PREFILL), "0.23.0.post1": (V023, patch.PREFILL),
    "0.24.0rc1": (V024, patch.PREFILL), "0.25.1rc1": (V024, patch.PREFILL), "0.26.0rc1": (V024, patch.PREFILL),
    "0.27.1rc1": (V027, patch.ALWAYS), "0.28.0rc1": (V027, patch.ALWAYS), "0.29.0rc1": (V027, patch.ALWAYS),
    "0.30.0rc1": (V027, patch.ALWAYS), "0.30.0rc2": (V027, patch.ALWAYS),
}
NPU, CPU, GPU = "ascend PunicaWrapperNPU", "vllm PunicaWrapperCPU", "vllm PunicaWrapperGPU"
STALE_STEP = "decode with adapter tokens after a no-LoRA prefill"
_MAPPINGS = {label: index for label, index, *_ in SEQUENCE + OMNI_ONLY}
_RESULTS: dict = {}


def test_every_pypi_release_is_covered():
    assert set(LAYOUTS) == set(ascend_real.RELEASES)


def _result(release):
    if release not in _RESULTS:
        case = {k: v for k, v in LAYOUTS[release][0].items() if k != "found"}
        _RESULTS[release] = ascend_real.run(
            release, "from patches.ascend_moe_skip_idle_lora.ascend_skip_child import main; main()",
            SKIP_CASE=json.dumps(case))
    return _RESULTS[release]


def _expect_hidden(kind, step):
    """The patch hides the context iff no token maps to an adapter AND no_lora is known fresh."""
    no_adapter_tokens = not any(_MAPPINGS[step["step"]])
    fresh = kind == patch.ALWAYS or (kind == patch.PREFILL and step["is_prefill"])
    return no_adapter_tokens and fresh


@pytest.mark.parametrize("release", sorted(LAYOUTS), scope="module")  # _result: once per release
def test_wrap_point_applied_with_the_exact_signature(release):
    layout, _ = LAYOUTS[release]
    out = _result(release)
    assert out["state"] == "applied", out["reason"]
    assert "found: " + layout["found"] in out["reason"], out["reason"]
    assert out["marker"] == "ascend-moe-skip-idle-lora" and out["same_signature"], out
    assert out["probe_point"], "the real method no longer starts with get_forward_context(): update the probe"


@pytest.mark.parametrize("release", sorted(LAYOUTS), scope="module")  # _result: once per release
def test_punica_wrapper_kinds(release):
    out = _result(release)
    assert out["kinds"][NPU] == LAYOUTS[release][1]
    assert out["kinds"][CPU] == patch.PREFILL  # PunicaWrapperBase.update_metadata
    assert out["kinds"][GPU] == patch.NEVER  # sets is_prefill, never no_lora
    assert f"PunicaWrapperNPU: no_lora {LAYOUTS[release][1]}" in out["final_reason"]  # the run-time note


@pytest.mark.parametrize("release", sorted(LAYOUTS), scope="module")  # _result: once per release
def test_per_forward_hides_only_a_fresh_idle_context(release):
    out = _result(release)
    kinds = out["kinds"]
    assert {NPU, CPU, NPU + " (omni only)", CPU + " (omni only)"} <= set(out["runs"]), out["wrapper_errors"]
    for wlabel, steps in out["runs"].items():
        kind = kinds[wlabel.replace(" (omni only)", "")]
        for step in steps:
            where = f"{release} {wlabel}: {step}"
            assert step["stock"] == "saw context", where  # stock never skips
            want = "context hidden" if _expect_hidden(kind, step) else "saw context"
            assert step["patched"] == want, where
            # Exceptions (every forward here raises) restore the context, in every variant.
            assert step["stock restored"] and step["naive restored"] and step["patched restored"], where
    # What the skip removes: a no-LoRA prefill (vLLM V1 maps every batch as prefill) hides it on every release.
    assert out["runs"][NPU][0]["patched"] == "context hidden"
    # vllm-omni's diffusion wrapper (index 1 for every token, is_prefill=False) never hides it: that idle adapter
    # is moe-lora-idle-detach's job.
    assert out["runs"][NPU + " (omni only)"][0]["patched"] == "saw context"


@pytest.mark.parametrize("release", sorted(LAYOUTS), scope="module")  # _result: once per release
def test_stale_no_lora_fools_a_gate_on_the_flag_alone(release):
    """A no-LoRA prefill, then a decode mapping WITH adapter tokens: vLLM's base wrapper keeps no_lora True."""
    out = _result(release)
    for wlabel in (NPU, CPU):
        step = next(s for s in out["runs"][wlabel] if s["step"] == STALE_STEP)
        if out["kinds"][wlabel] == patch.PREFILL:
            assert step["no_lora"] is True and step["is_prefill"] is False, step  # stale
            assert step["naive"] == "context hidden", step  # the previous patch dropped the LoRA delta here
        else:
            assert step["no_lora"] is False and step["naive"] == "saw context", step  # recomputed: fresh
        assert step["patched"] == "saw context", step


def test_0_30_0rc2_has_lora_gates_only_the_quantized_path():
    """0.30.0rc2 has upstream's has_lora(), but only in the quantized MLP branch: the patch still applies there."""
    root = ascend_real.release_dir("0.30.0rc2") / "vllm_ascend"
    mlp = (root / "ops/fused_moe/moe_mlp.py").read_text()
    assert "def has_lora(" in (root / "lora/fused_moe.py").read_text()
    assert "if mlp_compute_input.quant.is_quant and mlp_compute_input.lora_context is not None:" in mlp
    assert "has_lora(" not in (root / "ops/fused_moe/routed_experts.py").read_text()
    assert _result("0.30.0rc2")["state"] == "applied"


# --------------------------------------------------------------------------------------------------
# the generated forwarder itself (no upstream code needed)
# --------------------------------------------------------------------------------------------------
class _Wrapper:
    """Shaped like vLLM's PunicaWrapperBase: update_metadata recomputes no_lora only for prefill mappings."""

    def __init__(self):
        self.no_lora, self.is_prefill = False, False

    def update_metadata(self, mapping):
        if mapping.is_prefill:
            self._update_prefill_metadata(mapping)
            self.is_prefill = True
        else:
            self.is_prefill = False

    def _update_prefill_metadata(self, mapping):
        self.no_lora = not any(mapping.index_mapping)


def _ctx():
    return types.SimpleNamespace(punica_wrapper=_Wrapper())


def _idle(ctx):
    ctx.punica_wrapper.update_metadata(types.SimpleNamespace(is_prefill=True, index_mapping=(0, 0)))
    return ctx


def _run():
    """The record a builder's notes go to when a test calls it directly (the engine passes ``ctx.run``)."""
    return PatchRun.standalone(patch.PATCH_ID)


@pytest.mark.parametrize("sig", [
    "self, hidden_states, router_logits, return_with_event=False",
    "self, *, hidden_states, router_logits, input_ids=None",
    "self, hidden_states, /, router_logits, *args, flag=1, **kw",
])
def test_generated_forwarder_keeps_the_signature(sig):
    ns = {}
    exec(f"def forward_impl({sig}):\n    return self.__dict__.get('{patch.KEY}')", ns)
    skip = patch.make_skip(ns["forward_impl"], "self", _run())
    assert str(inspect.signature(skip)) == str(inspect.signature(ns["forward_impl"]))


def test_set_lora_context_during_the_forward_wins():
    class Runner:
        def forward_impl(self, hidden_states, router_logits):
            self.__dict__[patch.KEY] = new  # set_lora_context() from inside the forward
            return "ran"

    Runner.forward_impl = patch.make_skip(Runner.forward_impl, "self", _run())
    r, new = Runner(), _ctx()
    r.__dict__[patch.KEY] = _idle(_ctx())
    assert r.forward_impl(1, 2) == "ran" and r.__dict__[patch.KEY] is new


def test_unknown_wrapper_shapes_are_never_trusted():
    class NoRecompute:  # like vLLM's GPU wrapper: sets is_prefill, leaves no_lora alone
        def update_metadata(self, mapping):
            self.is_prefill = mapping.is_prefill

    class Conditional:  # recomputes no_lora, but only on some branch of is_prefill
        def update_metadata(self, mapping):
            if mapping.is_prefill:
                self.no_lora = True

    class Delegating(_Wrapper):  # super() plus extras that leave the flags alone
        def update_metadata(self, mapping):
            super().update_metadata(mapping)
            self.extra = 1

    assert patch.freshness(NoRecompute) == patch.NEVER
    assert patch.freshness(Conditional) == patch.NEVER
    assert patch.freshness(object) == patch.NEVER
    assert patch.freshness(_Wrapper) == patch.PREFILL
    assert patch.freshness(Delegating) == patch.PREFILL


def test_fallback_hides_the_argument_only_when_fresh():
    def unquant_apply_mlp(hidden_states, w1, lora_context=None):
        return lora_context

    skip = patch.make_arg_skip(unquant_apply_mlp, _run())
    idle, busy = _idle(_ctx()), _ctx()
    busy.punica_wrapper.update_metadata(types.SimpleNamespace(is_prefill=True, index_mapping=(1, 0)))
    assert skip(1, 2, lora_context=idle) is None
    assert skip(1, 2, lora_context=busy) is busy
    idle.punica_wrapper.update_metadata(types.SimpleNamespace(is_prefill=False, index_mapping=(1, 1)))
    assert idle.punica_wrapper.no_lora is True  # stale after a decode mapping with adapter tokens
    assert skip(1, 2, lora_context=idle) is idle
    assert skip(1, 2) is None
