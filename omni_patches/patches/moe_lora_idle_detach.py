"""moe-lora-idle-detach: detach the MoE-LoRA context from Ascend MoE runners while no adapter is active

Why:         vllm-omni 0.32.0rc1's DiffusionLoRAManager leaves the MoE-LoRA context attached to every MoE
             runner once an adapter has been used (after deactivation, idle max-rank growth, a failed
             activation, remove_adapter() and close()). Ascend's unquantized MoE path then runs the LoRA work
             for a zero delta on every MoE layer of every step: HunyuanImage-3 tp2_cfgp2 e2e 5.43 s -> 7.90 s.
             GPU is unaffected.
Upstream:    https://github.com/vllm-project/vllm-omni (no fix published; report against
             vllm_omni/diffusion/lora/manager.py) and https://github.com/vllm-project/vllm-ascend/pull/10977
             (the Ascend MoE-LoRA path that runs whenever a context is present)
Affected:    vllm-omni >=0.32.0rc1; vllm-ascend >=0.23.0rc1 (the first manager with MoE LoRA, on the only runners
             that take a MoE-LoRA context: without vllm-ascend there is nothing to act on, skipped:absent); gated
             on features as well: the manager must have _publish_moe_lora_context and no detach logic of its own
How:         wrapt wrappers on the manager's lifecycle methods (__init__, set_active_adapter, add_adapter,
             remove_adapter, close and the internals they call). When the outermost of them returns (or
             raises), one sync restores the post-condition: no adapter active (or closed) ->
             set_lora_context(None) on every MoE runner that has a callable set_lora_context; an adapter
             active after a detach -> set_mapping(punica) on those wrappers again. Runners without
             set_lora_context (GPU) are never touched; nothing runs per forward. ``status`` notes what the runners
             let it do (or why a manager's MoE-LoRA layers give it nothing to act on). Details: docs/patches.md.
Remove when: vllm-omni detaches the MoE-LoRA context itself while no adapter is active (or vllm-ascend skips the
             LoRA work per forward on every supported release) and 0.32.0rc1 is no longer supported
"""
import functools
import logging
import re
import sys
import weakref

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    # vllm-ascend: only its MoE runners take a MoE-LoRA context
    "requires": {"vllm-omni": ">=0.32.0rc1", "vllm-ascend": ">=0.23.0rc1"},
    "targets": ["vllm_omni.diffusion.lora.manager"],
}

# Every method whose return may change whether an adapter is active or which wrappers exist.
LIFECYCLE = (
    "__init__", "set_active_adapter", "add_adapter", "remove_adapter", "close",
    "_activate_adapter", "_deactivate_all_adapters", "_ensure_max_lora_rank", "_replace_layers_with_lora",
)
# Used by the sync (not wrapped): the feature gate.
REQUIRED = ("_publish_moe_lora_context", "_get_moe_punica_wrapper")
# A manager that already detaches by itself is fixed upstream.
_OWN_DETACH = re.compile(r"(detach|unpublish|clear|withdraw|retract|drop)_moe_lora_context")
_STATE = "_omni_patches_moe_idle"  # per-manager [depth, detached, {id: wrapper seen during the call}]
_LOG = logging.getLogger("omni_patches")
PATCH_ID = "moe-lora-idle-detach"
# status note (key "runners"): what this process's MoE runners let the patch do.
NO_CONTEXT_RUNNER = ("nothing to act on: this manager's {n} MoE-LoRA layer(s) run on MoE runners without "
                     "set_lora_context (vLLM's; only vllm-ascend's take a MoE-LoRA context)")
ACTS_ON = "acts on {n} MoE runner(s) that take a MoE-LoRA context"



def check(ctx):
    cls = ctx.resolve("DiffusionLoRAManager")
    if not _has_moe_lora(ctx.module):
        ctx.not_affected("DiffusionLoRAManager publishes no MoE-LoRA context (no _publish_moe_lora_context, "
                         "_moe_punica_wrapper or moe_lora in vllm_omni.diffusion.lora.manager): it predates MoE "
                         "LoRA (vllm-omni 0.32.0rc1)")
    for name in LIFECYCLE + REQUIRED:
        ctx.resolve(f"DiffusionLoRAManager.{name}")
    own = sorted(n for n in vars(cls) if _OWN_DETACH.search(n))
    if own:
        ctx.fixed_upstream(f"DiffusionLoRAManager already has {', '.join(own)}")
    try:
        import inspect

        source = inspect.getsource(cls)
    except (OSError, TypeError):
        source = ""
    if "set_lora_context(None" in source:
        ctx.fixed_upstream("DiffusionLoRAManager already calls set_lora_context(None)")


def _has_moe_lora(module):
    """Does the manager module know MoE LoRA at all? (Unreadable source: assume it does -- drift stays drift.)"""
    import inspect

    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return True
    return any(m in source for m in ("_publish_moe_lora_context", "_moe_punica_wrapper", "moe_lora"))


def apply(ctx):
    ctx.describe(f"DiffusionLoRAManager lifecycle: {', '.join(LIFECYCLE)} (0.32.0rc1 layout)")
    run = ctx.run
    detached = run.data.setdefault("detached", weakref.WeakSet())  # managers whose runners we left without one
    ctx.on_undo(functools.partial(_republish_all, detached))
    for name in LIFECYCLE:
        ctx.wrap("DiffusionLoRAManager", name, functools.partial(_lifecycle, run))


def _moe_wrappers(mgr, counted=None):
    """MoE LoRA wrappers whose runner takes a context via ``set_lora_context`` (Ascend-like); ``counted`` (a
    list) also gets every MoE LoRA wrapper, with or without one."""
    mod = sys.modules.get("vllm.lora.layers.fused_moe")
    moe_cls = getattr(mod, "FusedMoEWithLoRA", None)
    out = []
    for layer in list((getattr(mgr, "_lora_modules", None) or {}).values()):
        if moe_cls is not None and not isinstance(layer, moe_cls):
            continue
        if counted is not None and moe_cls is not None:
            counted.append(layer)
        if callable(getattr(getattr(layer, "base_layer", None), "set_lora_context", None)):
            out.append(layer)
    return out


def _lifecycle(run, wrapped, instance, args, kwargs):
    if instance is None:  # called through the class with an explicit self: nothing to track
        return wrapped(*args, **kwargs)
    state = instance.__dict__.get(_STATE)
    if state is None:
        state = instance.__dict__[_STATE] = [0, False, {}]
    try:
        for w in _moe_wrappers(instance):  # close() and rollbacks drop wrappers: remember them
            state[2][id(w)] = w
    except Exception:
        pass
    state[0] += 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        state[0] -= 1
        if state[0] == 0:
            _sync(run, instance, state)


def _sync(run, mgr, state):
    try:
        moe_layers = []
        current = _moe_wrappers(mgr, moe_layers)
        if current:
            run.note(ACTS_ON.format(n=len(current)), key="runners")
        elif moe_layers and not state[2]:
            run.note(NO_CONTEXT_RUNNER.format(n=len(moe_layers)), key="runners")
        seen = {**state[2], **{id(w): w for w in current}}
        state[2] = {}
        active = getattr(mgr, "_active_adapter_id", None) is not None and not getattr(mgr, "_closed", False)
        if not active:
            for w in seen.values():
                w.base_layer.set_lora_context(None)
            if seen:
                state[1] = True
                run.data["detached"].add(mgr)
        elif state[1]:
            if current:
                punica = mgr._get_moe_punica_wrapper()
                for w in current:
                    w.set_mapping(punica)
            state[1] = False
            run.data["detached"].discard(mgr)
    except Exception as exc:  # never break the host's LoRA call for a reason of ours: it stays as stock left it
        if run.count(("warned", type(mgr).__qualname__)) == 1:
            _LOG.warning("moe-lora-idle-detach: could not sync the MoE-LoRA context", exc_info=True)
        run.fallback(f"could not sync the MoE-LoRA context ({type(exc).__name__}); the runners keep what the "
                     "manager left")


def _republish_all(detached):
    """Undo: give live managers back the contexts we detached (stock behaviour keeps them attached)."""
    for mgr in list(detached):
        state = mgr.__dict__.get(_STATE)
        try:
            wrappers = _moe_wrappers(mgr)
            if wrappers and not getattr(mgr, "_closed", False):
                punica = mgr._get_moe_punica_wrapper()
                for w in wrappers:
                    w.set_mapping(punica)
        except Exception:
            _LOG.warning("moe-lora-idle-detach: could not republish on undo", exc_info=True)
        if state is not None:
            state[1] = False
    detached.clear()
