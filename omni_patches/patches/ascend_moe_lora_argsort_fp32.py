"""ascend-moe-lora-argsort-fp32: argsort float32 keys, not integers, when recovering the MoE-LoRA routing on Ascend

Why:         vllm-ascend's unquantized (and, from 0.27.1rc1, W8A8) MoE-LoRA path recovers each dispatched row's
             (expert, adapter) with ``torch.argsort`` of the integer ``expanded_row_idx``, in every MoE layer of
             every forward while a LoRA is active. On the NPU an integer argsort is ~21x slower than a float32 one
             (upstream's table: 3.64 ms against 0.174 ms at 4096 tokens) for the same permutation.
Upstream:    https://github.com/vllm-project/vllm-ascend/pull/16486 (the argsort key cast to float32 in
             ``_recover_moe_lora_routing_allgather``)
Affected:    vllm-ascend >=0.23.0rc1,<0.28.0rc1 (``_recover_moe_lora_routing`` in 0.23.0rc1-0.24.0rc1,
             ``_recover_moe_lora_routing_allgather`` in 0.25.1rc1-0.27.1rc1);
             fixed upstream in vllm-ascend 0.28.0rc1 (also found by feature: a floating cast of the argsort key).
How:         the module function in ``vllm_ascend.lora.fused_moe`` (looked up at call time by its callers) is
             replaced by a plain function with the same parameters that calls the original with
             ``expanded_row_idx`` cast to float32, its only use being ``torch.argsort(torch.abs(...))`` (checked in
             the source, else drift). The keys are row positions: with at most 2**24 rows every value is exact in
             float32, so the order is upstream's fixed one. 0.27.1rc1's ``vllm_ascend.lora.quant_moe`` binds the
             function by name at import: that binding is replaced too. Not an integer tensor, or more than 2**24
             rows: the original runs (noted once).
Remove when: the oldest supported vllm-ascend is 0.28.0rc1 or later
"""
import ast
import inspect
import textwrap

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    "requires": {"vllm-ascend": ">=0.23.0rc1,<0.28.0rc1"},
    "fixed_in": {"vllm-ascend": "0.28.0rc1"},
    "targets": ["vllm_ascend.lora.fused_moe", "vllm_ascend.lora.quant_moe"],
}

PATCH_ID = "ascend-moe-lora-argsort-fp32"
FUSED_MOE = "vllm_ascend.lora.fused_moe"
QUANT_MOE = "vllm_ascend.lora.quant_moe"
#: The function's name: 0.25.1rc1+ first (an AlltoAll sibling arrived then), then 0.23.0rc1-0.24.0rc1's.
NAMES = ("_recover_moe_lora_routing_allgather", "_recover_moe_lora_routing")
PARAMS = ("lora_context", "expanded_row_idx", "topk_ids")
KEY = "expanded_row_idx"
#: Every integer up to 2**24 is exact in float32: at most that many rows, the float keys sort as the integers do.
EXACT_ROWS = 1 << 24

AFFECTED = "affected"
FIXED = "fixed"


def _is_torch_call(node, name):
    """``torch.<name>(...)``."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch")


def _casts_to_float(node):
    """Does ``node`` hold a floating cast (``.float()``, ``.to(torch.float32)``, ``.type(...float...)``)?"""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute):
            if sub.func.attr in ("float", "double", "half"):
                return True
            if sub.func.attr in ("to", "type") and any("float" in ast.unparse(a)
                                                      for a in [*sub.args, *(k.value for k in sub.keywords)]):
                return True
    return False


def _names(fn, name, ctx_type):
    return [n for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ctx_type)]


def argsort_key(func):
    """``(AFFECTED | FIXED, what was found)`` for the routing function's argsort, or ``(None, why not)``.

    AFFECTED: its one ``torch.argsort`` sorts ``torch.abs(expanded_row_idx)`` (directly or through one local name
    used nowhere else) and ``expanded_row_idx`` is used nowhere else: casting that argument is the fix. FIXED: the
    argsort key already goes through a floating cast (vllm-ascend 0.28.0rc1+).
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None, "cannot read its source"
    fn = tree.body[0] if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    if fn is None:
        return None, "its source is not a function definition"
    sorts = [n for n in ast.walk(fn) if _is_torch_call(n, "argsort")]
    if len(sorts) != 1:
        return None, f"it calls torch.argsort {len(sorts)} times (expected once)"
    call = sorts[0]
    if len(call.args) != 1 or call.keywords:
        return None, f"its argsort is {ast.unparse(call)!r} (expected one argument, no options)"
    key = call.args[0]
    if isinstance(key, ast.Name):  # through a local: assigned once, read only by the argsort
        stores = _names(fn, key.id, ast.Store)
        assigns = [n for n in ast.walk(fn) if isinstance(n, ast.Assign) and len(n.targets) == 1
                   and isinstance(n.targets[0], ast.Name) and n.targets[0].id == key.id]
        if len(stores) != 1 or len(assigns) != 1 or len(_names(fn, key.id, ast.Load)) != 1:
            return None, f"the argsort key {key.id!r} is assigned or read elsewhere"
        key = assigns[0].value
    if _casts_to_float(key):
        return FIXED, f"argsorts {ast.unparse(key)}"
    if not (_is_torch_call(key, "abs") and len(key.args) == 1 and not key.keywords
            and isinstance(key.args[0], ast.Name) and key.args[0].id == KEY):
        return None, f"its argsort key is {ast.unparse(key)!r} (expected torch.abs({KEY}))"
    if len(_names(fn, KEY, ast.Load)) != 1 or _names(fn, KEY, ast.Store):
        return None, f"{KEY} is used beyond the argsort key"
    return AFFECTED, f"argsorts {ast.unparse(key)} (integer keys)"


def _routing_function(ctx):
    """``(name, function)`` of the AllGather routing recovery bound in the target module, or None."""
    for name in NAMES:
        func = vars(ctx.module).get(name)
        if func is not None:
            return name, func
    return None


def _read(ctx, name, func):
    """AFFECTED / FIXED for ``func`` (drift otherwise), with what was found described."""
    plain = inspect.unwrap(func)  # a binding that already holds this patch's replacement shows the original
    if not inspect.isfunction(plain):
        ctx.drift(f"{ctx.target}.{name} is not a plain function")
    params = list(inspect.signature(plain).parameters.values())
    if tuple(p.name for p in params) != PARAMS or any(
            p.kind is not p.POSITIONAL_OR_KEYWORD or p.default is not p.empty for p in params):
        ctx.drift(f"{ctx.target}.{name} takes ({', '.join(str(p) for p in params)}), not ({', '.join(PARAMS)})")
    state, found = argsort_key(plain)
    if state is None:
        ctx.drift(f"{ctx.target}.{name}: {found}")
    ctx.describe(f"{ctx.target}.{name} {found}")
    return state


def check(ctx):
    if ctx.target not in (FUSED_MOE, QUANT_MOE):
        return
    hit = _routing_function(ctx)
    if hit is None:
        if ctx.target == QUANT_MOE:
            return  # nothing bound by name here
        ctx.drift(f"{FUSED_MOE} defines none of {', '.join(NAMES)}")
    if _read(ctx, *hit) == FIXED:
        ctx.fixed_upstream(f"{ctx.target}.{hit[0]} already argsorts floating keys")


def make_fp32_keys(original, run):
    """A plain function with ``original``'s parameters (``PARAMS``) that argsorts float32 keys: it calls
    ``original`` with ``expanded_row_idx`` cast to float32. ``run``: the patch's record (``ctx.run``)."""
    import torch

    tensor, f32 = torch.Tensor, torch.float32
    ints = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)  # a tuple: plain for torch.compile too

    def recover(lora_context, expanded_row_idx, topk_ids):
        if isinstance(expanded_row_idx, tensor):
            if expanded_row_idx.dtype in ints:
                if expanded_row_idx.numel() <= EXACT_ROWS:
                    return original(lora_context, expanded_row_idx.to(f32), topk_ids)
                run.fallback(f"{KEY} has more than 2**24 rows (float32 keys would not be exact)")
            else:
                run.fallback(f"{KEY} is not an integer tensor")
        else:
            run.fallback(f"{KEY} is not a torch.Tensor")
        return original(lora_context, expanded_row_idx, topk_ids)

    return recover


def apply(ctx):
    if ctx.target not in (FUSED_MOE, QUANT_MOE):
        return
    hit = _routing_function(ctx)
    if hit is None:  # quant_moe without the binding (check() has drifted fused_moe already)
        ctx.describe(f"{ctx.target} binds no {NAMES[0]}: nothing to replace")
        return
    name, _ = hit
    ctx.replace("", name, lambda original: make_fp32_keys(original, ctx.run))
