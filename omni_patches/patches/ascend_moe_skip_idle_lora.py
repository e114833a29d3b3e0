"""ascend-moe-skip-idle-lora: skip the MoE-LoRA work on the Ascend MoE runner when the batch has no LoRA token

Why:         vllm-ascend's unquantized MoE path runs the LoRA branch whenever a context is attached
             (``lora_context is not None``): routing recovery (argsort), the LoRA index all_to_all and both
             LoRA kernels, even for a batch in which no token uses an adapter. Every LoRA-enabled server pays
             it on every MoE layer of every batch without LoRA tokens.
Upstream:    https://github.com/vllm-project/vllm-ascend/pull/10977 (the unquantized MoE-LoRA branch, keyed
             on ``lora_context is not None``) and https://github.com/vllm-project/vllm-ascend/pull/13365
             (upstream's own gate, ``has_lora(ctx)``: quantized MoE path only). This patch is that gate,
             applied to the unquantized path, trusting ``no_lora`` only where it is fresh.
Affected:    vllm-ascend >=0.23.0rc1 (every release on PyPI from the first with the MoE-LoRA branch, 0.23.0rc1,
             to 0.30.0rc2; dev/rc/source builds included). Skipped as fixed upstream by feature when the
             runner method or the unquantized LoRA branch checks ``has_lora``/``no_lora`` itself.
How:         per forward, the runner method runs with the context hidden (restored in ``finally``) only while
             ``punica_wrapper.no_lora`` is True AND known fresh: the wrapper class recomputes it on every update
             (vllm-ascend 0.27.1rc1+ ``PunicaWrapperNPU``), or it is vLLM's prefill-only kind and the last
             mapping was a prefill (``is_prefill``); a stale ``no_lora`` would drop LoRA silently. Host bools
             only: no device sync, graph capture unaffected. Wrap point by feature: 0.27.1rc1+
             ``AscendRoutedExperts.forward_impl``; 0.24.0rc1-0.26.0rc1 ``AscendMoERunner.no_shared_forward_impl``;
             0.23.x ``AscendFusedMoE.forward_impl``; fallback ``moe_mlp.unquant_apply_mlp``, replaced
             (``ctx.replace``) by a plain function with the original's exact signature. An idle diffusion
             adapter is ``moe-lora-idle-detach``'s job; the two compose. Details: docs/patches.md.
Remove when: vllm-ascend gates the unquantized MoE-LoRA branch on ``has_lora(ctx)`` (with a fresh ``no_lora``)
             in every release this project supports
"""
import functools
import importlib
import importlib.util
import inspect
import sys

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    "requires": {"vllm-ascend": ">=0.23.0rc1"},
    "targets": ["vllm_ascend.ops.fused_moe.routed_experts", "vllm_ascend.ops.fused_moe.fused_moe"],
}

PATCH_ID = "ascend-moe-skip-idle-lora"
KEY = "_ascend_moe_lora_context"
_PKG = "vllm_ascend.ops.fused_moe"
ROUTED_EXPERTS = f"{_PKG}.routed_experts"
FUSED_MOE = f"{_PKG}.fused_moe"
MOE_MLP = f"{_PKG}.moe_mlp"

# How a punica wrapper class keeps ``no_lora`` (see freshness).
ALWAYS = "recomputed on every update"
PREFILL = "recomputed for prefill mappings only"
NEVER = "not recomputed by update_metadata"
_KINDS = {}  # wrapper class -> ALWAYS | PREFILL | NEVER (learnt at first sight)

# Where the method finds the dict that holds the context (both are plain instance attributes; reading
# __dict__ directly avoids nn.Module.__getattr__, which costs ~0.3 us when the attribute is absent).
_ON_SELF = "    _d = {self}.__dict__\n"
_ON_ROUTED = ("    _rx = {self}._modules.get('routed_experts')\n"
              "    if _rx is None:\n"
              "        _rx = getattr({self}, 'routed_experts', None)\n"
              "    _d = _rx.__dict__ if _rx is not None else _EMPTY\n")

# ``no_lora is True`` first: a LoRA batch pays one attribute read more than stock, nothing else.
_IDLE = """
        try:
            _pw = {lc}.punica_wrapper
            if _pw.no_lora is True:
                _k = _KINDS.get(_pw.__class__)
                if _k is None:
                    _k = _learn(_pw.__class__)
                _idle = _k is _ALWAYS or (_k is _PREFILL and _pw.is_prefill is True)
            else:
                _idle = False
        except AttributeError:
            _idle = False
        except Exception:  # a wrapper this was not built for: stock's branch decides
            _idle = False
            _unreadable()
"""

_BODY = """
    _lc = _d.get(_KEY)
    if _lc is not None:{idle}
        if _idle:
            _d[_KEY] = None
            try:
                return _orig({call})
            finally:
                if _d.get(_KEY) is None:  # set_lora_context() may have run meanwhile: keep the new one
                    _d[_KEY] = _lc
    return _orig({call})
"""

# The fallback hides the argument instead of the attribute.
_ARG_BODY = """
    if {arg} is not None:{idle}
        if _idle:
            {arg} = None
    return _orig({call})
"""


def _attr_ops(func):
    """(attribute names stored, attribute names loaded) by ``func``'s own bytecode."""
    import dis

    stores, loads = set(), set()
    for ins in dis.get_instructions(func):
        if ins.opname == "STORE_ATTR":
            stores.add(ins.argval)
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            loads.add(ins.argval)
    return stores, loads


def freshness(cls):
    """ALWAYS, PREFILL or NEVER for a punica wrapper class, read from the ``update_metadata`` it runs.

    ALWAYS: it stores ``no_lora`` without looking at ``is_prefill`` (vllm-ascend 0.27.1rc1+ PunicaWrapperNPU).
    PREFILL: it stores ``is_prefill`` and calls ``_update_prefill_metadata``, which stores ``no_lora`` (vLLM's
    PunicaWrapperBase). An override that only delegates to ``super()`` is looked through. Anything else (vLLM's
    GPU wrapper sets ``is_prefill`` but never ``no_lora``) is NEVER: its flag is not trusted.
    """
    for klass in cls.__mro__:
        func = vars(klass).get("update_metadata")
        if func is None:
            continue
        if not inspect.isfunction(func):
            return NEVER
        stores, loads = _attr_ops(func)
        if "no_lora" in stores:
            return ALWAYS if "is_prefill" not in stores | loads else NEVER
        if "is_prefill" in stores and "_update_prefill_metadata" in loads:
            prefill = getattr(cls, "_update_prefill_metadata", None)
            return PREFILL if inspect.isfunction(prefill) and "no_lora" in _attr_ops(prefill)[0] else NEVER
        if "update_metadata" in loads and "is_prefill" not in stores:
            continue  # super().update_metadata(...) plus its own extras
        return NEVER
    return NEVER


def _learn(run, cls):
    """Classify (once per class, at the first idle-looking forward) and say so in the patch's status."""
    try:
        kind = freshness(cls)
    except Exception:  # never raise into the forward for our own reasons
        kind = NEVER
    _KINDS[cls] = kind
    run.note(f"punica wrapper {cls.__module__}.{cls.__qualname__}: no_lora {kind}",
             key=f"punica:{cls.__module__}.{cls.__qualname__}")
    return kind


def _signature_parts(func):
    """(def parameter list, call argument list, defaults namespace) reproducing ``func``'s signature."""
    params, call, ns = [], [], {}
    kinds = inspect.Parameter
    prev = None
    for i, p in enumerate(inspect.signature(func).parameters.values()):
        if prev is kinds.POSITIONAL_ONLY and p.kind is not kinds.POSITIONAL_ONLY:
            params.append("/")
        if p.kind is kinds.KEYWORD_ONLY and prev not in (kinds.KEYWORD_ONLY, kinds.VAR_POSITIONAL):
            params.append("*")
        text = p.name
        if p.default is not p.empty:
            ns[f"_d{i}"] = p.default
            text += f"=_d{i}"
        if p.kind is kinds.VAR_POSITIONAL:
            params.append("*" + text)
            call.append("*" + p.name)
        elif p.kind is kinds.VAR_KEYWORD:
            params.append("**" + text)
            call.append("**" + p.name)
        elif p.kind is kinds.KEYWORD_ONLY:
            params.append(text)
            call.append(f"{p.name}={p.name}")
        else:
            params.append(text)
            call.append(p.name)
        prev = p.kind
    if prev is kinds.POSITIONAL_ONLY:
        params.append("/")
    return ", ".join(params), ", ".join(call), ns


def _unreadable(run):
    run.fallback("reading the context's punica_wrapper.no_lora / is_prefill raised: the forward ran with the "
                 "context, as stock")


def _compile(original, body, ns, run):
    """``run``: the patch's record (``ctx.run``; a benchmark or a test calling a builder directly passes a
    standalone one) that notes and fallbacks go to."""
    ns.update(_orig=original, _KINDS=_KINDS, _learn=functools.partial(_learn, run), _ALWAYS=ALWAYS, _PREFILL=PREFILL,
              _unreadable=functools.partial(_unreadable, run))
    exec(compile(body, f"<omni-patches {PATCH_ID} {original.__qualname__}>", "exec"), ns)
    return ns[original.__name__]


def make_skip(original, holder, run):
    """A plain function with ``original``'s exact signature that hides a fresh-idle context (holder: self|routed)."""
    params, call, ns = _signature_parts(original)
    self_name = next(iter(inspect.signature(original).parameters))
    head = (_ON_SELF if holder == "self" else _ON_ROUTED).format(self=self_name)
    body = _BODY.format(call=call, idle=_IDLE.format(lc="_lc"))
    ns.update(_KEY=KEY, _EMPTY={})
    return _compile(original, f"def {original.__name__}({params}):\n{head}{body}", ns, run)


def make_arg_skip(original, run, arg="lora_context"):
    params, call, ns = _signature_parts(original)
    body = _ARG_BODY.format(arg=arg, call=call, idle=_IDLE.format(lc=arg))
    return _compile(original, f"def {original.__name__}({params}):\n{body}", ns, run)


def make_forwarder(original, run):
    """A plain function with ``original``'s exact signature that only calls it, built as the skips are: the floor
    under them (bench/moe_idle.py)."""
    params, call, ns = _signature_parts(original)
    return _compile(original, f"def {original.__name__}({params}):\n    return _orig({call})\n", ns, run)


def _method(ctx, cls_path, name, root=None):
    """The plain function stored for ``cls.name`` (own or inherited), or None."""
    if not ctx.has(cls_path, root):
        return None
    cls = ctx.resolve(cls_path, root)
    if not isinstance(cls, type):
        return None
    for klass in cls.__mro__:
        if name in vars(klass):
            func = vars(klass)[name]
            return func if inspect.isfunction(func) else None
    return None


def _takes(func, *names, kw_only=False):
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
    if not all(n in params for n in names):
        return False
    return not kw_only or all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in names)


def _runner_layout(ctx):
    """(owner, method name, holder, what was found) for the runner method in ctx.module, or None."""
    if ctx.target == ROUTED_EXPERTS:
        func = _method(ctx, "AscendRoutedExperts", "forward_impl")
        if func is not None and _takes(func, "hidden_states", "router_logits", kw_only=True):
            return ("AscendRoutedExperts", "forward_impl", "self",
                    "AscendRoutedExperts.forward_impl (v0.27.1rc1+ layout, context on the routed experts)")
        func = _method(ctx, "AscendRoutedExperts", "no_shared_forward_impl")
        if func is not None and _takes(func, "hidden_states", "router_logits"):
            return ("AscendRoutedExperts", "no_shared_forward_impl", "self",
                    "AscendRoutedExperts.no_shared_forward_impl (intermediate main layout)")
        return None
    func = _method(ctx, "AscendMoERunner", "no_shared_forward_impl")
    setter = _method(ctx, "AscendMoERunner", "set_lora_context")
    if func is not None and setter is not None and _takes(func, "hidden_states", "router_logits") \
            and "routed_experts" in _source(setter):
        return ("AscendMoERunner", "no_shared_forward_impl", "routed",
                "AscendMoERunner.no_shared_forward_impl (v0.24-v0.26 layout, context on routed_experts)")
    func = _method(ctx, "AscendFusedMoE", "forward_impl")
    setter = _method(ctx, "AscendFusedMoE", "set_lora_context")
    if func is not None and setter is not None and _takes(func, "hidden_states", "router_logits", "return_with_event"):
        return "AscendFusedMoE", "forward_impl", "self", "AscendFusedMoE.forward_impl (v0.23 layout, vLLM 0.23)"
    return None


def _source(func):
    try:
        return inspect.getsource(func)
    except (OSError, TypeError):
        return ""


def _mlp_module():
    """moe_mlp if this vllm-ascend has it (imported on demand: the fallback only)."""
    try:
        if importlib.util.find_spec(MOE_MLP) is None:
            return None
    except (ImportError, ValueError):
        return None
    return importlib.import_module(MOE_MLP)


# What the bug lives in: the MoE-LoRA context and its branch (vllm-ascend #10977). Code without any of these
# names in its fused-MoE files predates the bug (vllm-ascend <= 0.22.1rc1); code with any of them that no
# layout above matches has drifted.
_MOE_LORA_MARKERS = ("lora_context", "moe_lora_apply", "punica_wrapper")


def _module_source(module):
    if module is None:
        return None
    try:
        return inspect.getsource(module)
    except (OSError, TypeError):
        return None


def _predates_moe_lora(*modules):
    """True when every given fused-MoE module's source is readable and none names the MoE-LoRA context; False
    when one does, or when a source cannot be read (then nobody can tell: drift, the safe answer)."""
    texts = [_module_source(m) for m in modules if m is not None]
    if not texts or any(t is None for t in texts):
        return False
    return not any(marker in t for t in texts for marker in _MOE_LORA_MARKERS)


def _gates_on_lora_tokens(func):
    """Does ``func`` itself decide on the batch's LoRA tokens (``has_lora(...)`` / ``.no_lora``)?"""
    text = _source(func)
    if text:
        return "has_lora(" in text or ".no_lora" in text
    code = getattr(func, "__code__", None)
    return code is not None and bool({"has_lora", "no_lora"} & set(code.co_names))


def _unquant_lora_branches(ctx):
    """The functions holding the unquantized MoE-LoRA branch in this release (those that call
    moe_lora_apply_w13): moe_mlp.unquant_apply_mlp (0.23-0.27), AscendUnquantizedFusedMoEMethod.apply_gmm1 (0.28+)."""
    found = []
    func = getattr(sys.modules.get(MOE_MLP), "unquant_apply_mlp", None)
    if inspect.isfunction(func):
        found.append(("moe_mlp.unquant_apply_mlp", func))
    func = _method(ctx, "AscendUnquantizedFusedMoEMethod", "apply_gmm1")
    if func is not None:
        found.append(("AscendUnquantizedFusedMoEMethod.apply_gmm1", func))
    return [(name, f) for name, f in found if "moe_lora_apply_w13" in _source(f)] or found


def check(ctx):
    if ctx.target not in (ROUTED_EXPERTS, FUSED_MOE):
        return
    layout = _runner_layout(ctx)
    if layout is not None and _gates_on_lora_tokens(_method(ctx, layout[0], layout[1])):
        ctx.fixed_upstream(f"{layout[0]}.{layout[1]} already checks has_lora/no_lora")
    for name, func in _unquant_lora_branches(ctx):
        if _gates_on_lora_tokens(func):
            ctx.fixed_upstream(f"{name} already gates the unquantized MoE-LoRA branch on has_lora/no_lora")


def apply(ctx):
    if ctx.target not in (ROUTED_EXPERTS, FUSED_MOE):
        return  # not a module this patch knows (the registry lists only those two)
    layout = _runner_layout(ctx)
    if layout is not None:
        owner, name, holder, found = layout
        ctx.describe(found)
        ctx.replace(owner, name, lambda original: make_skip(original, holder, ctx.run))
        return
    if ctx.target == ROUTED_EXPERTS:
        ctx.drift("AscendRoutedExperts has neither forward_impl(*, hidden_states, router_logits, ...) nor "
                  "no_shared_forward_impl(hidden_states, router_logits, ...)")
    # fused_moe from 0.27.1rc1 on: the runner lives in routed_experts, which is its own target.
    try:
        if importlib.util.find_spec(ROUTED_EXPERTS) is not None:
            return
    except (ImportError, ValueError):
        pass
    mlp = _mlp_module()
    func = getattr(mlp, "unquant_apply_mlp", None)
    if inspect.isfunction(func) and _takes(func, "lora_context"):
        ctx.describe("moe_mlp.unquant_apply_mlp(lora_context=...) (fallback: no runner method matched)")
        ctx.replace(mlp, "unquant_apply_mlp", lambda original: make_arg_skip(original, ctx.run))
        return
    if _predates_moe_lora(ctx.module, mlp):
        ctx.not_affected("no MoE-LoRA context in vllm_ascend.ops.fused_moe (no lora_context, moe_lora_apply, "
                         "punica_wrapper): it predates the MoE-LoRA branch (vllm-ascend #10977, first released "
                         "in 0.23.0rc1)")
    ctx.drift("no runner method matches (AscendMoERunner.no_shared_forward_impl with the context on "
              "routed_experts, AscendFusedMoE.forward_impl(hidden_states, router_logits, return_with_event)) "
              "and moe_mlp.unquant_apply_mlp takes no lora_context")
