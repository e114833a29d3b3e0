"""Contract case and release scenario of omni-stagepool-cancelled-submit: the REAL vllm_omni/engine/stage_pool.py of
each release (every module it imports a permissive stand-in), driven with a recording EngineCore client.

Affected: 0.21.0rc1 (the first whose submit_initial adds through ``_llm_client``) to 0.31.0rc1; fixed in 0.32.0rc1.
"""
from omni_patches.testing import Case, Env, Release, Unexpected
from support.omni_cases import METADATA, sandboxes, skipped, source_built

PATCH_ID = "omni-stagepool-cancelled-submit"
SWITCH = "OMNI_PATCHES_OMNI_STAGEPOOL_CANCELLED_SUBMIT"
POOL_RELPATH = "vllm_omni/engine/stage_pool.py"
AFFECTED = ["0.21.0rc1", "0.22.0", "0.23.0rc1", "0.24.0rc1", "0.24.0", "0.25.0rc1", "0.26.0rc1", "0.26.0",
            "0.27.0rc1", "0.28.0rc1", "0.28.0", "0.29.0rc1", "0.30.0rc1", "0.30.0", "0.31.0rc1"]
#: One release per layout of submit_initial's AR branch (select_replica_id; _pick_or_select with a RuntimeError for a
#: detached replica, then the diffusion list check moved, from_params, StageUnavailableError, payload_sender_info).
CONTRACT = ["0.21.0rc1", "0.22.0", "0.24.0rc1", "0.26.0", "0.27.0rc1", "0.30.0", "0.31.0rc1"]
FIXED = "0.32.0rc1"
#: What a scenario does to the submission: how EngineCore's client answers the add and the abort that may follow.
MODES = ["ok", "fail", "cancel", "fail-abort-fails", "cancel-abort-cancelled", "cancel-one-of-two", "fail-diffusion"]


def release(version):
    return Release("vllm-omni", version, files=[POOL_RELPATH], auto_standins=True)


def paths(version):
    return release(version).paths()


sandbox = sandboxes(paths)
BASE = sandbox("0.30.0")
ADD = ("            await self._llm_client(replica_id).add_request_async(request, **submit_kwargs)\n"
       "        except Exception:\n")


# -- the scenario (run in a child on one release by Release.call) ---------------------------------------------------
class Engine:
    """One replica's EngineCore as the pool's client reaches it: a request is accepted (``running``) as soon as
    ``add_request_async`` starts; for the mode's ``VICTIM`` the mode decides what the caller sees next."""

    VICTIM = "req-1"

    def __init__(self, mode):
        import asyncio

        self.stage_type = "diffusion" if "diffusion" in mode else "llm"
        self.mode, self.calls, self.running = mode, [], set()
        self.accepted, self.aborting = asyncio.Event(), asyncio.Event()

    async def add_request_async(self, *args, **kwargs):
        import asyncio

        request_id = args[0] if self.stage_type == "diffusion" else args[0].request_id
        self.calls.append(["add", request_id])
        self.running.add(request_id)
        if request_id != self.VICTIM:
            return
        self.accepted.set()
        if self.mode.startswith("fail"):
            raise RuntimeError("sending failed after EngineCore accepted the request")
        if self.mode.startswith("cancel"):
            await asyncio.Event().wait()  # the caller's task is cancelled here

    async def abort_requests_async(self, request_ids):
        import asyncio

        self.calls.append(["abort", list(request_ids)])
        self.aborting.set()
        if self.mode.endswith("abort-fails"):
            raise RuntimeError("abort failed too")
        if self.mode.endswith("abort-cancelled"):
            await asyncio.Event().wait()  # cancelled a second time
        self.running.difference_update(request_ids)


class Processor:
    """The AR output processor's request table (external id == engine id here)."""

    def __init__(self):
        self.requests = set()

    def add_request(self, request, prompt, parent_req, request_index, queue):
        self.requests.add(request.request_id)

    def remove_request(self, request_id):
        self.requests.discard(request_id)

    def abort_requests(self, request_ids, internal):
        gone = [r for r in request_ids if r in self.requests]
        self.requests.difference_update(gone)
        return gone


def fixed_pool_class():
    """This release's StagePool running 0.32.0rc1's REAL submit_initial: the function compiled from the fixed
    release's file (its own line numbers) in this release's module namespace, so its abort goes through this
    release's own abort_requests. A release without ``_pick_or_select`` (0.21.0rc1) gets the non-distributed one
    0.22.0+ have: ``select_replica_id``."""
    import __future__
    import ast

    from omni_patches.testing import releases
    from vllm_omni.engine import stage_pool

    path = releases.real_file("vllm-omni", FIXED, POOL_RELPATH)
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StagePool")
    func = next(n for n in cls.body if getattr(n, "name", None) == "submit_initial")
    namespace = dict(vars(stage_pool))
    namespace.setdefault("StageUnavailableError", type("StageUnavailableError", (RuntimeError,), {}))
    exec(compile(ast.Module([func], []), str(path), "exec", flags=__future__.annotations.compiler_flag,
                 dont_inherit=True), namespace)
    body = {"submit_initial": namespace["submit_initial"]}
    if not hasattr(stage_pool.StagePool, "_pick_or_select"):
        async def _pick_or_select(self, request_id, *, affinity_request_id=None):
            return self.select_replica_id(request_id, affinity_request_id=affinity_request_id)

        body["_pick_or_select"] = _pick_or_select
    return type("StagePoolWithFixedSubmit", (stage_pool.StagePool,), body)


def submit(mode, fixed=False):
    """submit_initial of the ``Engine.VICTIM`` request on a fresh one-replica pool (``fixed``: 0.32.0rc1's
    submit_initial on this release's pool), driven as ``mode`` says; what the engine, the pool and the caller saw.
    ``cancel-one-of-two``: a second request is submitted, and completes, while the first one's add is pending."""
    import asyncio
    import types

    from vllm_omni.engine.stage_pool import StagePool

    pool_class = fixed_pool_class() if fixed else StagePool

    async def main():
        engine, processor = Engine(mode), Processor()
        pool = pool_class(0, [engine], output_processor=processor)
        state = types.SimpleNamespace(sampling_params_list=[types.SimpleNamespace()])

        def start(request_id):
            request = types.SimpleNamespace(request_id=request_id)
            return asyncio.ensure_future(pool.submit_initial(request_id, state, request))

        task, others = start(Engine.VICTIM), []
        if mode.startswith("cancel"):
            await engine.accepted.wait()
            if mode == "cancel-one-of-two":
                others.append(start("req-2"))
                await asyncio.wait(others, timeout=5)
            task.cancel()
            if mode.endswith("abort-cancelled"):  # once the abort started (stock never starts one), cancel again
                aborting = asyncio.ensure_future(engine.aborting.wait())
                await asyncio.wait([task, aborting], timeout=5, return_when=asyncio.FIRST_COMPLETED)
                if aborting.done():
                    task.cancel()
                aborting.cancel()
        await asyncio.wait([task, *others], timeout=5)
        if not all(t.done() for t in (task, *others)):
            return {"raised": "still running after 5 s"}
        if task.cancelled():
            raised = "CancelledError"
        else:
            error = task.exception()
            raised = None if error is None else f"{type(error).__name__}: {error}"
        requests = [Engine.VICTIM, *(["req-2"] if others else [])]
        return {"raised": raised, "others": [t.result() for t in others], "engine": engine.calls,
                "running": sorted(engine.running), "bound": [pool.get_bound_replica_id(r) for r in requests],
                "processor": sorted(processor.requests)}

    return asyncio.run(main())


def scenario(modes, graft=True):
    """Every mode on stock, with 0.32.0rc1's submit_initial on this release's pool (``graft``), then on stock with
    the shim turned on in this process; the patch's status."""
    from support.omni_children import activate, status

    stock = {mode: submit(mode) for mode in modes}
    fixed = {mode: submit(mode, fixed=True) for mode in modes} if graft else None
    applied = activate(PATCH_ID)
    patched = {mode: submit(mode) for mode in modes}
    return {"stock": stock, "fixed_here": fixed, "patched": patched,
            "status": {**status(PATCH_ID), "at_activation": applied}}


def _client_without_add():
    """An AR replica whose client has no add_request_async: stock's rollback, an AttributeError, no abort."""
    import asyncio
    import types

    from vllm_omni.engine.stage_pool import StagePool

    class Detached:
        stage_type = "llm"
        calls = []

        async def abort_requests_async(self, request_ids):
            self.calls.append(list(request_ids))

    async def main():
        processor, client = Processor(), Detached()
        pool = StagePool(0, [client], output_processor=processor)
        state = types.SimpleNamespace(sampling_params_list=[types.SimpleNamespace()])
        try:
            await pool.submit_initial("req-1", state, types.SimpleNamespace(request_id="req-1"))
        except AttributeError as exc:
            return {"raised": type(exc).__name__, "aborts": client.calls, "bound": pool.get_bound_replica_id("req-1"),
                    "processor": sorted(processor.requests)}
        return {"raised": None}

    return asyncio.run(main())


CASE = Case(
    patch_id=PATCH_ID,
    affected=[sandbox(v) for v in CONTRACT],
    skipped=skipped(
        sandbox, "0.30.0", SWITCH,
        # Upstream's fix found by feature although the version says 0.30.0 (a vendor backport of the abort).
        backport=(POOL_RELPATH, ADD, ADD.replace("except Exception:\n", "except BaseException:\n"
                                                 "            await self.abort_requests([request_id])\n")),
        # 0.20.0rc1 has no StagePool; 0.20.0 (out of range) is the drifted layout below.
        outside="0.20.0", fixed=(FIXED,)),
    source_built=source_built(sandbox, "0.30.0", "0.30.1.dev4+g1a2b3c4d", fixed=FIXED),
    drifted=[
        # 0.20.0 installed from a checkout of its line: the same missing abort, in a layout with nothing to guard.
        (Env.source_build(sandbox("0.20.0"), METADATA.format("0.20.0"), "0.20.0", "0.20.1.dev2+g0a1b2c3d"),
         "does not add through self._llm_client"),
        (Env.edited("omni-0.30.0-renamed", BASE, POOL_RELPATH, "    def _llm_client(", "    def _ar_client("),
         "no attribute '_llm_client'"),
        # A vendor's rollback that catches everything (no abort): the guard's carrier would be caught there.
        (Env.edited("omni-0.30.0-catch-all", BASE, POOL_RELPATH, ADD, ADD.replace("Exception", "BaseException")),
         "no longer rolls a failed add back with except Exception"),
    ],
    unexpected=[Unexpected(BASE, _client_without_add, note="the stage client has no add_request_async")],
)


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here; the words are omni_patches.tools.audit's).
VERDICTS = {
    "vllm-omni==0.20.0": "skip: out of range", "vllm-omni==0.21.0rc1": "would apply",
    "vllm-omni==0.30.0": "would apply", "vllm-omni==0.31.0rc1": "would apply",
    "vllm-omni==0.32.0rc1": "skip: fixed upstream",
}
