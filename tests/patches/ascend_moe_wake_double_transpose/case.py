"""Contract case for ascend-moe-wake-double-transpose: the REAL ``NPUWorker`` (``vllm_ascend/worker/worker.py``;
``worker_v1.py`` in 0.12.0rc1) and the REAL ``AscendUnquantizedFusedMoEMethod`` (``ops/fused_moe/fused_moe.py``) of
each vllm-ascend release, on real torch (CPU). What cannot run here is a stand-in: torch_npu (it sets ``torch.npu``
as the real one does on import), CaMem (a pool that keeps the weight tensors: level 1 backs them up and restores them
in place, as the real one does byte for byte; what it does not back up reads NaN after sleep), the Ascend config
(NZ, fused MC2, extra cleanup off), ``maybe_trans_nz`` (ND weights: the identity), vLLM's ``UnquantizedFusedMoEMethod``
(its base ``process_weights_after_loading`` is a no-op and ``_maybe_pad_weight`` the identity, as on non-ROCm), and
every other import the two files make (permissive stand-ins).

Also the scenarios the test runs in its children (``Release.call``): module-level functions, importing nothing of the
release until they run.
"""
from omni_patches.testing import Case, Env, Release, Unexpected

PID = "ascend-moe-wake-double-transpose"
SWITCH = "OMNI_PATCHES_ASCEND_MOE_WAKE_DOUBLE_TRANSPOSE"
WORKER, WORKER_V1 = "vllm_ascend/worker/worker.py", "vllm_ascend/worker/worker_v1.py"
FM = "vllm_ascend/ops/fused_moe/fused_moe.py"

#: Every vllm-ascend release on PyPI whose NPUWorker.wake_up transposes the MoE weights again (verified on the release
#: files: 0.12.0rc1 is the first, worker_v1.py; 0.25.1rc1 the last).
AFFECTED = ["0.12.0rc1", "0.13.0rc1", "0.13.0rc2", "0.13.0rc3", "0.13.0", "0.14.0rc1", "0.15.0rc1", "0.16.0rc1",
            "0.17.0rc1", "0.18.0rc1", "0.18.0", "0.19.1rc1", "0.20.2rc1", "0.21.0rc1", "0.22.1rc1", "0.23.0rc1",
            "0.23.0", "0.23.0.post1", "0.24.0rc1", "0.25.1rc1"]
#: Upstream's fix (#13012) and the releases after it: wake_up names no MoE weight.
FIXED = ["0.26.0rc1", "0.27.1rc1", "0.30.0rc2"]
#: The last releases before 0.12.0rc1: wake_up only wakes the allocator (and restores buffers).
BEFORE = ["0.11.0rc3", "0.11.0"]

TORCH_NPU = """
import torch as _torch

from omni_patches.testing import standins as _s

if not hasattr(_torch, "npu"):
    _s.put({"torch.npu": {}})
"""

# Real CaMem maps the pool's memory back at the same addresses: a level-1 wake restores the bytes of every tensor
# allocated under the "weights" tag in place; level 2 backs up nothing.
CAMEM = """
class CaMemAllocator:
    _instance = None

    @classmethod
    def get_instance(cls):
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def __init__(self):
        self.pool = []

    def track(self, tag, tensor):
        self.pool.append([tag, tensor, None])

    def sleep(self, offload_tags=()):
        for entry in self.pool:
            tag, tensor, _ = entry
            entry[2] = tensor.detach().clone() if tag in offload_tags else None
            tensor.detach().fill_(float("nan"))  # unmapped: what it reads now is not the weight

    def wake_up(self, tags=None):
        for tag, tensor, backup in self.pool:
            if (tags is None or tag in tags) and backup is not None:
                tensor.detach().copy_(backup)
"""

ASCEND_CONFIG = """
import types as _types

_CONFIG = _types.SimpleNamespace(weight_nz_mode=0, enable_fused_mc2=0, dynamic_eplb=False,
                                 eplb_config=_types.SimpleNamespace(dynamic_eplb=False))


def get_ascend_config():
    return _CONFIG
"""

UTILS = """
def is_enable_nz(*args, **kwargs):
    return False


def maybe_trans_nz(weight, *args, **kwargs):
    return weight
"""

VLLM_MOE_METHOD = """
class FusedMoEMethodBase:
    def __init__(self, *args, **kwargs):
        pass

    def process_weights_after_loading(self, layer):
        pass


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    def _maybe_pad_weight(self, weight):
        return weight
"""

STANDINS = {
    "torch_npu": TORCH_NPU,
    "vllm_ascend.device_allocator.camem": CAMEM,
    "vllm_ascend.ascend_config": ASCEND_CONFIG,
    "vllm_ascend.envs": "VLLM_ASCEND_ENABLE_NZ = 0\nVLLM_ASCEND_ENABLE_FUSED_MC2 = 0\n",
    "vllm_ascend.utils": UTILS,
    "vllm.utils": "GiB_bytes = 1 << 30\n",  # vLLM <= 0.13
    "vllm.utils.mem_constants": "GiB_bytes = 1 << 30\n",
    "vllm.model_executor.layers.fused_moe.layer": VLLM_MOE_METHOD,
    "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method": VLLM_MOE_METHOD,
}


def release(version, metadata_version=None):
    return Release("vllm-ascend", version, files=[WORKER + "?", WORKER_V1 + "?", FM + "?"], auto_standins=True,
                   passthrough=("torch",), standins=STANDINS, metadata_version=metadata_version)


def worker_module(version):
    return "vllm_ascend.worker.worker_v1" if version == "0.12.0rc1" or version.startswith("0.11") \
        else "vllm_ascend.worker.worker"


def _env(version, metadata_version=None, **kw):
    kw.setdefault("imports", [worker_module(version)])
    return release(version, metadata_version).env(**kw)


# -- the scenario, in the child ------------------------------------------------------------------------------
E, H, I = 4, 16, 12  # experts, hidden size, intermediate size (2I != H: a transposed weight cannot multiply)
TOKENS = 10


def build_model(fused_moe, seed, loaded=True):
    """A two-layer MoE model as the release's loader leaves it: every expert weight in the checkpoint layout
    (w13 [E, 2I, H], w2 [E, H, I], a ``weight_loader`` as vLLM's FusedMoE sets), then the release's own
    ``AscendUnquantizedFusedMoEMethod.process_weights_after_loading`` on each expert layer. Every parameter and
    buffer is then in the allocator's "weights" pool (the loader runs under it). ``loaded=False``: the same weights
    in the checkpoint layout, outside the pool (what a reload reads)."""
    import torch
    import torch.nn as nn

    from vllm_ascend.device_allocator.camem import CaMemAllocator

    g = torch.Generator().manual_seed(seed)

    def param(*shape):
        p = nn.Parameter(torch.randn(*shape, generator=g) * 0.3, requires_grad=False)
        p.weight_loader = lambda *a, **k: None
        return p

    def layer():
        mod = nn.Module()
        mod.proj = nn.Linear(H, H, bias=False)
        mod.proj.weight = param(H, H)
        mod.mlp = nn.Module()
        mod.mlp.experts = nn.Module()
        mod.mlp.experts.w13_weight = param(E, 2 * I, H)
        mod.mlp.experts.w2_weight = param(E, H, I)
        return mod

    model = nn.Module()
    model.layers = nn.ModuleList([layer(), layer()])
    model.register_buffer("rope_cache", torch.randn(8, H, generator=g))
    if not loaded:
        return model
    process(fused_moe, model)
    pool = CaMemAllocator.get_instance()
    pool.pool.clear()
    for tensor in [*model.parameters(), *model.buffers()]:
        pool.track("weights", tensor)
    return model


def process(fused_moe, model):
    """The release's own ``AscendUnquantizedFusedMoEMethod.process_weights_after_loading`` on every expert layer."""
    method_cls = fused_moe.AscendUnquantizedFusedMoEMethod
    method = method_cls.__new__(method_cls)
    method.dynamic_eplb = False
    for mod in model.layers:
        method.process_weights_after_loading(mod.mlp.experts)


def reload(fused_moe, model, seed):
    """A weight reload after the weights wake, the way vLLM's layerwise reload ends (``start_weight_update`` /
    ``reload_weights`` in vllm-ascend 0.24.0rc1+, ``vllm/model_executor/model_loader/reload/layerwise.py``
    ``_copy_and_restore_kernel_tensors``): the checkpoint weights are loaded and processed on the side, then copied
    into the tensors the layer holds now (``param.data.copy_(processed)``), which keeps their addresses."""
    import torch

    fresh = build_model(fused_moe, seed, loaded=False)
    process(fused_moe, fresh)
    live = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in fresh.named_parameters():
            live[name].data.copy_(value)


def forward(model, x):
    """The MoE forward in the runtime layout the NPU grouped matmul takes (w13 [E, H, 2I], w2 [E, I, H]): token t
    to expert t % E, SiLU-and-mul between the two matmuls."""
    import torch

    route = torch.arange(x.shape[0]) % E
    for mod in model.layers:
        x = mod.proj(x)
        out = torch.zeros_like(x)
        for e in range(E):
            rows = route == e
            h = x[rows] @ mod.mlp.experts.w13_weight[e]
            gate, up = h.chunk(2, dim=-1)
            out[rows] = (torch.nn.functional.silu(gate) * up) @ mod.mlp.experts.w2_weight[e]
        x = x + out + model.rope_cache[: x.shape[0] % 8 + 1].sum(0)
    return x


def _digest(t):
    import hashlib

    t = t.detach().contiguous()
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]


def weights(model):
    """{name: [shape, digest of the values, id of the Parameter]} of every expert weight."""
    return {name: [list(p.shape), _digest(p), id(p)] for name, p in model.named_parameters() if "_weight" in name
            and "mlp.experts" in name}


def _run_forward(model, x):
    try:
        return {"ok": True, "out": _digest(forward(model, x))}
    except Exception as exc:  # the stock symptom: the matmul's shape mismatch
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def make_worker(worker_mod, model):
    """The release's own NPUWorker (its ``sleep`` and ``wake_up`` as shipped), with only what those two read: the
    model runner's model, the vLLM config (hidden size, no quantization), the level-2 buffer backup."""
    import types

    cls = worker_mod.NPUWorker
    worker = cls.__new__(cls)
    hf = types.SimpleNamespace(hidden_size=H)
    worker.vllm_config = types.SimpleNamespace(quant_config=None, model_config=types.SimpleNamespace(
        hf_config=hf, hf_text_config=hf))
    worker.model_runner = types.SimpleNamespace(model=model, post_kv_cache_wake_up=lambda: None)
    worker._sleep_saved_buffers = {}
    return worker


def _memory(worker_mod):
    """``mem_get_info`` of the device, as sleep() reads it (torch.npu, or NPUPlatform in 0.12-0.18)."""
    import torch

    info = staticmethod(lambda *a: (1 << 30, 2 << 30))
    torch.npu.mem_get_info = info.__func__
    platform = vars(worker_mod).get("NPUPlatform")
    if isinstance(platform, type):
        platform.mem_get_info = info


#: flow -> (sleep level, the steps after it): what a server does (POST /wake_up: tags=None), the two-phase wake
#: (weights, then KV cache), and a level-2 sleep woken for a weight reload, then the KV cache (the documented RL
#: sequence of vllm-ascend #13012, which 0.26.0rc1 follows).
FLOWS = {
    "serve": (1, [None]),
    "two_phase": (1, [["weights"], ["kv_cache"]]),
    "level2_reload": (2, [["weights"], "reload", ["kv_cache"]]),
}


def flow(worker_mod, fused_moe, name, seed=0):
    import torch

    level, steps = FLOWS[name]
    model = build_model(fused_moe, seed)
    x = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(seed + 1))
    before = weights(model)
    out = {"before": before, "forward_before": _run_forward(model, x), "reload": None}
    worker = make_worker(worker_mod, model)
    worker.sleep(level=level)
    for step in steps:
        if step == "reload":
            out["at_reload"] = {k: v[0] for k, v in weights(model).items()}  # the layout the reload writes into
            try:
                reload(fused_moe, model, seed)
                out["reload"] = "ok"
            except Exception as exc:
                out["reload"] = f"{type(exc).__name__}: {exc}"
        elif step is None:
            worker.wake_up()
        else:
            worker.wake_up(tags=step)
    after = weights(model)
    out["after"] = after
    out["same_objects"] = all(after[k][2] == before[k][2] for k in before)
    out["forward_after"] = _run_forward(model, x)
    for side in ("before", "after"):
        out[side] = {k: v[:2] for k, v in out[side].items()}
    return out


def _activate():
    import os

    import omni_patches

    os.environ["OMNI_PATCHES"] = "1"
    omni_patches.activate()
    st = {s.id: s for s in omni_patches.status()}[PID]
    return {"state": st.state, "reason": st.reason}


def _status():
    import omni_patches

    st = {s.id: s for s in omni_patches.status()}[PID]
    return {"state": st.state, "reason": st.reason}


def _layout(worker_mod):
    """What the patch reads in this release's wake_up (``retransposes`` / ``none`` / drift)."""
    from omni_patches.patches import ascend_moe_wake_double_transpose as patch

    return patch.layout(vars(worker_mod.NPUWorker)["wake_up"])


def stock_then_patched(version, activate=True):
    """Every flow on the release's real NPUWorker: stock, then (``activate``) with the shim active."""
    import importlib

    importlib.import_module("torch_npu")  # loaded by the platform plugin before either file in a real process
    fused_moe = importlib.import_module("vllm_ascend.ops.fused_moe.fused_moe")
    worker_mod = importlib.import_module(worker_module(version))
    _memory(worker_mod)
    out = {"layout": _layout(worker_mod), "stock": {name: flow(worker_mod, fused_moe, name) for name in FLOWS}}
    if activate:
        out["status"] = _activate()
        out["patched"] = {name: flow(worker_mod, fused_moe, name) for name in FLOWS}
        out["status_after"] = _status()
    return out


def outside(version):
    """A release outside the range: what the patch reads in its wake_up, and its state once the shim is active."""
    import importlib

    worker_mod = importlib.import_module(worker_module(version))
    return {"layout": _layout(worker_mod), **_activate()}


# -- the contract --------------------------------------------------------------------------------------------
def _wake_a_worker_without_a_model():
    """A worker whose model runner has no model yet (wake_up before load_model): stock's own error."""
    import importlib

    worker_mod = importlib.import_module("vllm_ascend.worker.worker")
    _memory(worker_mod)
    worker = make_worker(worker_mod, None)
    worker.wake_up()


V023, V025 = _env("0.23.0.post1"), _env("0.25.1rc1")
SOURCE = "0.19.1rc2.dev1637+g182b75ea8"  # what a main checkout reports (setuptools_scm, nearest reachable tag)
W2_TEST = '                if "w2_weight" in name and param.shape[2] == hidden_size:\n'
W13_TEST = '                elif "w13_weight" in name and param.shape[1] == hidden_size:\n'

CASE = Case(
    patch_id=PID,
    affected=[_env(v) for v in ("0.12.0rc1", "0.13.0", "0.18.0", "0.23.0.post1", "0.25.1rc1")],
    skipped=[
        (_env("0.11.0"), "skipped:version", "outside"),
        (_env("0.26.0rc1"), "skipped:version", "fixed upstream in vllm-ascend 0.26.0rc1"),
        (_env("0.30.0rc2"), "skipped:version", "fixed upstream in vllm-ascend 0.26.0rc1"),
        # a backport of #13012 onto an affected release (wake_up loses its loop): found by feature
        (Env.edited("ascend-0.25.1rc1-13012-backport", Env.edited("ascend-0.25.1rc1-13012-backport-w2", V025, WORKER,
                                                                  W2_TEST, "                if False:\n"),
                    WORKER, W13_TEST, "                elif False:\n"),
         "skipped:version", "no longer transposes the MoE weights"),
    ],
    source_built=[
        (_env("0.25.1rc1", SOURCE), "applied", "decided by code features"),
        (_env("0.23.0.post1", "0.0.0"), "applied", "is a source build"),
        (_env("0.26.0rc1", SOURCE), "skipped:version", "no longer transposes the MoE weights"),
        # a tagless checkout of a release before the loop (worker_v1.py, no weight_nz_mode): not affected
        (_env("0.11.0", "0.0.0"), "skipped:version", "predates the weight_nz_mode check"),
    ],
    drifted=[
        # PR #12269's alternative (never merged): transpose only what is in the checkpoint layout
        (Env.edited("ascend-0.23.0.post1-checkpoint-tests", V023, WORKER, W2_TEST,
                    W2_TEST.replace("shape[2]", "shape[1]")), "other shape tests"),
        (Env.edited("ascend-0.25.1rc1-wake-renamed", V025, WORKER, "    def wake_up(self, tags",
                    "    def wake(self, tags"), "has no attribute 'wake_up'"),
        (Env.edited("ascend-0.25.1rc1-no-tags", V025, WORKER, "    def wake_up(self, tags: list[str] | None = None)",
                    "    def wake_up(self, level: int = 1)"), "has no parameter(s) tags"),
    ],
    unexpected=[Unexpected(V023, _wake_a_worker_without_a_model, note="no model_runner.model")],
)


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here; the words are omni_patches.tools.audit's).
VERDICTS = {
    "vllm-ascend==0.11.0": "skip: out of range", "vllm-ascend==0.12.0rc1": "would apply",
    "vllm-ascend==0.13.0": "would apply", "vllm-ascend==0.18.0": "would apply",
    "vllm-ascend==0.22.1rc1": "would apply", "vllm-ascend==0.23.0.post1": "would apply",
    "vllm-ascend==0.24.0rc1": "would apply", "vllm-ascend==0.25.1rc1": "would apply",
    "vllm-ascend==0.26.0rc1": "skip: fixed upstream", "vllm-ascend==0.27.1rc1": "skip: fixed upstream",
    "vllm-ascend==0.30.0rc2": "skip: fixed upstream",
}
