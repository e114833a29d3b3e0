"""Test-only vLLM platform plugin: the stock CPU platform, plus a Ray device key.

vLLM 0.28's ``CpuPlatform`` leaves ``ray_device_key`` empty, so both Ray executors refuse it
(``initialize_ray_cluster``: "current platform cpu does not support ray"). They also read the worker's device
ids with ``ray.get_runtime_context().get_accelerator_ids()[ray_device_key]``, which only lists Ray's accelerator
resource names: the key is ``NPU`` (what vllm-ascend's platform uses), and the test's Ray nodes advertise one
``NPU`` each as a plain custom resource (``--resources '{"NPU": 1}'``). Nothing else changes.

Installed by the test as a top-level module with a ``vllm.platform_plugins`` entry point (see
tests/support/ray_cluster.py), never into a shared environment.
"""
DEVICE_KEY = "NPU"


def register():
    return f"{__name__}.RayCpuPlatform"


def __getattr__(name):
    # Built on first use: importing vllm.platforms.cpu while vLLM resolves its platform plugins is too early.
    if name != "RayCpuPlatform":
        raise AttributeError(name)
    from vllm.platforms.cpu import CpuPlatform

    cls = type("RayCpuPlatform", (CpuPlatform,), {
        "__module__": __name__, "ray_device_key": DEVICE_KEY,
        # Ray would otherwise set ASCEND_RT_VISIBLE_DEVICES for the NPU it hands each actor.
        "ray_noset_device_env_vars": ["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"]})
    globals()[name] = cls
    return cls
