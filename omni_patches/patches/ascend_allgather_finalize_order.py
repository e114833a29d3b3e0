"""ascend-allgather-finalize-order: reduce-scatter AllGather MoE outputs over PCP, then DP (the reverse of prepare)

Why:         with DP > 1 and PCP > 1 on the AllGather MoE path, ``PrepareAndFinalizeWithAllGather`` all-gathers
             the tokens over DP and then over PCP, but ``_finalize_with_dp_group`` reduce-scatters over DP first
             and PCP second: each rank keeps another rank's token slice at the wrong length ("The size of tensor
             a (...) must match the size of tensor b (...) at non-singleton dimension 0"), or the PCP
             reduce-scatter fails on a length not divisible by PCP. ``moe-ep-parallel-mapping`` makes exactly
             this layout (HunyuanImage-3 PCP2·DP2·EP4).
Upstream:    https://github.com/vllm-project/vllm-ascend/pull/11921 ("Fix AllGather MoE finalize order with DP
             and PCP": PCP reduce-scatter + slice to the pre-PCP-gather count, then DP reduce-scatter + slice
             to the pre-DP-gather count)
Affected:    vllm-ascend >=0.13.0rc1,<0.24.0rc1; fixed upstream in vllm-ascend 0.24.0rc1. Needed together with
             ``moe-ep-parallel-mapping`` (vllm-omni 0.18.0-0.24.0rc1) on every vllm-ascend 0.13.0rc1-0.23.0.post1;
             with vllm-ascend 0.24.0rc1+ the EP patch alone suffices. On 0.13-0.20 the PCP steps run only with
             ``VLLM_ASCEND_ENABLE_CONTEXT_PARALLEL=1`` (EP+SP users there need the switch).
How:         ``ctx.replace`` of ``PrepareAndFinalizeWithAllGather._finalize_with_dp_group`` with our own plain
             function (a wrapper cannot reorder two collectives inside the stock body). Only when both the DP
             step and the PCP step would run (the release's own conditions) it reduce-scatters over PCP, keeps
             ``num_tokens_pcp`` rows, then over DP and keeps ``num_tokens`` rows: upstream's collectives,
             groups, order and slices. In every other case, or if anything it reads is missing, it calls the
             stock method. Fixed by version and by feature: the order of the two reduce-scatters in the
             method's source (which ``audit`` reads from skeletons too). Details: docs/patches.md.
Remove when: the oldest supported vllm-ascend is 0.24.0rc1 or later
"""
import ast
import inspect
import textwrap

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    "requires": {"vllm-ascend": ">=0.13.0rc1,<0.24.0rc1"},
    "fixed_in": {"vllm-ascend": "0.24.0rc1"},
    "targets": ["vllm_ascend.ops.fused_moe.prepare_finalize"],
}

PATCH_ID = "ascend-allgather-finalize-order"
TARGET = "vllm_ascend.ops.fused_moe.prepare_finalize"
CLASS = "PrepareAndFinalizeWithAllGather"
METHOD = "_finalize_with_dp_group"
PREPARE = "_prepare_with_dp_group"
PARAMS = ("self", "hidden_states", "reduce_results")
_GROUP_FN = {"dp": "get_dp_group", "pcp": "get_pcp_group"}
_SLICE_ATTR = {"dp": "num_tokens", "pcp": "num_tokens_pcp"}


class Layout:
    """What the release's ``_finalize_with_dp_group`` does, read from its source."""

    __slots__ = ("order", "shared_term", "guard", "pcp_slice", "prepare_pads_pcp", "from_names")

    def __init__(self, order, shared_term, guard, pcp_slice, prepare_pads_pcp=False, from_names=False):
        self.order, self.shared_term, self.guard = order, shared_term, guard
        self.pcp_slice, self.prepare_pads_pcp, self.from_names = pcp_slice, prepare_pads_pcp, from_names

    @property
    def fixed(self):
        return self.order == ("pcp", "dp")

    def describe(self):
        first, second = (s.upper() for s in self.order)
        if self.from_names:
            return f"{CLASS}.{METHOD} ({first} reduce-scatter before {second}, from co_names: no source)"
        parts = [f"{first} reduce-scatter before {second}"]
        if self.guard:
            parts.append(f"PCP step behind {self.guard}()")
        if self.shared_term:
            parts.append("DP step off with enable_shared_expert_dp")
        parts.append("PCP slice" if self.pcp_slice else "no PCP slice")
        if not self.fixed:
            parts.append("prepare pads for PCP" if self.prepare_pads_pcp else "prepare does not pad for PCP")
        return f"{CLASS}.{METHOD} ({', '.join(parts)})"


# -- reading the source ----------------------------------------------------------------------------
def _attr_chain(node):
    """``self.moe_config.dp_size`` -> ["self", "moe_config", "dp_size"]; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def _is_size_above_one(node, size_attr):
    return (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Gt)
            and _attr_chain(node.left) == ["self", "moe_config", size_attr]
            and isinstance(node.comparators[0], ast.Constant) and node.comparators[0].value == 1)


def _condition(test):
    """(kind, shared_term, guard) of a branch test, or None."""
    for kind in ("dp", "pcp"):
        if _is_size_above_one(test, f"{kind}_size"):
            return kind, False, None
    if not (isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and len(test.values) == 2):
        return None
    a, b = test.values
    if (_is_size_above_one(a, "dp_size") and isinstance(b, ast.UnaryOp) and isinstance(b.op, ast.Not)
            and _attr_chain(b.operand) == ["self", "enable_shared_expert_dp"]):
        return "dp", True, None
    if (isinstance(a, ast.Call) and isinstance(a.func, ast.Name) and not a.args and not a.keywords
            and _is_size_above_one(b, "pcp_size")):
        return "pcp", False, a.func.id
    return None


def _is_reduce_scatter(stmt, kind, hs):
    """``hs = get_<kind>_group().reduce_scatter(hs, 0 | dim=0)``."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id == hs):
        return False
    call = stmt.value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "reduce_scatter"):
        return False
    group = call.func.value
    if not (isinstance(group, ast.Call) and isinstance(group.func, ast.Name) and group.func.id == _GROUP_FN[kind]
            and not group.args and not group.keywords):
        return False
    if not (call.args and isinstance(call.args[0], ast.Name) and call.args[0].id == hs):
        return False
    dims = [*call.args[1:], *(k.value for k in call.keywords if k.arg == "dim")]
    others = [k for k in call.keywords if k.arg != "dim"]
    return (len(dims) == 1 and not others and isinstance(dims[0], ast.Constant) and dims[0].value == 0)


def _is_slice(stmt, kind, hs):
    """``hs = hs[: self.num_tokens(_pcp)]``."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id == hs):
        return False
    sub = stmt.value
    if not (isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Name) and sub.value.id == hs):
        return False
    sl = sub.slice
    return (isinstance(sl, ast.Slice) and sl.lower is None and sl.step is None
            and _attr_chain(sl.upper) == ["self", _SLICE_ATTR[kind]])


def _branch(stmt, hs):
    """(kind, shared_term, guard, has_slice) of one ``if`` step, or None."""
    if not isinstance(stmt, ast.If) or stmt.orelse:
        return None
    cond = _condition(stmt.test)
    if cond is None:
        return None
    kind, shared, guard = cond
    body = stmt.body
    if not body or len(body) > 2 or not _is_reduce_scatter(body[0], kind, hs):
        return None
    if len(body) == 2 and not _is_slice(body[1], kind, hs):
        return None
    return kind, shared, guard, len(body) == 2


def _parse(func):
    """The method's FunctionDef from its source, or None when the source cannot be read."""
    try:
        text = textwrap.dedent(inspect.getsource(func))
        tree = ast.parse(text)
    except (OSError, TypeError, SyntaxError, ValueError):
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _names_order(func):
    """'dp' / 'pcp': which group getter comes first in the code object's names, or None."""
    names = list(getattr(getattr(func, "__code__", None), "co_names", ()))
    if _GROUP_FN["dp"] in names and _GROUP_FN["pcp"] in names:
        return "dp" if names.index(_GROUP_FN["dp"]) < names.index(_GROUP_FN["pcp"]) else "pcp"
    return None


def finalize_layout(func):
    """Layout of a ``_finalize_with_dp_group`` function; ``(None, why)`` when its shape is unknown."""
    try:
        params = tuple(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        params = None
    if params != PARAMS:
        return None, f"{CLASS}.{METHOD} takes {params}, expected {PARAMS}"
    first = _names_order(func)
    node = _parse(func)
    if node is None:
        if first == "pcp":  # enough to say fixed: the PCP reduce-scatter is emitted before the DP one
            return Layout(("pcp", "dp"), False, None, False, from_names=True), None
        return None, f"cannot read the source of {CLASS}.{METHOD}; the reduce-scatter order is unknown"
    body = list(node.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    hs = PARAMS[1]
    if not (len(body) == 3 and isinstance(body[2], ast.Return) and isinstance(body[2].value, ast.Name)
            and body[2].value.id == hs):
        return None, (f"{CLASS}.{METHOD} is not two reduce-scatter steps and a return "
                      f"({len(body)} statements)")
    steps = [_branch(s, hs) for s in body[:2]]
    if None in steps or {s[0] for s in steps} != {"dp", "pcp"}:
        return None, f"{CLASS}.{METHOD}: a step is not a DP or PCP reduce-scatter of the known shape"
    by_kind = {s[0]: s for s in steps}
    if not by_kind["dp"][3]:
        return None, f"{CLASS}.{METHOD}: the DP step does not slice to self.num_tokens"
    order = (steps[0][0], steps[1][0])
    if first is not None and first != order[0]:
        return None, f"{CLASS}.{METHOD}: its code object does not match its source file (reloaded or edited?)"
    return Layout(order, by_kind["dp"][1], by_kind["pcp"][2], by_kind["pcp"][3]), None


def prepare_facts(func):
    """(gathers DP before PCP, pads for PCP) of ``_prepare_with_dp_group``; (None, None) when unreadable."""
    node = _parse(func)
    if node is None:
        return None, None
    gathers = []
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "all_gather":
            recv = call.func.value
            if _attr_chain(recv) == ["self", "moe_config", "dp_group"]:
                gathers.append((call.lineno, call.col_offset, "dp"))
            elif isinstance(recv, ast.Call) and isinstance(recv.func, ast.Name) and recv.func.id == "get_pcp_group":
                gathers.append((call.lineno, call.col_offset, "pcp"))
    kinds = [k for _, _, k in sorted(gathers)]
    dp_first = bool(kinds) and "dp" in kinds and "pcp" in kinds and kinds.index("pcp") > max(
        i for i, k in enumerate(kinds) if k == "dp")
    pads = any(isinstance(n, ast.Attribute) and n.attr == "num_tokens_pcp" and isinstance(n.ctx, ast.Store)
               for n in ast.walk(node))
    return dp_first, pads


# -- the replacement -------------------------------------------------------------------------------
def make_finalize(original, module_globals, layout, run):
    """Our ``_finalize_with_dp_group``: PCP reduce-scatter first when both steps run, else the stock one.
    ``run``: the patch's record (``ctx.run``; a test building it directly passes a standalone one) its fallbacks
    go to."""
    shared_term, guard = layout.shared_term, layout.guard
    pcp_slice = layout.pcp_slice or layout.prepare_pads_pcp
    g = module_globals
    stock = original

    def _finalize_with_dp_group(self, hidden_states, reduce_results):
        try:
            cfg = self.moe_config
            both = (cfg.dp_size > 1 and not (shared_term and self.enable_shared_expert_dp)
                    and cfg.pcp_size > 1 and (guard is None or g[guard]()))
            if both:
                keep_pcp = self.num_tokens_pcp if pcp_slice else None
                keep_dp = self.num_tokens
                pcp_group = g["get_pcp_group"]()
                dp_group = g["get_dp_group"]()
        except Exception as exc:  # something this patch did not expect: the stock method decides
            both = False
            run.fallback(f"reading the layer's DP/PCP configuration or groups raised {type(exc).__name__}: the "
                         "stock finalize ran")
        if not both:
            return stock(self, hidden_states, reduce_results)
        # Undo prepare's gathers in reverse: PCP (the last gather) first, then DP.
        hidden_states = pcp_group.reduce_scatter(hidden_states, dim=0)
        if keep_pcp is not None:
            hidden_states = hidden_states[:keep_pcp]
        hidden_states = dp_group.reduce_scatter(hidden_states, 0)
        return hidden_states[:keep_dp]

    _finalize_with_dp_group.__qualname__ = getattr(original, "__qualname__", METHOD)
    _finalize_with_dp_group.__doc__ = getattr(original, "__doc__", None)
    return _finalize_with_dp_group


# -- engine entry points ---------------------------------------------------------------------------
def _layout(ctx):
    layout, why = finalize_layout(ctx.own_function(CLASS, METHOD))
    if layout is None:
        ctx.drift(why)
    if layout.fixed:
        ctx.fixed_upstream(f"{layout.describe()}: the PCP reduce-scatter already comes first")
    dp_first, pads = prepare_facts(ctx.own_function(CLASS, PREPARE))
    if not dp_first:
        ctx.drift(f"{CLASS}.{PREPARE} does not all-gather over DP before PCP (or cannot be read): "
                  "the finalize order it needs is unknown")
    layout.prepare_pads_pcp = pads
    ctx.describe(layout.describe())
    return layout


def check(ctx):
    if ctx.target == TARGET:
        _layout(ctx)


def apply(ctx):
    if ctx.target != TARGET:
        return
    layout = _layout(ctx)
    module_globals = vars(ctx.module)
    ctx.replace(CLASS, METHOD, lambda original: make_finalize(original, module_globals, layout, ctx.run))
