"""Per-rank facts for the EP equivalence test (patched 0.18/0.20/0.22 vs stock 0.24.0), and their diff.

Runs inside the ranks of :func:`support.ep_world.run_worlds` (see ``moe_ep_scenarios.phases_scenario``).
Everything read here is real: vLLM's and omni's group objects, vLLM's device communicator and all2all
manager classes, the parallel config.

The all2all capture. vLLM's ``All2AllManagerBase.__init__`` reads ``get_dp_group()`` and ``get_tp_group()``
once, when the EP group's device communicator is built (inside ``init_model_parallel_group(...,
group_name="ep")``, before the caller assigns ``_EP``). On CPU, ``CpuCommunicator`` builds a manager only
when the vLLM config's ``data_parallel_size`` > 1, so TP4·U2 or TP8 would show nothing. :func:`install_probe`
therefore wraps the platform's communicator class ``__init__`` (``unittest.mock.patch.object``, the engine
pytest-mock uses): right after an EP communicator (``is_ep_communicator``) is built it records the manager the
communicator built, or else builds vLLM's own ``All2AllManagerBase`` on the same ``cpu_group``, the way the
communicator would, at that same moment. Both record what the manager captured as DP and TP. Where a real
manager exists the test checks that the probe agrees with it; the manager's class (Naive on vLLM 0.18,
AllGather-ReduceScatter later) depends on the vLLM release, not on the patch, and is not compared.
"""
from __future__ import annotations

CAPTURED: list[dict] = []
VLLM_NAMES = ("_TP", "_PCP", "_DP", "_EP", "_PP")
OMNI_NAMES = ("_SP", "_CFG", "_DP", "_PP", "_FS")
CONFIG_FIELDS = ("tensor_parallel_size", "data_parallel_size", "prefill_context_parallel_size",
                 "pipeline_parallel_size", "enable_expert_parallel")
# Facts that name the vLLM release rather than the layout: shown, never compared.
NOT_COMPARED = ("manager_class",)


def coordinator(g) -> dict | None:
    """A group coordinator as comparable facts. ``coordinator`` is ``<top package>.<class>``: vLLM's
    GroupCoordinator is ``vllm.GroupCoordinator``, omni's ``vllm_omni.GroupCoordinator``."""
    if g is None:
        return None
    cls = type(g)
    dc = getattr(g, "device_communicator", None)
    return {"coordinator": f"{cls.__module__.split('.')[0]}.{cls.__qualname__}",
            "ranks": list(getattr(g, "ranks", []) or []), "world_size": getattr(g, "world_size", None),
            "rank_in_group": getattr(g, "rank_in_group", None),
            "device_communicator": None if dc is None else type(dc).__name__,
            # vLLM's unique name without its per-process counter ("tp:3" -> "tp"): the group name decides
            # behaviour (EP communicator, CPU SHM for tp/pp); the counter only counts earlier groups.
            "unique_name": (getattr(g, "unique_name", None) or ":").split(":")[0] or None,
            "live": getattr(g, "cpu_group", None) is not None and getattr(g, "device_group", None) is not None}


def _manager(mgr, kind: str) -> dict:
    return {"kind": kind, "manager_class": type(mgr).__name__,
            "dp": coordinator(mgr.dp_group), "tp": coordinator(mgr.tp_group),
            "dp_rank": mgr.dp_rank, "dp_world_size": mgr.dp_world_size,
            "rank": mgr.rank, "world_size": mgr.world_size}


def install_probe() -> None:
    """setup hook (every rank, before the scenario): record what each EP all2all manager captures."""
    from unittest import mock

    from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname

    comm_cls = resolve_obj_by_qualname(current_platform.get_device_communicator_cls())
    original = comm_cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if not getattr(self, "is_ep_communicator", False):
            return
        rec: dict = {"unique_name": self.unique_name.split(":")[0], "use_all2all": bool(self.use_all2all)}
        try:
            rec["real"] = None if self.all2all_manager is None else _manager(self.all2all_manager, "real")
            # What the communicator would have captured: vLLM's base manager on the same group, same moment.
            rec["probe"] = _manager(All2AllManagerBase(self.cpu_group), "probe")
        except Exception as exc:  # e.g. get_dp_group() asserting: that is a fact too
            rec["error"] = f"{type(exc).__name__}: {exc}"
        CAPTURED.append(rec)

    mock.patch.object(comm_cls, "__init__", __init__).start()  # lives as long as the rank


def layout_facts() -> dict:
    """vLLM and omni groups of this rank, which vLLM group is omni's own object, the vLLM parallel config."""
    import vllm.distributed.parallel_state as vps
    from vllm.config import get_current_vllm_config

    import vllm_omni.diffusion.distributed.parallel_state as ops

    v = {n: getattr(vps, n, None) for n in VLLM_NAMES}
    o = {n: getattr(ops, n, None) for n in OMNI_NAMES}
    pc = get_current_vllm_config().parallel_config
    return {
        "vllm": {n: coordinator(g) for n, g in v.items()},
        "omni": {n: coordinator(g) for n, g in o.items()},
        # upstream keeps omni's _DP/_PP/_SP objects for omni and gives vLLM companions where it needs them
        "aliases": {"_DP is omni _DP": v["_DP"] is not None and v["_DP"] is o["_DP"],
                    "_PP is omni _PP": v["_PP"] is not None and v["_PP"] is o["_PP"],
                    "_PCP is omni _SP": v["_PCP"] is not None and v["_PCP"] is o["_SP"]},
        "vllm_parallel_config": {k: getattr(pc, k, None) for k in CONFIG_FIELDS},
    }


def after_destroy_facts() -> dict:
    import vllm.distributed.parallel_state as vps

    out = {}
    for n in VLLM_NAMES:
        g = getattr(vps, n, None)
        out[n] = None if g is None else {"coordinator": coordinator(g)["coordinator"], "live": coordinator(g)["live"]}
    return out


def diff(a, b, path: str = "") -> list[str]:
    """Every leaf where ``a`` and ``b`` differ, as 'path: a != b' ([] = identical)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k in NOT_COMPARED:
                continue
            out += diff(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{path}.{k}" if path else str(k))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and any(isinstance(x, dict) for x in a):
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += diff(x, y, f"{path}[{i}]")
        return out
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def diff_ranks(ranks_a: list[dict], ranks_b: list[dict]) -> list[str]:
    out = []
    for r, (a, b) in enumerate(zip(ranks_a, ranks_b)):
        out += [f"rank {r}: {d}" for d in diff(a, b)]
    if len(ranks_a) != len(ranks_b):
        out.append(f"{len(ranks_a)} ranks != {len(ranks_b)} ranks")
    return out
