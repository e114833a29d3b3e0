"""Targets for multiprocessing children of the ascend-execute-model-timeout tests (spawn needs them importable).

Each child does what a vLLM engine-core or worker process does first -- import ``vllm`` (its env module) and
resolve the Ascend platform -- then reports, through a queue, the timeout vLLM would use there.
"""


def report(queue, import_platform=True, cache=False):
    import os

    import vllm.envs as envs

    if import_platform:
        import vllm_ascend.platform  # noqa: F401  (what current_platform resolves to on Ascend)
    if cache and hasattr(envs, "enable_envs_cache"):  # vLLM 0.12+
        envs.enable_envs_cache()  # what EngineCore / workers do after start-up: every variable frozen
    out = {"pid": os.getpid(), "environ": os.environ.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"), "state": None,
           "reason": None}
    try:
        out["vllm_reads"] = envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
    except ValueError as exc:  # a value vLLM cannot parse: what vLLM itself would raise
        out["vllm_reads"] = f"ValueError: {exc}"
    try:
        import omni_patches

        for st in omni_patches.status():
            if st.id == "ascend-execute-model-timeout":
                out["state"], out["reason"] = st.state, st.reason
    except Exception as exc:  # reported, not raised: the parent asserts on it
        out["reason"] = f"status failed: {exc!r}"
    queue.put(out)


def run(method, **kwargs):
    """Start one child with ``method`` (spawn / fork / forkserver) and return its report."""
    import multiprocessing as mp

    ctx = mp.get_context(method)
    queue = ctx.Queue()
    proc = ctx.Process(target=report, args=(queue,), kwargs=kwargs)
    proc.start()
    out = queue.get(timeout=120)
    proc.join(60)
    out["exitcode"] = proc.exitcode
    return out
