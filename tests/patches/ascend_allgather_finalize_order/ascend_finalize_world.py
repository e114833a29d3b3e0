"""Run the REAL AllGather prepare/finalize of vllm-ascend releases in 4 CPU processes over gloo (DP2·PCP2·EP4).

Each rank holds its own tokens (row = [token id, 2·id, rank, position]), runs the release's real
``PrepareAndFinalizeWithAllGather.prepare`` (all-gather over DP, then PCP), multiplies the gathered
tokens by ``rank + 1`` (its experts' share: every rank is an EP rank, the shares sum to 10 over the world)
and runs the real ``finalize``. Correct = every rank gets back exactly its own tokens times the sum of
the shares of the ranks that reduced them (10 with DP and PCP on).

Groups: real gloo subgroups of one 4-rank world (loopback only), behind :class:`ascend_finalize.Coordinator`.
Layouts: "mapping" -- vLLM ``_PCP`` over omni's "sp" ranks and ``_DP`` over "cfg-dp" (SP2·CFG2), computed by
the REAL ``RankGenerator`` of vllm-omni's ``parallel_state.py`` (what ``moe-ep-parallel-mapping`` builds; the
driver checks it equals vLLM's own rank formula dp·pcp·tp + pcp·tp + tp); "transposed" -- the other
pairing of the same four ranks (the fix must not depend on rank numbering).

Modes (``job["mode"]``):

* ``matrix``: for every release in ``job["releases"]`` the real file is loaded in-process
  (:func:`ascend_finalize.load`), the patch applied and undone through its own ``check``/``apply`` with a
  :class:`omni_patches.context.PatchContext` (the engine's path, minus the version gate -- the contract test
  covers that), and each scenario run stock, patched, with the first fixed release's method on the same
  instance, and through the fixed release's own prepare+finalize.
* ``engine``: ``sys.path`` holds :func:`ascend_finalize.sandbox_dir` of one release; the target is imported,
  run stock, then ``omni_patches.activate()`` (OMNI_PATCHES=1) patches it through the engine, and run again.

Entry point for tests: :func:`run_world` (on the shared driver, :func:`support.worlds.run_worlds`).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

WORLD = 4
OMNI_FOR_LAYOUT = "0.22.0"  # the vllm-omni whose RankGenerator the EP mapping uses (0.18-0.22: same code)
VLLM_LAYOUT = {"dp": [[0, 2], [1, 3]], "pcp": [[0, 1], [2, 3]]}  # dp·pcp·tp + pcp·tp + tp, TP1
LAYOUTS = {"mapping": None, "transposed": {"dp": [[0, 1], [2, 3]], "pcp": [[0, 2], [1, 3]]}}

# name -> tokens per rank, flags. max_dp: the DP padding target (vLLM pads to the max over DP); pcp_pad: rows
# above DP·max_dp that the PCP padding target adds (0.16+ pad before the PCP gather).
SCENARIOS = {
    "even": {"n": [4, 4, 4, 4]},  # stock: wrong length, other ranks' tokens
    "odd": {"n": [3, 3, 3, 3]},  # stock: the PCP reduce-scatter cannot split 3 rows in 2
    "ragged-padded": {"n": [3, 2, 3, 1], "pcp_pad": 2, "stock": False},  # stock would deadlock: no stock run
    "shared-expert-dp": {"n": [4, 4, 4, 4], "shared": True, "oracle": False},  # DP step off: stock runs
    "dp-only": {"n": [3, 2, 3, 1], "pcp_size": 1},
    "pcp-only": {"n": [3, 3, 3, 3], "dp_size": 1},
    # 0.13-0.20 gate the PCP steps on prefill_context_parallel_enable(); the fixed releases do not (no
    # comparison with them), and newer ones ignore it (not run there).
    "context-parallel-off": {"n": [3, 2, 3, 1], "context_parallel": False, "gated_only": True},
}


# --------------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------------
def run_world(job: dict, *, timeout: float = 420) -> list[dict]:
    """Run ``job`` (mode, releases or sandbox, ...) in a fresh driver process; return the 4 ranks' dicts."""
    from support import worlds

    world = {"world_size": WORLD, "scenario": f"{__name__}:rank_scenario", "params": job,
             "prepare": f"{__name__}:with_layouts"}
    return worlds.run_worlds(job.get("sys_path", []), [world], preload=["torch", "torch.distributed"],
                             timeout=timeout + 25, grace_after_error=10)[0]


# --------------------------------------------------------------------------------------------------
# Driver: layouts from the real omni RankGenerator, then the ranks
# --------------------------------------------------------------------------------------------------
def mapping_layout(omni_root: str) -> dict:
    """vLLM _PCP / _DP rank lists as moe-ep-parallel-mapping builds them (SP2·CFG2), by omni's own code (the
    real parallel_state.py; what it imports: stand-ins, only its RankGenerator is used)."""
    from omni_patches.testing.standins import Finder

    finder = Finder("omni-layout", ("vllm", "vllm_omni"))
    sys.meta_path.insert(0, finder)
    try:
        path = Path(omni_root) / "vllm_omni/diffusion/distributed/parallel_state.py"
        name = "vllm_omni.diffusion.distributed.parallel_state"  # its relative imports need the real name
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        gen = mod.RankGenerator(tp=1, sp=2, pp=1, cfg=2, dp=1, order="tp-sp-pp-cfg-dp")
        return {"dp": gen.get_ranks("cfg-dp"), "pcp": gen.get_ranks("sp"), "ep": gen.get_ranks("tp-sp-cfg-dp")}
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] in ("vllm", "vllm_omni")]:
            del sys.modules[name]


def with_layouts(job: dict) -> dict:
    """In the driver, before the ranks: the layouts, the mapping's from omni's own code."""
    layouts = dict(LAYOUTS)
    mapping = mapping_layout(job["omni_root"])
    layouts["mapping"] = {"dp": mapping["dp"], "pcp": mapping["pcp"]}
    return {**job, "layouts": layouts,
            "mapping_facts": {**mapping, "equals_vllm_formula": layouts["mapping"] == VLLM_LAYOUT}}


# --------------------------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------------------------
def rank_scenario(rank: int, world_size: int, job: dict) -> dict:
    import datetime

    import torch.distributed as dist

    # short: a rank stuck in a collective its peers never enter fails the test in seconds, not minutes
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=20))
    groups = _groups(rank, job["layouts"])
    return {"results": (_matrix if job["mode"] == "matrix" else _engine)(rank, job, groups),
            "mapping_facts": job["mapping_facts"]}


def _groups(rank: int, layouts: dict) -> dict:
    """{layout: {"dp": Coordinator, "pcp": Coordinator}}; every rank creates every subgroup, in one order."""
    import torch.distributed as dist

    from patches.ascend_allgather_finalize_order.ascend_finalize import Coordinator

    made: dict[tuple, object] = {}
    out: dict = {}
    for name, layout in sorted(layouts.items()):
        out[name] = {}
        for kind in ("dp", "pcp"):
            for ranks in layout[kind]:
                key = tuple(ranks)
                if key not in made:
                    made[key] = dist.new_group(list(ranks))
                if rank in ranks:
                    out[name][kind] = Coordinator(kind, ranks, made[key], rank)
    return out


def _tokens(rank: int, n: int):
    import torch

    ids = torch.arange(n, dtype=torch.float32) + rank * 100 + 1
    return torch.stack([ids, 2 * ids, torch.full_like(ids, rank), torch.arange(n, dtype=torch.float32)], dim=1)


def _setup(sc: dict, rank: int, groups: dict):
    """Configure the stand-ins for scenario ``sc``; return (moe_config, x, expected factor or None)."""
    from patches.ascend_allgather_finalize_order import ascend_finalize as af

    dp_size, pcp_size = sc.get("dp_size", 2), sc.get("pcp_size", 2)
    af.set_groups(groups["dp"], groups["pcp"])
    af.FLAGS.context_parallel = sc.get("context_parallel", True)
    max_dp = max(sc["n"])
    af.FORWARD.max_tokens_across_dp = max_dp
    # what reaches the PCP gather: DP-padded and gathered (DP on) or the local tokens (uniform when DP is off)
    af.FORWARD.max_tokens_across_pcp = (dp_size * max_dp if dp_size > 1 else max_dp) + sc.get("pcp_pad", 0)
    cfg = types.SimpleNamespace(dp_size=dp_size, pcp_size=pcp_size, tp_size=1, ep_size=WORLD, tp_rank=0,
                                dp_rank=groups["dp"].rank_in_group, pcp_rank=groups["pcp"].rank_in_group,
                                dp_group=groups["dp"], pcp_group=groups["pcp"], is_sequence_parallel=False)
    x = _tokens(rank, sc["n"][rank])
    if sc.get("oracle", True) is False:
        return cfg, x, None
    reducers = {rank}
    if dp_size > 1:
        reducers |= set(groups["dp"].ranks)
    if pcp_size > 1 and af.FLAGS.context_parallel:
        reducers |= set(groups["pcp"].ranks)
    if dp_size > 1 and pcp_size > 1 and af.FLAGS.context_parallel:
        reducers = set(range(WORLD))
    return cfg, x, float(sum(r + 1 for r in reducers))


def _pipeline(module, sc: dict, rank: int, groups: dict, finalize=None) -> dict:
    """prepare -> this rank's expert share -> finalize (the instance's, or ``finalize(obj, y, True)``)."""
    import inspect

    import torch

    from patches.ascend_allgather_finalize_order import ascend_finalize as af

    cfg, x, factor = _setup(sc, rank, groups)
    cls = module.PrepareAndFinalizeWithAllGather
    obj = cls(cfg)
    logits = torch.zeros(x.shape[0], 8)
    kwargs = {}
    if "enable_shared_expert_dp" in inspect.signature(obj.prepare).parameters:
        kwargs["enable_shared_expert_dp"] = sc.get("shared", False)
    prepared = obj.prepare(x, logits, **kwargs)
    gathered = prepared.hidden_states if isinstance(prepared, af.Record) else prepared[0]
    y = gathered * float(rank + 1)
    af.TRACE.clear()
    res: dict = {"gathered_rows": int(gathered.shape[0])}
    try:
        out = obj.finalize(y, True) if finalize is None else finalize(obj, y, True)
    except AssertionError as exc:  # a length check before any data moved: every rank agrees, go on
        if sc.get("stock", True) is False:
            raise  # ragged lengths: ranks may disagree, and a peer may be waiting in a collective -- stop
        res.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300], trace=list(af.TRACE))
        return res
    # anything else (a gloo timeout: ranks disagreed on a collective) ends this rank: later collectives
    # would pair up wrongly
    res.update(ok=True, rows=int(out.shape[0]), trace=list(af.TRACE), out=out.tolist())
    try:  # what vLLM does next: add the shared experts' output, one row per own token
        out + torch.zeros_like(x)
    except RuntimeError as exc:
        res["combine_error"] = str(exc)[:200]
    if factor is not None:
        want = x * factor
        res["own_rows"] = int(x.shape[0])
        res["correct"] = bool(out.shape == want.shape and torch.equal(out, want))
        # whose tokens landed here: token id = column 0 / factor, owner = id // 100
        ids = [round(v / factor) for v in out[:, 0].tolist()] if out.numel() else []
        res["owners"] = sorted({(i - 1) // 100 for i in ids})
        # every EP rank's experts reached these tokens (the shares of all 4 ranks sum to 10)
        res["all_experts"] = bool(out.shape == x.shape and torch.equal(out, x * float(sum(range(1, WORLD + 1)))))
    return res


def _patch(module, version: str):
    """Apply the patch to ``module`` through its own check/apply; returns (outcome, describe, undo records)."""
    from omni_patches import registry
    from omni_patches.context import Drift, FixedUpstream, PatchContext
    from patches.ascend_allgather_finalize_order import ascend_finalize as af

    spec = registry.load([registry.builtin_path()]).specs[af.PATCH_ID]
    impl = importlib.import_module(spec.module)
    sink: list = []
    ctx = PatchContext(spec, af.TARGET, module, {"vllm-ascend": version}, sink=sink)
    try:
        impl.check(ctx)
        impl.apply(ctx)
    except FixedUpstream as exc:
        return "fixed upstream", str(exc), sink
    except Drift as exc:
        return "drifted", str(exc), sink
    return "applied", "; ".join(ctx.found), sink


def _matrix(rank: int, job: dict, all_groups: dict) -> dict:
    """Per release: verdict, then per layout and scenario the patched, stock and fixed-method runs; the
    first fixed release's own pipeline once per layout and scenario (key "fixed_release")."""
    from patches.ascend_allgather_finalize_order import ascend_finalize as af

    fixed_mod = af.load(job["fixed"])
    fixed_fn = fixed_mod.PrepareAndFinalizeWithAllGather.__dict__["_finalize_with_dp_group"]
    results: dict = {"fixed_release": {}}
    for lname in sorted(all_groups):
        results["fixed_release"][lname] = {
            s: _pipeline(fixed_mod, sc, rank, all_groups[lname]) for s, sc in SCENARIOS.items()
            if not sc.get("gated_only")}
    for version in job["releases"]:
        module = af.load(version)
        gated = "prefill_context_parallel_enable" in vars(module)
        runs = {s: sc for s, sc in SCENARIOS.items() if gated or not sc.get("gated_only")}
        outcome, found, sink = _patch(module, version)
        entry: dict = {"outcome": outcome, "found": found, "gated": gated, "layouts": {}}
        for lname in sorted(all_groups):
            entry["layouts"][lname] = {s: {} for s in runs}
        if outcome == "applied":
            for lname, groups in sorted(all_groups.items()):
                for s, sc in runs.items():
                    entry["layouts"][lname][s]["patched"] = _pipeline(module, sc, rank, groups)
        for rec in reversed(sink):
            rec.undo()
        for lname, groups in sorted(all_groups.items()):
            for s, sc in runs.items():
                row = entry["layouts"][lname][s]
                if sc.get("stock", True) or outcome == "fixed upstream":  # a fixed stock cannot deadlock
                    row["stock"] = _pipeline(module, sc, rank, groups)
                if outcome == "applied" and not sc.get("gated_only"):
                    row["fixed_fn"] = _pipeline(module, sc, rank, groups, finalize=_fixed_on_old(fixed_fn))
        results[version] = entry
    return results


def _fixed_on_old(fixed_fn):
    """The first fixed release's method on an old release's instance. 0.13-0.15 never set ``num_tokens_pcp``
    (they do not pad for PCP): give it the un-padded length it would have recorded."""

    def call(obj, y, reduce_results):
        if getattr(obj, "num_tokens_pcp", None) is None and obj.moe_config.pcp_size > 1:
            obj.num_tokens_pcp = y.shape[0] // obj.moe_config.pcp_size
        return fixed_fn(obj, y, reduce_results)

    return call


def _engine(rank: int, job: dict, all_groups: dict) -> dict:
    import omni_patches
    from patches.ascend_allgather_finalize_order import ascend_finalize as af

    module = importlib.import_module(af.TARGET)  # the sandbox's real file, engine not active yet
    groups = all_groups["mapping"]
    out: dict = {"file": module.__file__}
    safe = [s for s in job["scenarios"] if SCENARIOS[s].get("stock", True)]  # stock ragged would deadlock
    out["stock"] = {s: _pipeline(module, SCENARIOS[s], rank, groups) for s in safe}
    os.environ["OMNI_PATCHES"] = "1"
    out["activated"] = omni_patches.activate()
    st = {s.id: s for s in omni_patches.status()}[af.PATCH_ID]
    out["status"] = {"state": st.state, "reason": st.reason}
    out["patched"] = {s: _pipeline(module, SCENARIOS[s], rank, groups) for s in job["scenarios"]}
    omni_patches.unapply(af.PATCH_ID)
    out["undone"] = {s: _pipeline(module, SCENARIOS[s], rank, groups) for s in safe}
    return out

