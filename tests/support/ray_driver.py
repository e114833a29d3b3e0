"""Driver of the Ray stack test: a real vLLM engine, Ray executor, TP=2 on CPU, one probe per worker.

``python ray_driver.py MODEL_DIR OUT_JSON STOP_FILE``. Builds ``LLM(tensor_parallel_size=2,
distributed_executor_backend="ray")`` on the tiny local model, generates a few tokens, runs
``collective_rpc("omni_probe")`` (tests/support/ray_probe.py) in every worker, writes the results to OUT_JSON
and keeps the engine (and so its Ray workers) alive until STOP_FILE exists, so the test can look at the
cluster while the instance serves. Then it exits without shutting anything down by hand: Ray ends the job's
workers the way it does in production.
"""
import json
import os
import sys
import time


def _executor_name(llm):
    """Class name of the executor (in-process engine core: LLMEngine -> InprocClient -> EngineCore)."""
    obj = llm.llm_engine
    for attr in ("engine_core", "engine_core", "model_executor"):
        obj = getattr(obj, attr, obj)
    return type(obj).__name__


def main(model, out_path, stop_path):
    started = time.monotonic()
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, tokenizer=model, tensor_parallel_size=2, distributed_executor_backend="ray",
              worker_extension_cls="ray_probe.OmniProbe", max_model_len=64, max_num_seqs=2, enforce_eager=True,
              dtype="float32", seed=0)
    ready = time.monotonic()
    out = llm.generate(["hello world the patch"], SamplingParams(max_tokens=4, temperature=0.0))
    workers = llm.collective_rpc("omni_probe")
    engine = sys.modules.get("omni_patches.engine")
    result = {
        "driver": {"pid": os.getpid(), "active": bool(engine is not None and engine.is_active()),
                   "instance": os.environ.get("OMNI_PATCHES_INSTANCE"),
                   "executor": _executor_name(llm)},
        "workers": workers,
        "generated": list(out[0].outputs[0].token_ids),
        "seconds": {"engine": round(ready - started, 1), "total": round(time.monotonic() - started, 1)},
    }
    tmp = out_path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh)
    os.replace(tmp, out_path)
    deadline = time.monotonic() + 600
    while not os.path.exists(stop_path) and time.monotonic() < deadline:
        time.sleep(0.2)


if __name__ == "__main__":
    main(*sys.argv[1:4])
