"""ascend-camem-sleep-sync on the REAL ``vllm_ascend/device_allocator/camem.py`` of every vllm-ascend release.

Each release runs in a child of its own (``case.release(v).call(case.release_run)``): the real file, torch (CPU), and
the stand-ins of ``case.py`` for torch_npu (a model NPU with in-flight work and an ordered log of the host's calls),
vllm-ascend's C extension (map / unmap) and ``acl.rt.memcpy``. NPUWorker's sleep / wake_up at level 1
(``offload_tags=("weights",)``) and level 2 (``()``) run while a kernel (writing the weights) and an ACLGraph replay
(writing the KV cache) are still queued: stock, then patched in the same process, then unapplied. Upstream's fixed
releases (0.27.1rc1+) run the same inputs: the patched old releases must ask the device exactly what 0.27.1rc1 asks,
in the same order, and end the same way.
"""
import ast
import re
import types

import pytest

from omni_patches import registry
from omni_patches.patches import ascend_camem_sleep_sync as patch
from omni_patches.runs import PatchRun
from omni_patches.testing import releases
from patches.ascend_camem_sleep_sync import case

FIXED_RUN = case.FIRST_FIXED


@pytest.fixture(scope="module")
def runs():
    return {v: case.release(v).call(case.release_run) for v in [*case.AFFECTED, *case.FIXED]}


def _host(calls):
    """The host's calls after the scenario queued its work: ``synchronize`` / ``memcpy`` / ``unmap`` / ..."""
    return [c for c in calls if c[0] != "launch"]


def _names(calls):
    return [c[0] for c in _host(calls)]


def _outcome(run):
    return {k: run[k] for k in ("error", "faults", "backup", "wake_error", "weights_after_wake")}


# -- the real files: where each release stands ------------------------------------------------------------------------
def _sleep_node(version):
    path = releases.release_root("vllm-ascend", version) / case.CAMEM
    if not path.exists():
        return None
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == patch.CLASS)
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == patch.METHOD)


def _calls_in_order(node):
    """``(line, name)`` of every call to synchronize / memcpy / unmap_and_release in the method, by line."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in ("synchronize", "memcpy", "unmap_and_release"):
                out.append((n.lineno, name))
    return sorted(out)


@pytest.mark.parametrize("version", [*case.NO_CAMEM, *case.AFFECTED, *case.FIXED])
def test_each_release_file_is_where_the_lists_put_it(version):
    node = _sleep_node(version)
    if version in case.NO_CAMEM:
        assert node is None
        return
    names = [name for _, name in _calls_in_order(node)]
    if version in case.AFFECTED:
        assert "synchronize" not in names and {"memcpy", "unmap_and_release"} <= set(names), names
    else:  # upstream's fence: once, before the first offload copy and the first unmap, outside the loop
        assert names[0] == "synchronize" and names.count("synchronize") == 1, names
        loop = next(n for n in node.body if isinstance(n, ast.For))
        sync_line = _calls_in_order(node)[0][0]
        assert sync_line < loop.lineno


def test_registry_range_is_the_release_lists():
    from packaging.version import Version

    from omni_patches import gates

    spec = registry.load([registry.builtin_path()]).specs[case.PATCH_ID]
    rng = spec.requires["vllm-ascend"]
    assert all(gates.in_range(rng, Version(v)) for v in case.AFFECTED)
    assert not any(gates.in_range(rng, Version(v)) for v in [*case.NO_CAMEM, *case.FIXED])
    assert spec.fixed_in == {"vllm-ascend": case.FIRST_FIXED}
    assert spec.targets == [patch.TARGET]


# -- every affected release: stock, patched, upstream's fixed release ----------------------------------------------
@pytest.mark.parametrize("version", case.AFFECTED)
def test_stock_unmaps_under_running_work_and_the_patch_fences_where_upstream_does(runs, version):
    r, fixed = runs[version], runs[FIXED_RUN]["stock"]
    assert r["status"]["state"] == "applied", r["status"]
    assert "no device synchronize before them" in r["status"]["reason"]
    for level in case.LEVELS:
        stock, patched = r["stock"][level], r["patched"][level]
        # Stock: no fence; the queued work runs against memory sleep() already unmapped (a device fault each),
        # and the weights' CPU backup is taken before the kernel wrote them: wake_up restores stale weights.
        assert "synchronize" not in _names(stock["calls"]) and stock["error"] is None
        assert stock["faults"] == [["kernel", case.WEIGHTS], ["graph_replay", case.KV_CACHE]], stock
        if level == "level1":
            assert stock["backup"] == [case.OLD] and stock["weights_after_wake"] == [case.OLD]
        # Patched: the one synchronize before every offload copy and unmap, nothing else changed.
        names = _names(patched["calls"])
        assert names.count("synchronize") == 1 and names[0] == "synchronize", names
        assert _host(patched["calls"])[1:] == _host(stock["calls"])
        assert patched["faults"] == []
        if level == "level1":
            assert patched["backup"] == [case.NEW] and patched["weights_after_wake"] == [case.NEW]
        # ... which is what upstream's first fixed release does on the same inputs (0.7.3-0.18.0 end sleep without
        # 0.19.1rc1+'s torch.npu.empty_cache(): not this fix, the same with or without it).
        if "empty_cache" in _names(stock["calls"]):
            assert patched["calls"] == fixed[level]["calls"], (patched["calls"], fixed[level]["calls"])
        else:
            assert patched["calls"] == [c for c in fixed[level]["calls"] if c[0] != "empty_cache"]
        assert _outcome(patched) == _outcome(fixed[level])
    assert "device synchronized before the offload/unmap of 2 sleep(s)" in r["status_after"]["reason"]
    assert r["unapplied"] is True and r["undone"] == r["stock"]


@pytest.mark.parametrize("version", case.FIXED)
def test_fixed_releases_fence_themselves_and_are_left_alone(runs, version):
    r = runs[version]
    assert r["status"]["state"] == "skipped:version" and "fixed upstream" in r["status"]["reason"], r["status"]
    for level in case.LEVELS:
        assert _names(r["stock"][level]["calls"])[0] == "synchronize" and r["stock"][level]["faults"] == []
        assert r["patched"][level] == r["stock"][level]  # the shim adds nothing: one synchronize, not two
    assert r["stock"] == runs[FIXED_RUN]["stock"]


# -- the wrapper alone: arguments and failures it was not built for -------------------------------------------------
class _Npu:
    def __init__(self, log, fail=False):
        self.log, self.fail = log, fail

    def synchronize(self):
        self.log.append("synchronize")
        if self.fail:
            raise RuntimeError("device error")


def _wrapper(log, fail=None):
    """The wrapper over a module whose torch has an npu whose synchronize fails or not; ``fail=None``: no npu."""
    torch = types.SimpleNamespace(**({} if fail is None else {"npu": _Npu(log, fail)}))
    run = PatchRun.standalone(case.PATCH_ID)
    return patch.fenced_sleep(run, types.SimpleNamespace(torch=torch)), run  # the camem module: its torch


def _stock(log):
    def sleep(*args, **kwargs):
        log.append(("stock", args, kwargs))
        return "slept"

    return sleep


class _Alloc:
    pointer_to_data = {}


@pytest.mark.parametrize("args,kwargs,fenced", [
    ((), {}, True), ((("weights",),), {}, True), ((), {"offload_tags": "weights"}, True),
    ((), {"offload_tags": ()}, True),
    ((["weights"],), {}, False), ((("weights",), 1), {}, False), ((), {"tags": ()}, False),
    ((("weights",),), {"offload_tags": ()}, False)])
def test_the_fence_only_for_calls_upstream_fences(args, kwargs, fenced):
    log = []
    wrapper, run = _wrapper(log, fail=False)
    assert wrapper(_stock(log), _Alloc(), args, kwargs) == "slept"
    assert log == (["synchronize"] if fenced else []) + [("stock", args, kwargs)]
    assert bool(run.fallbacks) is not fenced


def test_a_failing_or_missing_synchronize_runs_stock_and_never_raises():
    log = []
    wrapper, run = _wrapper(log, fail=True)
    assert wrapper(_stock(log), _Alloc(), ((),), {}) == "slept"
    assert log == ["synchronize", ("stock", ((),), {})] and run.fallbacks == ["torch.npu.synchronize() raised"]
    log = []
    wrapper, run = _wrapper(log)  # a module whose torch has no npu
    assert wrapper(_stock(log), _Alloc(), ((),), {}) == "slept"
    assert log == [("stock", ((),), {})] and run.fallbacks == ["torch.npu has no synchronize"]


def test_an_allocator_whose_table_raises_is_left_to_stock():
    class Broken:
        @property
        def pointer_to_data(self):
            raise RuntimeError("table gone")

    log = []
    wrapper, run = _wrapper(log, fail=False)
    assert wrapper(_stock(log), Broken(), ((),), {}) == "slept"
    assert log == [("stock", ((),), {})] and run.fallbacks == ["reading the allocator or torch.npu raised"]


def test_record_names_the_upstream_fix():
    assert "pull/13757" in patch.__doc__ and "pull/15702" in patch.__doc__
    assert re.search(r"fixed upstream in vllm-ascend 0\.27\.1rc1", patch.__doc__)
