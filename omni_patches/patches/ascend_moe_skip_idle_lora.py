"""ascend-moe-skip-idle-lora: skip the MoE-LoRA work on the Ascend MoE runner when the batch has no LoRA token

Fixes:       vllm-ascend's unquantized MoE path runs the LoRA branch whenever a context is attached
             (``lora_context is not None``): routing recovery (argsort), the LoRA index all_to_all and both
             LoRA kernels, even when ``punica_wrapper.no_lora`` says no token uses an adapter. The context is
             attached once, when the LoRA wrappers are created, so an idle adapter costs every MoE layer of
             every step (HunyuanImage-3 NPU: model.forward 3.79 -> 6.31 ms, e2e 5.43 -> 7.90 s).
Upstream:    https://github.com/vllm-project/vllm-ascend/pull/10977 (introduced the context check in
             unquant_apply_mlp; no skip on no_lora in any release yet)
Affected:    vllm-ascend >=0.23.0 (dev/rc builds of later lines included); not fixed upstream yet
How:         per forward, while ``lora_context.punica_wrapper.no_lora is True`` (a host bool: no device sync,
             token_lora_indices is never read, graph capture unaffected) the runner method runs with the
             context hidden and gets it back in ``finally`` (also when the forward raises). Wrap point by
             feature detection: main ``routed_experts.AscendRoutedExperts.forward_impl`` (keyword-only, an
             intermediate main ``no_shared_forward_impl``), context on self; v0.24-v0.26 (and the 0.23 sdist
             with a newer vLLM) ``fused_moe.AscendMoERunner.no_shared_forward_impl``, context on
             ``self.routed_experts``; v0.23 ``AscendFusedMoE.forward_impl``, context on self; narrow fallback
             ``moe_mlp.unquant_apply_mlp(lora_context=...)`` only when no runner method matches.
             Technique: ``ctx.replace`` with a plain function generated from the original's exact signature
             (this runs ~60 times per step). Measured (bench/moe_idle.py, CPU, Python 3.11, attribute lookup
             included, over the bare call; no context / LoRA tokens / idle context): exact signature
             +59/+96/+132 ns, ``*args, **kwargs`` replacement +103/+136/+198 ns, wrapt FunctionWrapper
             +481/+518/+577 ns (it builds a bound wrapper on every lookup). Only the first keeps the
             common paths inside the 150 ns budget; the idle path saves milliseconds of LoRA work.
             Undo and idempotency come from the engine's replace (``__omni_patch__`` marker, exact restore).
Remove when: vllm-ascend checks ``punica_wrapper.no_lora`` (or ``has_lora(ctx)``) before the LoRA branch in
             every release this project supports
"""
import importlib
import importlib.util
import inspect
import sys

KEY = "_ascend_moe_lora_context"
_PKG = "vllm_ascend.ops.fused_moe"
ROUTED_EXPERTS = f"{_PKG}.routed_experts"
FUSED_MOE = f"{_PKG}.fused_moe"
MOE_MLP = f"{_PKG}.moe_mlp"

# Where the method finds the dict that holds the context (both are plain instance attributes; reading
# __dict__ directly avoids nn.Module.__getattr__, which costs ~0.3 us when the attribute is absent).
_ON_SELF = "    _d = {self}.__dict__\n"
_ON_ROUTED = ("    _rx = {self}._modules.get('routed_experts')\n"
              "    if _rx is None:\n"
              "        _rx = getattr({self}, 'routed_experts', None)\n"
              "    _d = _rx.__dict__ if _rx is not None else _EMPTY\n")

_BODY = """
    _lc = _d.get(_KEY)
    if _lc is not None:
        try:
            _idle = _lc.punica_wrapper.no_lora is True
        except AttributeError:
            _idle = False
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
    if {arg} is not None:
        try:
            if {arg}.punica_wrapper.no_lora is True:
                {arg} = None
        except AttributeError:
            pass
    return _orig({call})
"""


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


def make_skip(original, holder):
    """A plain function with ``original``'s exact signature that hides the idle context (holder: self|routed)."""
    params, call, ns = _signature_parts(original)
    self_name = next(iter(inspect.signature(original).parameters))
    head = (_ON_SELF if holder == "self" else _ON_ROUTED).format(self=self_name)
    src = f"def {original.__name__}({params}):\n{head}{_BODY.format(call=call)}"
    ns.update(_orig=original, _KEY=KEY, _EMPTY={})
    exec(compile(src, f"<omni-patches ascend-moe-skip-idle-lora {original.__qualname__}>", "exec"), ns)
    return ns[original.__name__]


def make_arg_skip(original, arg="lora_context"):
    params, call, ns = _signature_parts(original)
    src = f"def {original.__name__}({params}):\n{_ARG_BODY.format(arg=arg, call=call)}"
    ns.update(_orig=original)
    exec(compile(src, f"<omni-patches ascend-moe-skip-idle-lora {original.__qualname__}>", "exec"), ns)
    return ns[original.__name__]


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
    """(owner, method name, holder, label) for the runner method in ctx.module, or None."""
    if ctx.target == ROUTED_EXPERTS:
        func = _method(ctx, "AscendRoutedExperts", "forward_impl")
        if func is not None and _takes(func, "hidden_states", "router_logits", kw_only=True):
            return "AscendRoutedExperts", "forward_impl", "self", "main"
        func = _method(ctx, "AscendRoutedExperts", "no_shared_forward_impl")
        if func is not None and _takes(func, "hidden_states", "router_logits"):
            return "AscendRoutedExperts", "no_shared_forward_impl", "self", "main (no_shared_forward_impl)"
        return None
    func = _method(ctx, "AscendMoERunner", "no_shared_forward_impl")
    setter = _method(ctx, "AscendMoERunner", "set_lora_context")
    if func is not None and setter is not None and _takes(func, "hidden_states", "router_logits") \
            and "routed_experts" in _source(setter):
        return "AscendMoERunner", "no_shared_forward_impl", "routed", "v0.24-v0.26"
    func = _method(ctx, "AscendFusedMoE", "forward_impl")
    setter = _method(ctx, "AscendFusedMoE", "set_lora_context")
    if func is not None and setter is not None and _takes(func, "hidden_states", "router_logits", "return_with_event"):
        return "AscendFusedMoE", "forward_impl", "self", "v0.23"
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


def _already_skips(func):
    text = _source(func)
    return "no_lora" in text or "has_lora(" in text


def check(ctx):
    if ctx.target not in (ROUTED_EXPERTS, FUSED_MOE):
        return
    layout = _runner_layout(ctx)
    if layout is not None and _already_skips(_method(ctx, layout[0], layout[1])):
        ctx.fixed_upstream(f"{layout[0]}.{layout[1]} already checks no_lora/has_lora")
    mlp = sys.modules.get(MOE_MLP)
    func = getattr(mlp, "unquant_apply_mlp", None)
    if inspect.isfunction(func) and _already_skips(func):
        ctx.fixed_upstream("moe_mlp.unquant_apply_mlp already checks no_lora/has_lora")


def apply(ctx):
    if ctx.target not in (ROUTED_EXPERTS, FUSED_MOE):
        return  # not a module this patch knows (the registry lists only those two)
    layout = _runner_layout(ctx)
    if layout is not None:
        owner, name, holder, _label = layout
        ctx.replace(owner, name, lambda original: make_skip(original, holder))
        return
    if ctx.target == ROUTED_EXPERTS:
        ctx.drift("AscendRoutedExperts has neither forward_impl(*, hidden_states, router_logits, ...) nor "
                  "no_shared_forward_impl(hidden_states, router_logits, ...)")
    # fused_moe on main: the runner lives in routed_experts, which is its own target.
    try:
        if importlib.util.find_spec(ROUTED_EXPERTS) is not None:
            return
    except (ImportError, ValueError):
        pass
    mlp = _mlp_module()
    func = getattr(mlp, "unquant_apply_mlp", None)
    if inspect.isfunction(func) and _takes(func, "lora_context"):
        ctx.replace(mlp, "unquant_apply_mlp", make_arg_skip)
        return
    ctx.drift("no runner method matches (AscendMoERunner.no_shared_forward_impl with the context on "
              "routed_experts, AscendFusedMoE.forward_impl(hidden_states, router_logits, return_with_event)) "
              "and moe_mlp.unquant_apply_mlp takes no lora_context")
