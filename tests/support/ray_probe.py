"""vLLM worker extension for the Ray stack test: ``llm.collective_rpc("omni_probe")`` runs in every worker.

It imports a real patch target (the shim, when active, applies its patch right there), then reports what
the shim did in that worker process, what Ray says about the process, and the environment vLLM gave it.
"""
TARGET = "vllm_omni.diffusion.lora.loader"


class OmniProbe:
    def omni_probe(self, target=TARGET):
        import importlib
        import os
        import sys

        import ray

        importlib.import_module(target)
        import omni_patches
        from omni_patches import proof
        from vllm.distributed import parallel_state

        # vLLM's CPU TP communicator uses /dev/shm segments only where its kernels have the shm ops (the AVX-512
        # build; an AVX2-only CPU falls back to torch.distributed): the clean-up test needs to know which ran.
        comm = getattr(parallel_state.get_tp_group(), "device_communicator", None)

        engine = sys.modules.get("omni_patches.engine")
        active = bool(engine is not None and engine.is_active())
        ctx = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "rank": getattr(self, "rank", None),
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "actor_id": ctx.get_actor_id(),
            "argv0": os.path.basename(sys.argv[0]),
            "active": active,
            "sources": engine.snapshot().sources if active else [],
            "status": {s.id: {"state": s.state, "reason": s.reason} for s in omni_patches.status()},
            "role": proof.role(info=proof.ray_info())["role"],
            "env": {k: v for k, v in os.environ.items()
                    if k.startswith(("OMNI_PATCHES", "RAY_RAYLET_PID", "RAY_JOB", "RAY_NODE"))
                    or k in ("VLLM_HOST_IP", "VLLM_PLUGINS")},
            "state_file": os.path.exists(os.path.join(proof.state_dir(), f"{os.getpid()}.json")),
            "tp_dist_module": type(getattr(comm, "dist_module", None)).__name__,
        }
