"""Contract case for ascend-camem-sleep-sync: the REAL ``vllm_ascend/device_allocator/camem.py`` of each release.

What is real: that file, byte for byte, from the release's PyPI wheel or sdist, and torch (CPU). What is a stand-in
(``omni_patches.testing.standins``, written by :class:`~omni_patches.testing.Release`): ``torch_npu`` -- it puts
``torch.npu`` in place over a model NPU (:data:`TORCH_NPU`: mapped memory, one queue of in-flight work, an ordered
log of the host's calls) and gives ``torch.empty(..., pin_memory=True)`` the host memory torch_npu would pin;
vllm-ascend's C extension ``vllm_ascend.vllm_ascend_C`` (map / unmap on that device) and CANN's ``acl.rt.memcpy``
(a synchronous copy that reads the device memory as it is now, as ``aclrtMemcpy`` does); every other import
(vllm.logger, ...) a permissive stand-in.

The scenario functions here run in a child on one release (``Release.call``, the contract's ``drive``):
:func:`release_run` is what test_ascend_camem_sleep_sync.py runs on every release.
"""
from omni_patches.testing import Case, Env, Release, Unexpected

PATCH_ID = "ascend-camem-sleep-sync"
SWITCH = "OMNI_PATCHES_ASCEND_CAMEM_SLEEP_SYNC"
CAMEM = "vllm_ascend/device_allocator/camem.py"

# Every vllm-ascend release on PyPI (2026-12-05), by what its camem.py does (test_ascend_camem_sleep_sync.py checks
# each). No camem.py: 0.7.1rc1, 0.7.3rc1, 0.7.3rc2. Sleep with no synchronize: 0.7.3 ... 0.26.0rc1 (0.23.0.post1,
# the newest v0.23 release, included: the backport #15702 was never released). Synchronize first: 0.27.1rc1+.
NO_CAMEM = ["0.7.1rc1", "0.7.3rc1", "0.7.3rc2"]
AFFECTED = ["0.7.3", "0.7.3.post1", "0.8.4rc1", "0.8.4rc2", "0.8.5rc1", "0.9.0rc1", "0.9.0rc2", "0.9.1rc1",
            "0.9.1rc2", "0.9.1rc3", "0.9.1", "0.9.2rc1", "0.10.0rc1", "0.10.1rc1", "0.10.2rc1", "0.11.0rc0",
            "0.11.0rc1", "0.11.0rc2", "0.11.0rc3", "0.11.0", "0.12.0rc1", "0.13.0rc1", "0.13.0rc2", "0.13.0rc3",
            "0.13.0", "0.14.0rc1", "0.15.0rc1", "0.16.0rc1", "0.17.0rc1", "0.18.0rc1", "0.18.0", "0.19.1rc1",
            "0.20.2rc1", "0.21.0rc1", "0.22.1rc1", "0.23.0rc1", "0.23.0", "0.23.0.post1", "0.24.0rc1",
            "0.25.1rc1", "0.26.0rc1"]
FIXED = ["0.27.1rc1", "0.28.0rc1", "0.29.0rc1", "0.30.0rc1", "0.30.0rc2"]
FIRST_FIXED = FIXED[0]

# -- stand-ins -----------------------------------------------------------------------------------------------------
TORCH_NPU = '''
"""torch_npu stand-in: ``torch.npu`` over a model NPU (no kernels: memory, a queue of in-flight work, a call log)."""
import ctypes

import torch

from omni_patches.testing import standins as _s

ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST = 1, 2


class Device:
    """What the host asked of the NPU, in order (``log``), its mapped memory, and the work still in flight."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.log, self.memory, self.pending, self.faults = [], {}, [], []

    def map(self, ptr, size):
        self.log.append(["map", ptr])
        self.memory[ptr] = bytearray(size)

    def unmap(self, ptr):
        self.log.append(["unmap", ptr])
        if self.memory.pop(ptr, None) is None:
            raise RuntimeError(f"unmap of {ptr:#x}: not mapped")

    def launch(self, name, ptr, value):
        """Queue work (a kernel, an ACLGraph replay) that fills ``ptr``'s memory with ``value`` once it runs."""
        self.log.append(["launch", name, ptr])
        self.pending.append((name, ptr, value))

    def run_pending(self):
        """The device runs what was queued; work on memory unmapped meanwhile is a device fault (aivec error)."""
        pending, self.pending = self.pending, []
        for name, ptr, value in pending:
            if ptr in self.memory:
                self.memory[ptr][:] = bytes([value]) * len(self.memory[ptr])
            else:
                self.faults.append([name, ptr])

    def synchronize(self):
        self.log.append(["synchronize"])
        self.run_pending()

    def memcpy(self, dst, dest_max, src, count, kind):
        """aclrtMemcpy: synchronous for the host, not ordered after the queued work."""
        if kind == ACL_MEMCPY_DEVICE_TO_HOST:
            self.log.append(["memcpy", "D2H", src, count])
            if src not in self.memory:
                raise RuntimeError(f"rtMemcpy from {src:#x}: not mapped")
            ctypes.memmove(dst, bytes(self.memory[src][:count]), count)
        elif kind == ACL_MEMCPY_HOST_TO_DEVICE:
            self.log.append(["memcpy", "H2D", dst, count])
            if dst not in self.memory:
                raise RuntimeError(f"rtMemcpy to {dst:#x}: not mapped")
            self.memory[dst][:count] = ctypes.string_at(src, count)
        else:
            raise RuntimeError(f"rtMemcpy kind {kind}")
        return 0

    def empty_cache(self):
        self.log.append(["empty_cache"])


DEVICE = Device()


def synchronize(device=None):
    DEVICE.synchronize()


def empty_cache():
    DEVICE.empty_cache()


if not hasattr(torch, "npu"):
    _s.put({"torch.npu": {"synchronize": synchronize, "empty_cache": empty_cache}})
    _empty = torch.empty

    def _host_empty(*args, pin_memory=False, **kwargs):
        """torch_npu's pinned host allocator: plain host memory here (CPU torch has no pinned allocator)."""
        return _empty(*args, **kwargs)

    torch.empty = _host_empty
'''

ACL_RT = '''
def memcpy(dst, dest_max, src, count, kind):
    from torch_npu import DEVICE

    return DEVICE.memcpy(dst, dest_max, src, count, kind)
'''

CAMEM_C = '''
def init_module(python_malloc_fn, python_free_fn):
    pass


def python_create_and_map(device, size, d_mem, p_mem_handle):
    from torch_npu import DEVICE

    DEVICE.map(d_mem, size)


def python_unmap_and_release(device, size, d_mem, p_mem_handle):
    from torch_npu import DEVICE

    DEVICE.unmap(d_mem)
'''

STANDINS = {
    "torch_npu": TORCH_NPU,
    "acl.rt": ACL_RT,
    "vllm_ascend.vllm_ascend_C": CAMEM_C,
    # vllm-ascend imports torch_npu (platform, utils) before any allocator exists
    "vllm_ascend": "import torch_npu  # noqa: F401",
}


def release(version, **kw):
    """The real camem.py of vllm-ascend ``version`` with the stand-ins above (``CAMEM?``: releases without one)."""
    return Release("vllm-ascend", version, files=[CAMEM + "?"], standins=STANDINS, auto_standins=True,
                   passthrough=("torch",), **kw)


def env(version, env=None, **kw):
    r = release(version, **kw)
    return r.env(label=f"ascend-{r.name.removeprefix('vllm-ascend-')}", env=env)


# -- the scenario ----------------------------------------------------------------------------------------------------
WEIGHTS, KV_CACHE = 0x10000, 0x20000  # device addresses of the two allocations
SIZE = 16
OLD, NEW = 1, 9  # what the memory holds, what the in-flight work writes
LEVELS = {"level1": ("weights",), "level2": ()}  # NPUWorker.sleep(level): offload_tags=("weights",) / tuple()


def _setup():
    import torch_npu
    from vllm_ascend.device_allocator import camem

    dev = torch_npu.DEVICE
    dev.reset()
    alloc = camem.CaMemAllocator()
    for tag, ptr in (("weights", WEIGHTS), ("kv_cache", KV_CACHE)):
        alloc.current_tag = tag  # what use_memory_pool(tag) sets while the C extension maps and calls back
        camem.create_and_map((0, SIZE, ptr, ptr + 1))
        dev.memory[ptr][:] = bytes([OLD]) * SIZE
        alloc.python_malloc_callback((0, SIZE, ptr, ptr + 1))
    alloc.current_tag = camem.CaMemAllocator.default_tag
    dev.log.clear()
    return dev, alloc


def _outcome(fn):
    try:
        fn()
        return None
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test compares
        return f"{type(exc).__name__}: {exc}"


def sleep_wake(level):
    """One sleep / wake_up cycle of NPUWorker at ``level`` while an ACLGraph replay (writing the KV cache) and a
    kernel (writing the weights) are still in flight. What the host asked the device, in order; what the device
    then ran against memory already unmapped; what the weights' CPU backup and, after wake_up, the weights hold."""
    dev, alloc = _setup()
    dev.launch("kernel", WEIGHTS, NEW)
    dev.launch("graph_replay", KV_CACHE, NEW)
    error = _outcome(lambda: alloc.sleep(offload_tags=LEVELS[level]))
    calls = list(dev.log)
    backup = alloc.pointer_to_data[WEIGHTS].cpu_backup_tensor
    dev.run_pending()  # the device finishes what is queued
    faults = list(dev.faults)
    woke = _outcome(alloc.wake_up) if error is None else "not run"
    return {"error": error, "calls": calls, "faults": faults,
            "backup": None if backup is None else sorted(set(backup.tolist())),
            "wake_error": woke, "weights_after_wake": sorted(set(dev.memory.get(WEIGHTS, b"")))}


def _status():
    import omni_patches

    st = {s.id: s for s in omni_patches.status()}[PATCH_ID]
    return {"state": str(st.state), "reason": st.reason}


def release_run():
    """Every level stock, then with the shim activated in the same process (the target already imported: it
    applies at once), then after unapply."""
    import gc
    import os

    import vllm_ascend.device_allocator.camem  # noqa: F401

    gc.freeze()  # 0.19.1rc1+ sleep calls gc.collect(): not over the whole of torch each time (~0.5 s)
    out = {"stock": {lv: sleep_wake(lv) for lv in LEVELS}}
    os.environ["OMNI_PATCHES"] = "1"
    import omni_patches

    omni_patches.activate()
    out["status"] = _status()
    out["patched"] = {lv: sleep_wake(lv) for lv in LEVELS}
    out["status_after"] = _status()
    out["unapplied"] = omni_patches.unapply(PATCH_ID)
    out["undone"] = {lv: sleep_wake(lv) for lv in LEVELS}
    return out


# -- inputs the wrapper was not built for (the contract's Unexpected: stock, then patched twice) ---------------------
def _sleep_with_a_list_of_tags():
    """0.27.1rc1 asserts a tuple before it synchronizes: stock's AssertionError, no fence."""
    dev, alloc = _setup()
    dev.launch("graph_replay", KV_CACHE, NEW)
    return {"error": _outcome(lambda: alloc.sleep(["weights"])), "calls": dev.log}


def _sleep_of_an_allocator_of_another_shape():
    """An allocator of another shape (a subclass keeping its allocations elsewhere): what stock does with it."""
    import types

    from vllm_ascend.device_allocator import camem

    dev, alloc = _setup()
    dev.launch("graph_replay", KV_CACHE, NEW)

    class Other(camem.CaMemAllocator):
        """Keeps its table elsewhere and shows a read-only view of it (stock iterates it all the same)."""

        @property
        def pointer_to_data(self):
            return types.MappingProxyType(self.table)

        @pointer_to_data.setter
        def pointer_to_data(self, table):
            self.table = table

    other = Other()
    other.table.update(alloc.pointer_to_data)
    return {"error": _outcome(lambda: other.sleep(("weights",))), "calls": dev.log}


def _sleep_where_torch_npu_has_no_synchronize():
    """A torch.npu without synchronize: the stock sleep, unfenced, as it always ran."""
    import types

    import torch

    dev, alloc = _setup()
    dev.launch("graph_replay", KV_CACHE, NEW)
    npu = torch.npu
    torch.npu = types.SimpleNamespace(empty_cache=npu.empty_cache)  # an npu module that has no synchronize
    try:
        error = _outcome(lambda: alloc.sleep(("weights",)))
    finally:
        torch.npu = npu
    return {"error": error, "calls": dev.log, "pending": len(dev.pending)}


def _sleep_where_synchronize_raises():
    """A device error surfacing at the fence (an earlier kernel failed): the stock sleep meets it on its own."""
    import torch

    dev, alloc = _setup()
    dev.launch("graph_replay", KV_CACHE, NEW)

    def broken(device=None):
        raise RuntimeError("ACL stream synchronize failed")

    sync, torch.npu.synchronize = torch.npu.synchronize, broken
    try:
        error = _outcome(lambda: alloc.sleep(("weights",)))
    finally:
        torch.npu.synchronize = sync
    return {"error": error, "calls": dev.log}


OLDEST, NEWEST = env(AFFECTED[0]), env(AFFECTED[-1])
TAGS_CHECKED = "        assert isinstance(offload_tags, tuple)\n"

CASE = Case(
    patch_id=PATCH_ID,
    # one release per distinct CaMemAllocator.sleep (test_ascend_camem_sleep_sync.py runs every release)
    affected=[OLDEST, env("0.8.4rc1"), env("0.10.0rc1"), env("0.13.0rc2"), env("0.14.0rc1"), env("0.19.1rc1"),
              env("0.23.0.post1"), NEWEST],
    skipped=[
        (env(FIRST_FIXED), "skipped:version", "fixed upstream in vllm-ascend 0.27.1rc1"),
        (env(FIXED[-1]), "skipped:version", "fixed upstream"),
        # upstream's fence found by feature although the version is affected (the v0.23 backport, #15702)
        (Env.edited("ascend-0.23.0.post1-backported", env("0.23.0.post1"), CAMEM, TAGS_CHECKED,
                    TAGS_CHECKED + "        torch.npu.synchronize()\n"), "skipped:version", "already synchronizes"),
        (env("0.26.0rc1", env={SWITCH: "0"}), "skipped:disabled", f"{SWITCH}=0"),
    ],
    source_built=[
        (env("0.26.0rc1", metadata_version="0.26.1.dev12+g1a2b3c4d"), "applied", "decided by code features"),
        (env(FIRST_FIXED, metadata_version="0.0.0"), "skipped:version", "already synchronizes"),
    ],
    drifted=[
        (Env.edited("ascend-0.26.0rc1-renamed", NEWEST, CAMEM, "    def sleep(self, offload_tags",
                    "    def sleep(self, tags"), "no parameter(s) offload_tags"),
        (Env.edited("ascend-0.26.0rc1-helper-unmap", NEWEST, CAMEM, "            unmap_and_release(handle)\n",
                    "            self._release(handle)\n"), "no longer does its own unmap"),
    ],
    unexpected=[
        Unexpected(NEWEST, _sleep_with_a_list_of_tags, note="offload_tags is not None, a str or a tuple"),
        Unexpected(OLDEST, _sleep_of_an_allocator_of_another_shape, note="no pointer_to_data dict"),
        Unexpected(NEWEST, _sleep_where_torch_npu_has_no_synchronize, note="torch.npu has no synchronize"),
        Unexpected(NEWEST, _sleep_where_synchronize_raises, note="torch.npu.synchronize() raised"),
    ],
)

# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here; the words are omni_patches.tools.audit's).
VERDICTS = {
    "vllm-ascend==0.7.3rc2": "skip: out of range", "vllm-ascend==0.7.3": "would apply",
    "vllm-ascend==0.13.0": "would apply", "vllm-ascend==0.23.0.post1": "would apply",
    "vllm-ascend==0.26.0rc1": "would apply", "vllm-ascend==0.27.1rc1": "skip: fixed upstream",
    "vllm-ascend==0.30.0rc2": "skip: fixed upstream",
}
