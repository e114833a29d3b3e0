"""ascend-moe-wake-double-transpose: keep unquantized MoE expert weights in their runtime layout across NPUWorker.wake_up

Why:         process_weights_after_loading stores w13_weight / w2_weight transposed for the NPU grouped matmul;
             a level-1 sleep restores them byte for byte, and NPUWorker.wake_up then transposes them again
             (replacing each Parameter by a transposed view). The next forward fails on a shape mismatch:
             any MoE model served with sleep mode, vllm-omni's AR stages on NPUWorker included.
Upstream:    https://github.com/vllm-project/vllm-ascend/issues/11548,
             https://github.com/vllm-project/vllm-ascend/issues/12226 and
             https://github.com/vllm-project/vllm-ascend/pull/13012 (commit 032b3f4a04: wake_up no longer
             transposes; RL reloads through reload_weights / the weight-update RPCs)
Affected:    vllm-ascend >=0.12.0rc1,<0.26.0rc1 (every release on PyPI from 0.12.0rc1, where wake_up first
             transposes, to 0.25.1rc1); fixed upstream in vllm-ascend 0.26.0rc1 (also found by feature:
             a wake_up that names no MoE weight). 0.11.0 and older do not transpose at wake: not affected.
How:         NPUWorker.wake_up is wrapped (wrapt): the MoE weight Parameters (names holding w13_weight /
             w2_weight, 3-D) are noted, stock runs unchanged (allocator, buffers, cleanup), and every Parameter
             stock replaced by its own transpose(1, 2) view is put back: the layout, values and objects the
             forward and vLLM's in-place reload expect, as 0.26.0rc1 leaves them. Anything else is left as is.
             Default on (serving and vLLM's reload need it). A trainer built on the pre-0.26 contract (wake_up
             hands it the checkpoint layout to load into) sets OMNI_PATCHES_ASCEND_MOE_WAKE_DOUBLE_TRANSPOSE=0.
             Details: docs/patches.md.
Remove when: the oldest supported vllm-ascend is 0.26.0rc1 or later
"""
import ast
import functools
import inspect
import textwrap

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    "requires": {"vllm-ascend": ">=0.12.0rc1,<0.26.0rc1"},
    "fixed_in": {"vllm-ascend": "0.26.0rc1"},
    "targets": ["vllm_ascend.worker.worker", "vllm_ascend.worker.worker_v1"],
}

PATCH_ID = "ascend-moe-wake-double-transpose"
NAMES = ("w13_weight", "w2_weight")
# Stock's tests for "already in the runtime layout": w2 [E, I, H] has the hidden size at dim 2, w13 [E, H, 2I] at dim 1.
RUNTIME_DIM = {"w2_weight": 2, "w13_weight": 1}


# -- what the release's wake_up does, read from its code ---------------------------------------------------
def _source_tree(func):
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None


def _constants(func):
    code = getattr(func, "__code__", None)
    out = set()
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        for const in c.co_consts:
            if isinstance(const, str):
                out.add(const)
            elif hasattr(const, "co_consts"):
                stack.append(const)
    return out


def _shape_index_tests(tree):
    """{weight name: dims} of every ``if "<name>" in ...  and <x>.shape[<dim>] == ...`` test in ``tree``."""
    found = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        names = {n.value for n in ast.walk(node.test) if isinstance(n, ast.Constant) and n.value in NAMES}
        dims = set()
        for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            for side in [cmp.left, *cmp.comparators]:
                if (isinstance(side, ast.Subscript) and isinstance(side.value, ast.Attribute)
                        and side.value.attr == "shape" and isinstance(side.slice, ast.Constant)):
                    dims.add(side.slice.value)
        for name in names:
            found.setdefault(name, set()).update(dims)
    return found


def layout(func):
    """What ``NPUWorker.wake_up`` does with the MoE weights: "retransposes" (stock 0.12.0rc1-0.25.1rc1: it
    transposes the weights that are in the runtime layout), "none" (0.26.0rc1+: it names no MoE weight), or a
    text saying what else it does (drift). Read from its source (what ``omni-patches audit`` has too), else from
    its bytecode's constants."""
    tree = _source_tree(func)
    if tree is None:
        if not _constants(func) & set(NAMES):
            return "none"
        return "transposes MoE weights, but its source cannot be read to tell which layout it tests for"
    consts = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    if not consts & set(NAMES):
        return "none"
    if not any(isinstance(n, ast.Attribute) and n.attr == "transpose" for n in ast.walk(tree)):
        return "names w13_weight / w2_weight but calls no transpose"
    tests = _shape_index_tests(tree)
    if all(tests.get(name) == {dim} for name, dim in RUNTIME_DIM.items()):
        return "retransposes"
    return (f"transposes MoE weights on other shape tests ({ {k: sorted(v) for k, v in sorted(tests.items())} }"
            f" instead of w2_weight shape[2], w13_weight shape[1] == hidden_size)")


# -- at call time --------------------------------------------------------------------------------------------
def _model(worker):
    runner = getattr(worker, "model_runner", None)
    model = getattr(runner, "model", None)
    if model is None or not callable(getattr(model, "named_parameters", None)) \
            or not callable(getattr(model, "get_submodule", None)):
        return None
    return model


def _moe_weights(model):
    """``[(owning module, attribute, Parameter)]`` for every 3-D parameter stock's loop may transpose."""
    out = []
    for name, param in model.named_parameters():
        if not any(n in name for n in NAMES) or param.dim() != 3:
            continue
        prefix, _, leaf = name.rpartition(".")
        owner = model.get_submodule(prefix)
        if owner._parameters.get(leaf) is param:
            out.append((owner, leaf, param))
    return out


def _is_stock_transpose(new, old):
    """Is ``new`` what stock's loop puts in place of ``old``: a tensor over the same memory, dims 1 and 2 swapped?"""
    try:
        if new is None or new.dim() != 3 or new.data_ptr() != old.data_ptr():
            return False
        s, t = old.shape, old.stride()
        return tuple(new.shape) == (s[0], s[2], s[1]) and tuple(new.stride()) == (t[0], t[2], t[1])
    except (AttributeError, TypeError, RuntimeError):
        return False


def _put_back(run, kept):
    restored = 0
    for owner, leaf, param in kept:
        now = owner._parameters.get(leaf)
        if now is param:
            continue
        if _is_stock_transpose(now, param):
            setattr(owner, leaf, param)
            restored += 1
        else:
            run.fallback("a MoE weight was replaced during wake_up by something other than its transpose: left as "
                         "wake_up left it")
    return restored


def _wake_up(run, wrapped, instance, args, kwargs):
    model = _model(instance)
    if model is None:
        return run.stock("the worker has no model_runner.model to keep the MoE weights of", wrapped, args, kwargs)
    try:
        kept = _moe_weights(model)
    except Exception:  # a model this was not built for: stock's loop decides, as it would alone
        return run.stock("listing the model's MoE weights raised", wrapped, args, kwargs)
    if not kept:
        return wrapped(*args, **kwargs)
    try:
        return wrapped(*args, **kwargs)
    finally:
        try:
            restored = _put_back(run, kept)
        except Exception:  # never raise for a reason of our own: the weights stay as stock left them
            restored = 0
            run.fallback("putting the MoE weights back raised: left as wake_up left them")
        if restored:
            calls = run.count("wake_up")
            for _ in range(restored):
                weights = run.count("weights")
            run.note(f"wake_up: {weights} MoE weight(s) kept in the runtime layout over {calls} call(s) (stock "
                     f"transposed them again)", key="restored")


def check(ctx):
    func = ctx.resolve("NPUWorker.wake_up")
    if not inspect.isfunction(func):
        ctx.drift("NPUWorker.wake_up is not a plain function")
    ctx.require_params(func, "tags", label="NPUWorker.wake_up")
    found = layout(func)
    if found == "none":
        # No loop: a wake_up that reads weight_nz_mode (0.20.2rc1+) dropped it (the fix, or a backport); one that
        # does not predates it (0.11.x and older, the v0 worker.py of 0.9.x), as far as a tagless checkout shows.
        if "weight_nz_mode" in getattr(getattr(func, "__code__", None), "co_names", ()):
            ctx.fixed_upstream("NPUWorker.wake_up no longer transposes the MoE weights (vllm-ascend #13012)")
        ctx.not_affected("NPUWorker.wake_up transposes no MoE weight and predates the weight_nz_mode check: "
                         "older than the transpose at wake (vllm-ascend #4626, first released in 0.12.0rc1)")
    if found != "retransposes":
        ctx.drift(f"NPUWorker.wake_up {found}")
    ctx.describe("NPUWorker.wake_up transposes w13_weight / w2_weight found in the runtime layout: put back")


def apply(ctx):
    ctx.wrap("NPUWorker", "wake_up", functools.partial(_wake_up, ctx.run))
