"""Serving tier, MoE: a tiny HunyuanImage3 served by a real ``vllm serve <model> --omni`` on vllm-omni 0.22.0 (CPU).

HunyuanImage3 is the one diffusion model of vllm-omni 0.18-0.23 whose MoE runs on vLLM's ``FusedMoE``, so it is where
``moe-ep-parallel-mapping`` (EP group = TP·SP·CFG·DP) lives in a real server. The model is
``support/serving_model_hy3.py``'s (2 layers, 8 experts top-2 plus a shared expert, ~4.5 MB bf16, random weights
scaled so the image has real contrast and the experts matter to it), served DiT-only from a deploy YAML
(``--deploy-config``, ``pipeline: hunyuan_image3_dit``; in 0.22 ``--enable-expert-parallel`` is refused under
``--omni``, EP comes from the YAML's ``parallel_config``). vllm-omni has no CPU platform: the serving tier's
test-support one (``support/serving_cpu_platform.py``) is on the server's ``PYTHONPATH``; a multi-rank server sets
``OMNI_SERVING_TEST_DEVICE_COUNT`` to its world size and, with EP, ``OMNI_SERVING_TEST_MOE_STANDINS=1`` (the CPU MoE
stand-ins of ``support/cpu_moe_standins.py`` in every process; each EP rank logs one ``OMNI_TEST_MOE_LAYOUT`` line).

One :class:`MoeRun` per module holds every server of the run; each *case* (a server, started, asked for images and
for ``omni-patches status``, stopped) runs once and its results are kept for the tests (``MoeRun.case``). Cases:

* ``one_worker`` -- tp=1, the shim on (``OMNI_PATCHES=1``): healthy, a 64x64 image with real contrast, the same
  seed twice gives the same pixels, and ``status --all-processes`` names ``moe-ep-parallel-mapping`` with the
  processes it applied in.

Multi-rank cases (TP2·CFG2 with EP, stock and shim, against ``one_worker``'s image) are added as more entries of
``CASES`` (a :class:`Case` each) and tests reading ``run.case(name)``; :meth:`MoeRun.serve` takes the parallel sizes.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from omni_patches import fleet

from support import serving

pytestmark = [pytest.mark.serving, pytest.mark.stack, pytest.mark.xdist_group("heavy")]

OMNI = "0.22.0"
PATCH = "moe-ep-parallel-mapping"
SIZE = "64x64"
STEPS = 2
SEED = 7
PROMPT = "a red cat sits on the mat"
# A flat image (the random model's VAE painting the same colour whatever the latents hold) has a pixel std of a few
# 1/255; this model's reference image has ~60-75.
MIN_PIXEL_STD = 20.0
HEALTHY_TIMEOUT_S = 900
# Server start-up: dynamo's tracing of the model's small functions costs CPU time and memory here and gives nothing.
BASE_ENV = {"TORCHDYNAMO_DISABLE": "1"}
#: TEST SUPPORT env switches of the CPU platform (serving_cpu_platform.py).
DEVICE_COUNT = "OMNI_SERVING_TEST_DEVICE_COUNT"
MOE_STANDINS = "OMNI_SERVING_TEST_MOE_STANDINS"
LAYOUT_TAG = "OMNI_TEST_MOE_LAYOUT"


@dataclasses.dataclass(frozen=True)
class Case:
    """One server of the run: its parallel layout, shim or stock, and what it is asked."""
    shim: bool
    tp: int = 1
    cfg: int = 1
    ulysses: int = 1
    ring: int = 1
    ep: bool = False
    guidance_scale: float = 1.0
    images: int = 2  # the same seed each time

    @property
    def world(self) -> int:
        return self.tp * self.cfg * self.ulysses * self.ring


CASES = {
    "one_worker": Case(shim=True),
}


def rss_bytes(pids) -> dict[int, int]:
    """``{pid: resident bytes}`` from /proc (VmRSS) of the processes still alive."""
    out = {}
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out[pid] = int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return out


def pixel_std(omni: str, png: bytes) -> float:
    import numpy as np

    [arr] = serving.decode_png(omni, png)
    return float(np.asarray(arr, dtype=np.float64).std())


class MoeRun:
    """The servers of the module's run on ``omni``; each case runs once, its results (or error) kept."""

    def __init__(self, omni: str, workdir: Path):
        self.omni, self.workdir = omni, workdir
        self.model = serving.tiny_hy3_model(omni)
        self.results, self.errors, self.timings = {}, {}, {}
        self.servers: list[serving.Server] = []

    def case(self, name: str) -> dict:
        if name not in self.results and name not in self.errors:
            t0 = time.monotonic()
            try:
                self.results[name] = self._run(name, CASES[name])
            except Exception as exc:  # reported by every test of the case
                self.errors[name] = exc
            else:
                self._dump(name)
            self.timings[name] = round(time.monotonic() - t0, 1)
        if name in self.errors:
            raise self.errors[name]
        return self.results[name]

    def _dump(self, name: str) -> None:
        plain = {k: v for k, v in self.results[name].items() if not isinstance(v, (bytes, serving.Server, list))
                 or (isinstance(v, list) and not any(isinstance(x, bytes) for x in v))}
        (self.workdir / f"{name}.json").write_text(json.dumps(plain, indent=1, default=repr))

    def serve(self, name: str, case: Case) -> serving.Server:
        """A server (not started) for ``case``: its deploy YAML, and the platform's switches for several ranks / EP."""
        workdir = self.workdir / name
        deploy = serving.hy3_deploy_yaml(workdir / "deploy.yaml", tp=case.tp, cfg=case.cfg, ulysses=case.ulysses,
                                         ring=case.ring, ep=case.ep)
        env = dict(BASE_ENV)
        if case.world > 1:
            env[DEVICE_COUNT] = str(case.world)
        if case.ep:
            env[MOE_STANDINS] = "1"
        s = serving.Server(self.omni, self.model["model"], shim=case.shim, name=f"{self.omni}-{name}",
                           args=["--deploy-config", str(deploy)], env=env, workdir=workdir)
        self.servers.append(s)
        return s

    def _run(self, name: str, case: Case) -> dict:
        s = self.serve(name, case)
        out = {"case": dataclasses.asdict(case)}
        try:
            s.start()
            out["healthy_s"] = round(s.wait_healthy(HEALTHY_TIMEOUT_S), 1)
            pngs, seconds = [], []
            for _ in range(case.images):
                t0 = time.monotonic()
                pngs.append(s.image(PROMPT, size=SIZE, steps=STEPS, seed=SEED, guidance_scale=case.guidance_scale))
                seconds.append(round(time.monotonic() - t0, 2))
            out["pngs"], out["image_s"] = pngs, seconds
            procs = s.processes()
            rss = rss_bytes(procs)
            out["rss"] = {str(pid): {"bytes": n, "cmd": " ".join(procs.get(pid, []))[:120]} for pid, n in rss.items()}
            out["rss_total_bytes"] = sum(rss.values())
            out["records"] = s.records()
            status = s.cli("status", "--all-processes", "--state-dir", str(s.state_dir))
            out["status_text"] = status.stdout + status.stderr
        finally:
            out["stopped"] = s.stop(grace=30)
            log = s.log_text()
            out["layout_lines"] = [ln[ln.index(LAYOUT_TAG):] for ln in log.splitlines() if LAYOUT_TAG in ln]
            out["ep_rank_lines"] = [ln[ln.index("[EP Rank"):] for ln in log.splitlines() if "[EP Rank" in ln]
            out["log_tail"] = s.log_tail(60)
        if out.get("pngs"):
            out["pixel_std"] = round(pixel_std(self.omni, out["pngs"][0]), 2)
        return out

    def stop_all(self) -> None:
        for s in self.servers:
            s.stop(grace=5)


@pytest.fixture(scope="module")
def run():
    serving.serving_python(OMNI)  # the stack, with this checkout installed
    started = time.monotonic()
    # Logs and state of the last run per session, kept for inspection under the cache root; another session's are
    # left alone while its process lives.
    workdir = serving.SERVING / "runs" / f"moe-{OMNI}-{os.getpid()}"
    for old in (serving.SERVING / "runs").glob(f"moe-{OMNI}-*"):
        pid = old.name.rpartition("-")[2]
        if old == workdir or not pid.isdigit() or not fleet.alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    r = MoeRun(OMNI, workdir)
    try:
        yield r
    finally:
        r.stop_all()
        print(f"\nserving tier (MoE), vllm-omni {OMNI}: {time.monotonic() - started:.0f}s (cases {r.timings})")
        for name, res in r.results.items():
            print(f"  {name}: healthy {res.get('healthy_s')} s, s/image {res.get('image_s')}, "
                  f"RSS {res.get('rss_total_bytes', 0) / 2**30:.2f} GiB over {len(res.get('rss', {}))} processes, "
                  f"pixel std {res.get('pixel_std')}")


def patch_states(record: dict) -> dict:
    return {k: v["state"] for k, v in record["patches"].items()}


# -- one worker, shim on ------------------------------------------------------------------------------------------
def test_one_worker_serves_an_image_with_contrast(run):
    r = run.case("one_worker")
    print(f"\none worker (shim): healthy after {r['healthy_s']} s, s/image {r['image_s']}, pixel std "
          f"{r['pixel_std']}/255, RSS {r['rss_total_bytes'] / 2**20:.0f} MiB: "
          + ", ".join(f"{pid} {v['bytes'] / 2**20:.0f} MiB" for pid, v in r["rss"].items()))
    assert r["healthy_s"] < HEALTHY_TIMEOUT_S
    assert len(r["pngs"]) == CASES["one_worker"].images
    [arr] = serving.decode_png(run.omni, r["pngs"][0])
    assert (len(arr), len(arr[0])) == (64, 64)
    assert r["pixel_std"] >= MIN_PIXEL_STD, r["pixel_std"]


def test_one_worker_same_seed_same_pixels(run):
    r = run.case("one_worker")
    [stats] = serving.image_stats(run.omni, r["pngs"][0], r["pngs"][1])
    assert stats.get("differing") == 0, stats


def test_one_worker_status_names_ep_patch_where_applied(run):
    r = run.case("one_worker")
    assert PATCH in r["status_text"], r["status_text"]
    applied = {rec["pid"]: (rec.get("process_name"), rec.get("role"), rec["patches"][PATCH].get("targets"))
               for rec in r["records"] if patch_states(rec).get(PATCH) == "applied"}
    print(f"\n{PATCH} applied in: {applied}")
    # The model is built in the diffusion worker (its record's role: "rank 0" once its distributed init ran), where
    # the patch wraps the parallel state, the worker's own initialize_model_parallel and the MoE block.
    workers = [pid for pid, (name, role, _) in applied.items() if (name or "").startswith("DiffusionWorker")
               and role == "rank 0"]
    assert workers, [(rec.get("process_name"), rec.get("role"), patch_states(rec).get(PATCH)) for rec in r["records"]]
    assert "vllm_omni.diffusion.worker.diffusion_worker" in applied[workers[0]][2], applied
    # status --all-processes says it, per process: the worker's row reads "rank 0" and "applied".
    rows = {line.split()[0]: line for line in r["status_text"].splitlines() if line.split()[:1]
            and line.split()[0].isdigit()}
    for pid in applied:
        assert str(pid) in rows and "applied" in rows[str(pid)], (pid, r["status_text"])
    assert "rank 0" in rows[str(workers[0])], r["status_text"]
    assert r["stopped"]["remaining"] == [], r["stopped"]
