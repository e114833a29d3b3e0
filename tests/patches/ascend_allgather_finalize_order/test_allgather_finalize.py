"""ascend-allgather-finalize-order on the REAL prepare_finalize.py of every vllm-ascend release (torch_npu stubbed).

* Survey: each release file's ``_finalize_with_dp_group`` reduce-scatters DP first (AFFECTED) or PCP first
  (FIXED), read from the file's text independently of the patch.
* Audit: ``omni-patches audit`` (in-process, on the cached release files) gives "would apply" on every
  affected release, "skip: fixed upstream" on every fixed one -- by version and, for source builds, by
  feature -- and "skip: out of range" on 0.12.0rc1.
* Behaviour: 4 processes, real gloo groups on loopback (``ascend_finalize_world``): DP2·PCP2·EP4 in the
  layout ``moe-ep-parallel-mapping`` builds (vLLM _PCP over omni's "sp" ranks, _DP over "cfg-dp", computed by
  vllm-omni 0.22.0's real ``RankGenerator``) and the transposed one. Every affected release runs the real
  ``prepare`` (DP all-gather, then PCP) and ``finalize``: stock puts other ranks' tokens on a rank at half
  the length (vLLM's next add fails with upstream's "The size of tensor a (2) must match the size of tensor b
  (4)") or fails splitting 3 rows over PCP2; patched, every rank gets exactly its own tokens, equal to the
  first fixed release's method on the same instance (same outputs, same collectives on the same groups in
  the same order with the same shapes) and to that release's own prepare+finalize. Where only one axis is
  on, patched and stock are identical. No collective needs a model: gloo (torch 2.13) has
  ``all_gather_into_tensor`` and ``reduce_scatter_tensor``; only vLLM's ``GroupCoordinator`` around them is
  ours (``ascend_finalize.Coordinator``, same semantics, including its divisibility assertion).
* Engine: the same world with the patch activated through ``OMNI_PATCHES=1`` on a sandbox of 0.23.0.post1.
* Safety: failure injection with pytest-mock -- anything unexpected before the first collective means the
  stock method runs, once.
"""
import ast
import json
import os
import re
import types

import pytest

from omni_patches import registry
from omni_patches.tools import audit
from omni_patches.context import Drift, FixedUpstream, PatchContext
from omni_patches.patches import ascend_allgather_finalize_order as patch
from omni_patches.runs import PatchRun
from patches.ascend_allgather_finalize_order import ascend_finalize as af
from patches.ascend_allgather_finalize_order import ascend_finalize_world as world
from support import wheels

ALL = [*af.OUT_OF_RANGE, *af.AFFECTED, *af.FIXED]
SOURCE_BUILD = "0.19.1rc2.dev1637+g182b75ea8"
SIZE_ERROR = "The size of tensor a (2) must match the size of tensor b (4) at non-singleton dimension 0"


def _method_text(version):
    text = af.real_file(version).read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == patch.CLASS:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == patch.METHOD:
                    return ast.get_source_segment(text, item)
    return None


GATED = [*af.OUT_OF_RANGE, *af.AFFECTED[:af.AFFECTED.index("0.21.0rc1")]]  # PCP steps behind the CP switch


@pytest.mark.parametrize("version", ALL)
def test_release_file_survey(version):
    """The release lists are what the files say (read here from the text, independently of the patch)."""
    text = _method_text(version)
    assert text is not None, f"{version}: no {patch.CLASS}.{patch.METHOD}"
    dp = text.index("get_dp_group().reduce_scatter(")
    pcp = text.index("get_pcp_group().reduce_scatter(")
    assert (dp < pcp) == (version not in af.FIXED), f"{version}: DP at {dp}, PCP at {pcp}"
    assert ("prefill_context_parallel_enable()" in text) == (version in GATED)


def _audit(version, pinned):
    dists = audit.obtain(specs=[f"vllm-ascend=={pinned}"], sources=[str(af.release_dir(version))])
    results = {r.id: r for r in audit.run(dists, registry.load([registry.builtin_path()]))}
    return results[af.PATCH_ID]


@pytest.mark.parametrize("version", ALL)
def test_audit_verdict_by_version(version):
    r = _audit(version, version)
    want = {**{v: audit.WOULD_APPLY for v in af.AFFECTED}, **{v: audit.FIXED for v in af.FIXED},
            **{v: audit.OUT_OF_RANGE for v in af.OUT_OF_RANGE}}[version]
    assert r.verdict == want, (r.verdict, r.detail)
    if want == audit.WOULD_APPLY:
        assert "DP reduce-scatter before PCP" in r.detail, r.detail
    if want == audit.FIXED:
        assert "fixed upstream in vllm-ascend 0.24.0rc1" in r.detail


@pytest.mark.parametrize("version", ALL)
def test_audit_verdict_of_a_source_build_is_by_feature(version):
    """A checkout reports 0.19.1rc2.dev…: the version says nothing, the reduce-scatter order decides."""
    r = _audit(version, SOURCE_BUILD)
    if version in af.FIXED:
        assert r.verdict == audit.FIXED and "PCP reduce-scatter already comes first" in r.detail, r.detail
    elif version in af.AFFECTED:
        assert r.verdict == audit.WOULD_APPLY and "decided by code features" in r.detail, r.detail
    else:  # 0.12.0rc1: a TP all-reduce follows the two steps -- not the shape this patch knows
        assert r.verdict == audit.DRIFTED and "two reduce-scatter steps" in r.detail, r.detail


def test_audit_cli_on_a_release(capsys):
    from omni_patches import cli

    rc = cli.main(["audit", "--json", "--source", str(af.release_dir("0.23.0.post1")), "vllm-ascend==0.23.0.post1"])
    out = json.loads(capsys.readouterr().out)
    got = {p["id"]: p for p in out["patches"]}[af.PATCH_ID]
    assert got["verdict"] == audit.WOULD_APPLY and "found: " in got["detail"], got
    assert rc == 0


# --------------------------------------------------------------------------------------------------
# gloo worlds
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def matrix():
    for v in [*af.AFFECTED, *af.FIXED]:
        af.real_file(v)
    job = {"mode": "matrix", "releases": [*af.AFFECTED, *af.FIXED], "fixed": af.FIRST_FIXED,
           "omni_root": str(wheels.fetch_or_skip("vllm-omni", world.OMNI_FOR_LAYOUT))}
    ranks = world.run_world(job, timeout=600)
    for r in ranks:
        assert "error" not in r, f"rank {r['rank']}: {r['error']}\n{r.get('traceback')}"
    print(f"matrix world: {ranks[0]['world_wall_s']} s wall, scenarios {ranks[0]['scenario_s']} s")
    return ranks


def _rows(matrix, version):
    """(rank, layout, scenario, row) over every rank, layout and scenario of ``version``."""
    for r in matrix:
        for lname, per in r["results"][version]["layouts"].items():
            for sname, row in per.items():
                yield r["rank"], lname, sname, row


def test_mapping_layout_is_vllms_rank_formula(matrix):
    facts = matrix[0]["mapping_facts"]
    assert facts["equals_vllm_formula"], facts
    assert facts["ep"] == [[0, 1, 2, 3]]  # the EP group spans TP·SP·CFG·DP = 4 ranks


@pytest.mark.parametrize("version", af.AFFECTED)
def test_stock_misroutes_tokens(matrix, version):
    foreign = 0
    for rank, lname, sname, row in _rows(matrix, version):
        st = row.get("stock")
        if sname == "even":
            assert st["ok"] and st["rows"] == 2 and not st["correct"], (rank, lname, st)
            assert st["combine_error"] == SIZE_ERROR
            foreign += st["owners"] != [rank]
        elif sname == "odd":
            assert not st["ok"] and "do not split" in st["error"], (rank, lname, st)
    assert foreign >= 4, "stock should hand some ranks other ranks' tokens"


@pytest.mark.parametrize("version", af.AFFECTED)
def test_patched_every_token_lands_on_its_own_rank(matrix, version):
    entry = matrix[0]["results"][version]
    assert entry["outcome"] == "applied", entry
    assert entry["found"].startswith(f"{patch.CLASS}.{patch.METHOD} (DP reduce-scatter before PCP")
    for rank, lname, sname, row in _rows(matrix, version):
        got = row["patched"]
        assert got["ok"], (rank, lname, sname, got)
        if got.get("correct") is not None:
            assert got["correct"] and got["owners"] == [rank] and "combine_error" not in got, (rank, lname, sname)


@pytest.mark.parametrize("version", af.AFFECTED)
def test_patched_equals_the_first_fixed_release(matrix, version):
    for rank, lname, sname, row in _rows(matrix, version):
        if "fixed_fn" not in row:
            continue  # context-parallel-off: 0.24 has no such gate
        got, want = row["patched"], row["fixed_fn"]
        assert got["out"] == want["out"], (rank, lname, sname)
        assert got["trace"] == want["trace"], (rank, lname, sname, got["trace"], want["trace"])
        end_to_end = next(r for r in matrix if r["rank"] == rank)["results"]["fixed_release"][lname][sname]
        assert got["out"] == end_to_end["out"], (rank, lname, sname)


@pytest.mark.parametrize("version", af.AFFECTED)
def test_one_axis_is_stock(matrix, version):
    """DP only, PCP only, shared-expert DP, context parallel off: the stock method runs, nothing else."""
    for rank, lname, sname, row in _rows(matrix, version):
        if sname in ("dp-only", "pcp-only", "shared-expert-dp", "context-parallel-off"):
            assert row["patched"]["out"] == row["stock"]["out"], (rank, lname, sname)
            assert row["patched"]["trace"] == row["stock"]["trace"], (rank, lname, sname)
        elif sname == "even":
            assert [t[:2] for t in row["patched"]["trace"]] == [["pcp", "reduce_scatter"], ["dp", "reduce_scatter"]]
            assert [t[:2] for t in row["stock"]["trace"]] == [["dp", "reduce_scatter"], ["pcp", "reduce_scatter"]]


@pytest.mark.parametrize("version", GATED[1:])
def test_gated_releases_gather_over_pcp_only_with_the_switch(matrix, version):
    """0.13-0.20 run both PCP steps only under VLLM_ASCEND_ENABLE_CONTEXT_PARALLEL=1 (0.20: also
    additional_config enable_context_parallel). Off, prepare never gathers over PCP: with EP over DP·PCP
    (moe-ep-parallel-mapping) a token then reaches only the experts of its PCP index -- patched or not."""
    for rank, lname, sname, row in _rows(matrix, version):
        if sname == "context-parallel-off":
            assert row["patched"]["correct"] and not row["patched"]["all_experts"], (rank, lname)
            assert row["stock"]["out"] == row["patched"]["out"]
        elif sname == "even":
            assert row["patched"]["all_experts"] and not row["stock"]["correct"], (rank, lname)


@pytest.mark.parametrize("version", af.FIXED)
def test_fixed_releases_are_skipped_and_correct(matrix, version):
    entry = matrix[0]["results"][version]
    assert entry["outcome"] == "fixed upstream" and "already comes first" in entry["found"], entry
    for rank, lname, sname, row in _rows(matrix, version):
        st = row["stock"]
        assert st["ok"], (rank, lname, sname, st)
        if st.get("correct") is not None:
            assert st["correct"] and st["owners"] == [rank], (rank, lname, sname)


def test_engine_applies_it_in_every_rank():
    """OMNI_PATCHES=1 on a sandbox of the real 0.23.0.post1 file: the engine patches the imported module."""
    sandbox = af.sandbox_dir("0.23.0.post1")
    job = {"mode": "engine", "scenarios": ["even", "odd", "ragged-padded"], "sys_path": [str(sandbox)],
           "omni_root": str(wheels.fetch_or_skip("vllm-omni", world.OMNI_FOR_LAYOUT))}
    ranks = world.run_world(job, timeout=300)
    for r in ranks:
        assert "error" not in r, f"rank {r['rank']}: {r['error']}\n{r.get('traceback')}"
        res = r["results"]
        assert res["file"].startswith(str(sandbox))
        assert res["status"]["state"] == "applied", res["status"]
        assert "DP reduce-scatter before PCP" in res["status"]["reason"]
        assert not res["stock"]["even"]["correct"] and not res["stock"]["odd"]["ok"]
        for s in ("even", "odd", "ragged-padded"):
            assert res["patched"][s]["correct"], (r["rank"], s, res["patched"][s])
        assert not res["undone"]["even"]["correct"]  # unapply restores the stock method


# --------------------------------------------------------------------------------------------------
# in-process: detection corners and safety (no collectives: a recording group)
# --------------------------------------------------------------------------------------------------
class _Group:
    """Records reduce-scatters (group, dim, input shape) and returns the first half: no collective."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def reduce_scatter(self, x, dim=-1):
        self.calls.append((self.name, dim, tuple(x.shape)))
        return x[: x.shape[0] // 2]


_ROOTS = ("vllm", "vllm_ascend", "torch_npu")


@pytest.fixture
def in_process():
    """Load real release files into this process; stand-ins, sys.modules and torch.npu restored afterwards."""
    import sys

    import torch

    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in _ROOTS}
    meta, had_npu = list(sys.meta_path), hasattr(torch, "npu")
    try:
        yield af.load
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] in _ROOTS]:
            del sys.modules[k]
        sys.modules.update(saved)
        sys.meta_path[:] = meta
        if not had_npu and hasattr(torch, "npu"):
            del torch.npu


def _ctx(module, version="0.23.0.post1", sink=None):
    spec = registry.load([registry.builtin_path()]).specs[af.PATCH_ID]
    return PatchContext(spec, af.TARGET, module, {"vllm-ascend": version}, sink=sink)


def _instance(module):
    obj = module.PrepareAndFinalizeWithAllGather.__new__(module.PrepareAndFinalizeWithAllGather)
    obj.moe_config = types.SimpleNamespace(dp_size=2, pcp_size=2)
    obj.enable_shared_expert_dp, obj.num_tokens, obj.num_tokens_pcp = False, 3, 6
    return obj


def test_reorders_both_steps_with_upstreams_arguments(in_process):
    import torch

    module = in_process("0.23.0.post1")
    sink = []
    patch.apply(_ctx(module, sink=sink))
    calls = []
    af.set_groups(_Group("dp", calls), _Group("pcp", calls))
    try:
        out = _instance(module).finalize(torch.zeros(24, 4), True)
    finally:
        for rec in reversed(sink):
            rec.undo()
    assert calls == [("pcp", 0, (24, 4)), ("dp", 0, (6, 4))]  # PCP, keep num_tokens_pcp=6, DP, keep num_tokens=3
    assert out.shape == (3, 4)
    assert module.PrepareAndFinalizeWithAllGather.__dict__[patch.METHOD].__module__ == af.TARGET  # undone


@pytest.mark.parametrize("broken", ["no pcp_size", "no num_tokens_pcp", "no num_tokens", "guard raises"])
def test_anything_unexpected_runs_the_stock_method_once(in_process, mocker, broken):
    import torch

    module = in_process("0.18.0")  # the gated layout: the guard is one more thing to read
    stock = module.PrepareAndFinalizeWithAllGather.__dict__[patch.METHOD]
    layout, why = patch.finalize_layout(stock)
    assert layout is not None and layout.guard == "prefill_context_parallel_enable", why
    layout.prepare_pads_pcp = True
    spy = mocker.MagicMock(side_effect=RuntimeError("stock ran"))
    ours = patch.make_finalize(spy, vars(module), layout, PatchRun.standalone(patch.PATCH_ID))
    calls = []
    af.set_groups(_Group("dp", calls), _Group("pcp", calls))
    obj = _instance(module)
    if broken == "no pcp_size":
        obj.moe_config = types.SimpleNamespace(dp_size=2)
    elif broken == "guard raises":
        mocker.patch.dict(vars(module), {"prefill_context_parallel_enable": mocker.MagicMock(side_effect=KeyError)})
    else:
        delattr(obj, broken[3:])
    with pytest.raises(RuntimeError, match="stock ran"):
        ours(obj, torch.zeros(24, 4), True)
    assert spy.call_count == 1 and calls == []  # nothing of ours ran before the stock method


def test_a_missing_group_is_the_stock_methods_own_failure(in_process, mocker):
    import torch

    module = in_process("0.23.0.post1")
    sink = []
    patch.apply(_ctx(module, sink=sink))
    calls = []
    af.set_groups(_Group("dp", calls), _Group("pcp", calls))
    mocker.patch.dict(vars(module), {"get_pcp_group": mocker.MagicMock(side_effect=AssertionError("no PCP group"))})
    try:
        with pytest.raises(AssertionError, match="no PCP group"):
            _instance(module).finalize(torch.zeros(24, 4), True)
    finally:
        for rec in reversed(sink):
            rec.undo()
    assert calls == [("dp", 0, (24, 4))]  # stock ran: DP first, then it asked for the PCP group itself


def test_without_source_only_fixed_can_be_told(in_process):
    old = in_process("0.23.0.post1").PrepareAndFinalizeWithAllGather.__dict__[patch.METHOD]
    fixed = in_process(af.FIRST_FIXED).PrepareAndFinalizeWithAllGather.__dict__[patch.METHOD]
    for func in (old, fixed):
        blind = types.FunctionType(func.__code__.replace(co_filename="<no source>"), func.__globals__)
        layout, why = patch.finalize_layout(blind)
        if func is fixed:
            assert layout.fixed and layout.from_names, why
        else:
            assert layout is None and "cannot read the source" in why


def test_fixed_and_drift_reach_the_context(in_process):
    with pytest.raises(FixedUpstream, match="already comes first"):
        patch.check(_ctx(in_process(af.FIRST_FIXED)))
    old = in_process("0.21.0rc1")
    del old.PrepareAndFinalizeWithAllGather._finalize_with_dp_group
    with pytest.raises(Drift, match="defines no plain method"):
        patch.check(_ctx(old))


def test_registry_entry_matches_the_release_lists():
    spec = registry.load([registry.builtin_path()]).specs[af.PATCH_ID]
    from omni_patches import gates
    from packaging.version import Version

    rng = spec.requires["vllm-ascend"]
    assert all(gates.in_range(rng, Version(v)) for v in af.AFFECTED)
    assert not any(gates.in_range(rng, Version(v)) for v in [*af.FIXED, *af.OUT_OF_RANGE])
    assert spec.fixed_in == {"vllm-ascend": af.FIRST_FIXED}
    assert re.search(r"\b0\.24\.0rc1\b", patch.__doc__)
    assert os.path.basename(patch.__file__) == "ascend_allgather_finalize_order.py"
