"""Contract case for ascend-moe-lora-argsort-fp32: the REAL ``vllm_ascend/lora/fused_moe.py`` (and, where the release
has it, ``vllm_ascend/lora/quant_moe.py``) of each vllm-ascend release, on real torch (CPU). torch_npu is a stand-in
that sets ``torch.npu`` as the real one does on import; the rest of the files' imports (vLLM, the other vllm_ascend
modules) are permissive stand-ins: the routing function uses torch alone.

Also the scenarios the test runs in its children (``Release.call``): module-level functions, importing nothing of the
release until they run.
"""
from omni_patches.testing import Case, Env, Release, Unexpected

PID = "ascend-moe-lora-argsort-fp32"
FM, QM = "vllm_ascend/lora/fused_moe.py", "vllm_ascend/lora/quant_moe.py"
FM_MOD, QM_MOD = "vllm_ascend.lora.fused_moe", "vllm_ascend.lora.quant_moe"
NAMES = ("_recover_moe_lora_routing_allgather", "_recover_moe_lora_routing")

#: Every vllm-ascend release on PyPI in the range (wheels 0.23.0rc1-0.26.0rc1, sdists 0.23.0.post1 and 0.27.1rc1) ->
#: the routing function's name there.
AFFECTED = {"0.23.0rc1": NAMES[1], "0.23.0": NAMES[1], "0.23.0.post1": NAMES[1], "0.24.0rc1": NAMES[1],
            "0.25.1rc1": NAMES[0], "0.26.0rc1": NAMES[0], "0.27.1rc1": NAMES[0]}
#: Upstream's fix (vllm-ascend #16486) and the releases after it: float32 keys.
FIXED = ("0.28.0rc1", "0.29.0rc1", "0.30.0rc1", "0.30.0rc2")
BEFORE = "0.22.1rc1"  # no MoE-LoRA yet (no vllm_ascend/lora/fused_moe.py)

# torch_npu's own import sets torch.npu (0.27.1rc1+ quant_moe.py reads torch.npu.Event at import).
TORCH_NPU = """
import torch as _torch

from omni_patches.testing import standins as _s

if not hasattr(_torch, "npu"):
    _s.put({"torch.npu": {}})
"""


def release(version, metadata_version=None):
    return Release("vllm-ascend", version, files=[FM + "?", QM + "?", "vllm_ascend/lora/__init__.py"],
                   auto_standins=True, passthrough=("torch",), standins={"torch_npu": TORCH_NPU},
                   metadata_version=metadata_version)


def _env(version, metadata_version=None, **kw):
    return release(version, metadata_version).env(**kw)


V023, V024, V026, V027 = (_env(v) for v in ("0.23.0.post1", "0.24.0rc1", "0.26.0rc1", "0.27.1rc1"))
SOURCE = "0.19.1rc2.dev1637+g182b75ea8"  # what a main checkout reports (setuptools_scm, nearest reachable tag)


# -- inputs (built in the child, on CPU) ------------------------------------------------------------------
def routing_inputs(tokens, top_k, experts, seed, kind="routed", slots=4):
    """``(lora_context, expanded_row_idx, topk_ids)`` as the AllGather MoE path hands them over.

    ``routed``: ``topk_ids`` a top-k of random router scores, ``expanded_row_idx`` what npu_moe_init_routing gives:
    for every flat (token, k) row, its position once the rows are sorted by expert (a permutation, int32).
    ``signed``: the same with some positions negated (the routing function takes ``abs``); ``int64``: the same
    keys as int64; ``ties``: keys with repeats (not a permutation: an input the NPU op never gives, where an
    unstable sort may order equal keys either way); ``short_slots``: fewer LoRA slots than tokens (the clamp).
    """
    import types

    import torch

    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    topk_ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    flat = topk_ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    expanded = torch.empty_like(flat)
    expanded[order] = torch.arange(flat.numel(), dtype=torch.int32)
    if kind == "signed":
        flip = torch.rand(flat.numel(), generator=g) < 0.3
        expanded = torch.where(flip, -expanded, expanded)
    elif kind == "int64":
        expanded = expanded.to(torch.int64)
    elif kind == "ties":
        expanded = torch.randint(0, max(1, flat.numel() // 4), (flat.numel(),), generator=g, dtype=torch.int32)
    n_slots = max(1, tokens // 2) if kind == "short_slots" else max(tokens, 1) + 7  # max_num_batched_tokens
    token_lora_indices = torch.randint(-1, slots, (n_slots,), generator=g, dtype=torch.int64)
    ctx = types.SimpleNamespace(top_k=top_k, punica_wrapper=types.SimpleNamespace(token_lora_indices=token_lora_indices))
    return ctx, expanded, topk_ids


def _digest(t):
    import hashlib

    return [str(t.dtype), list(t.shape), hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]]


class _ArgsortSpy:
    """Records the dtype of every ``torch.argsort`` key while installed (``torch.argsort`` is what the routing
    function calls: its module holds ``torch`` itself)."""

    def __init__(self):
        import torch

        self.torch, self.real, self.dtypes = torch, torch.argsort, []

    def __call__(self, key, *args, **kwargs):
        self.dtypes.append(str(key.dtype))
        return self.real(key, *args, **kwargs)

    def __enter__(self):
        self.torch.argsort = self
        return self

    def __exit__(self, *exc):
        self.torch.argsort = self.real


def _routing(module):
    return next(n for n in NAMES if n in vars(module))


def _run_all(func, specs):
    out = []
    with _ArgsortSpy() as spy:
        for spec in specs:
            experts, slots = func(*routing_inputs(*spec))
            out.append({"experts": _digest(experts), "slots": _digest(slots)})
    return out, spy.dtypes


def _activate():
    import os

    import omni_patches

    os.environ["OMNI_PATCHES"] = "1"
    omni_patches.activate()
    st = {s.id: s for s in omni_patches.status()}[PID]
    return st.state, st.reason


def stock_then_patched(specs, activate=True):
    """The release's routing function on every spec: stock, then (``activate``) with the shim active -- as its
    callers reach it, through the module attribute. Results as digests, and the dtype of every argsort key."""
    import importlib

    fm = importlib.import_module("vllm_ascend.lora.fused_moe")
    name = _routing(fm)
    stock, stock_dtypes = _run_all(getattr(fm, name), specs)
    out = {"name": name, "stock": stock, "stock_dtypes": stock_dtypes}
    if activate:
        out["state"], out["reason"] = _activate()
        out["patched"], out["patched_dtypes"] = _run_all(getattr(fm, name), specs)
        # the call-time import of unquant_apply_mlp (0.25.1rc1+): `from vllm_ascend.lora.fused_moe import <name>`
        ns = {}
        exec(f"from vllm_ascend.lora.fused_moe import {name} as f", ns)
        out["imported_is_patched"] = ns["f"] is getattr(fm, name) and ns["f"] is not _stock_of(ns["f"])
    return out


def _stock_of(func):
    return getattr(func, "__wrapped__", func)


def caller_sees_patch(spec):
    """0.23.x / 0.24.0rc1: the real ``moe_lora_apply_w13`` (which calls the routing function by its module global)
    hands the punica wrapper the same expert ids and LoRA slots, stock and patched; the argsort keys it sorts."""
    import importlib

    import torch

    fm = importlib.import_module("vllm_ascend.lora.fused_moe")
    seen = []

    def run():
        ctx, expanded, topk_ids = routing_inputs(*spec)
        ctx.punica_wrapper.add_lora_fused_moe = lambda **kw: seen.append(kw)
        ctx.w13_lora_a_stacked = ctx.w13_lora_b_stacked = ctx.adapter_enabled = None
        with _ArgsortSpy() as spy:
            fm.moe_lora_apply_w13(ctx, gate_up_out=torch.zeros(1), hidden_states=torch.zeros(1),
                                  expanded_row_idx=expanded, topk_ids=topk_ids)
        kw = seen.pop()
        return {"experts": _digest(kw["expert_ids"]), "slots": _digest(kw["token_lora_mapping"]),
                "dtypes": spy.dtypes}

    stock = run()
    state, _ = _activate()
    return {"stock": stock, "state": state, "patched": run()}


def quant_binding(spec, before):
    """0.27.1rc1: ``quant_moe`` binds the routing function by name at import. ``before``: the shim activated before
    both imports (the binding then takes the patched function) or after them (the binding is replaced). What the
    binding argsorts, and that unapply gives both modules the stock function back."""
    import importlib

    import omni_patches

    if before:
        _activate()
    fm = importlib.import_module("vllm_ascend.lora.fused_moe")
    qm = importlib.import_module("vllm_ascend.lora.quant_moe")
    name = NAMES[0]
    if not before:
        stock_fn = getattr(qm, name)
        _activate()
    else:
        stock_fn = _stock_of(getattr(fm, name))
    out = {"state": {s.id: s for s in omni_patches.status()}[PID].state,
           "same_object": getattr(qm, name) is getattr(fm, name), "patched": getattr(qm, name) is not stock_fn}
    out["results"], out["dtypes"] = _run_all(getattr(qm, name), [spec])
    out["unapplied"] = omni_patches.unapply(PID)
    out["restored"] = getattr(qm, name) is stock_fn and getattr(fm, name) is stock_fn
    out["after"], out["after_dtypes"] = _run_all(getattr(qm, name), [spec])
    return out


# -- the contract --------------------------------------------------------------------------------------------
def _float_keys():
    """Keys that are already floating point: an input the replacement was not built for (stock runs)."""
    from vllm_ascend.lora import fused_moe

    ctx, expanded, topk_ids = routing_inputs(64, 4, 16, 3)
    experts, slots = getattr(fused_moe, _routing(fused_moe))(ctx, expanded.to(__import__("torch").float64), topk_ids)
    return experts, slots


ARGSORT = "    inv_perm = torch.argsort(expanded)\n"

CASE = Case(
    patch_id=PID,
    # one per layout here; test_ascend_moe_lora_argsort_fp32.py drives every release in the range
    affected=[V023, V024, V026, V027],
    skipped=[
        (_env(BEFORE, imports=["vllm_ascend.lora"]), "skipped:version", "outside"),
        (_env("0.28.0rc1"), "skipped:version", "fixed upstream in vllm-ascend 0.28.0rc1"),
        (_env("0.30.0rc2"), "skipped:version", "fixed upstream in vllm-ascend 0.28.0rc1"),
        # a backport of #16486 onto an affected release: found by feature
        (Env.edited("ascend-0.26.0rc1-fp32-backport", V026, FM, "    expanded = torch.abs(expanded_row_idx)\n",
                    "    expanded = torch.abs(expanded_row_idx).float()\n"),
         "skipped:version", "already argsorts floating keys"),
    ],
    source_built=[
        (_env("0.26.0rc1", SOURCE), "applied", "decided by code features"),
        (_env("0.27.1rc1", "0.0.0"), "applied", "is a source build"),
        (_env("0.28.0rc1", SOURCE), "skipped:version", "already argsorts floating keys"),
    ],
    drifted=[
        (Env.edited("ascend-0.26.0rc1-stable-sort", V026, FM, ARGSORT,
                    "    inv_perm = torch.argsort(expanded, stable=True)\n"), "expected one argument"),
        (Env.edited("ascend-0.23.0.post1-key-reused", V023, FM, "    expert_per_row = topk_ids.reshape(-1)[inv_perm]",
                    "    expert_per_row = topk_ids.reshape(-1)[expanded_row_idx]"), "used beyond the argsort key"),
        (Env.edited("ascend-0.24.0rc1-renamed", V024, FM, "def _recover_moe_lora_routing(",
                    "def _recover_routing("), "defines none of"),
        (Env.edited("ascend-0.27.1rc1-new-parameter", V027, FM,
                    "def _recover_moe_lora_routing_allgather(lora_context, expanded_row_idx, topk_ids):",
                    "def _recover_moe_lora_routing_allgather(lora_context, expanded_row_idx, topk_ids, top_k=None):"),
         "takes (lora_context, expanded_row_idx, topk_ids, top_k=None)"),
    ],
    unexpected=[Unexpected(V026, _float_keys, note="expanded_row_idx is not an integer tensor")],
)


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here; the words are omni_patches.tools.audit's).
VERDICTS = {
    "vllm-ascend==0.22.1rc1": "skip: out of range", "vllm-ascend==0.23.0rc1": "would apply",
    "vllm-ascend==0.23.0": "would apply", "vllm-ascend==0.23.0.post1": "would apply",
    "vllm-ascend==0.24.0rc1": "would apply", "vllm-ascend==0.25.1rc1": "would apply",
    "vllm-ascend==0.26.0rc1": "would apply", "vllm-ascend==0.27.1rc1": "would apply",
    "vllm-ascend==0.28.0rc1": "skip: fixed upstream", "vllm-ascend==0.30.0rc2": "skip: fixed upstream",
}
