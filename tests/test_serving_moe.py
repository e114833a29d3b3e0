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
  processes it applied in. Its image is the reference of the multi-rank cases.
* ``tp2_cfg2_ep_*`` and ``tp2_sp2_ep_shim`` -- 4 worker ranks with EP, stock (shim off, TP2·CFG2) and shim (both
  layouts), each its own server. The TP2·CFG2 shim server is the README's ``examples/run_default.py --moe``, run as
  an operator runs it (``Case.example``), its ``--report`` read back.
  Shim: vLLM's EP over all 4 ranks (FusedMoE ``[EP Rank r/4]``, 2 of 8 experts each), each expert held by exactly
  one rank (every rank's ``OMNI_TEST_MOE_LAYOUT`` line), the image equal to the reference within the bound derived
  in :func:`test_shim_image_equals_one_worker_within_the_layouts_bound`, every worker rank recorded with the patch
  applied and its EP rank noted in ``status --all-processes``. Stock is the negative control of the layout:
  FusedMoE's EP over TP only (``[EP Rank r/2]``, every expert on 2 ranks) inside omni's 4-rank EP group -- the
  mismatch behind the seed's crash. One stock server serves both layouts' negative control: stock builds FusedMoE's
  EP from TP alone whatever SP or CFG hold (that is the bug), and TP2·SP2 stock gave TP2·CFG2 stock's layout and
  pixels (measured, 2026-12-05; bench/README.md); stock's groups for every layout and release are in
  tests/patches/moe_ep_parallel_mapping/. On CPU stock does not crash: the seed's ``shape '[8, 16]' is invalid`` is on
  the NPU path (vllm-ascend's MC2 dispatch over that group); vLLM's CPU experts and combine give right numbers.
* ``sp2_cfg2_ep_*`` -- SP > 1 with CFG > 1: vLLM's MoE runner combines DP before PCP, so a mapped layout would fail
  the first MoE forward (the start-up dummy run); the shim warns (server log and ``status``) and leaves the init
  stock, so the server serves as stock does: the same image, no EP beyond TP.

* ``distill_*`` -- vllm-omni 0.32.0rc1, one worker each, stock and shim, ``--lora-backend distill`` (the default
  PEFT backend picks Triton MoE experts; HunyuanImage3 ignores a distilled LoRA file): the same pixels, and
  ``status --all-processes`` says why ``moe-lora-idle-detach`` has nothing to act on: skipped:absent, no vllm-ascend.

Every case runs once per module (``MoeRun.case``); the figures are printed at the end of the module.
"""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import serving
from support import cpu_moe_standins as moe_standins

# xdist group "heavy-b" (tests/conftest.py HEAVY): beside the heavy one, never beside another server of its own.
pytestmark = [pytest.mark.serving, pytest.mark.stack]

OMNI = serving.HY3_STACK
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "run_default.py"
PATCH = "moe-ep-parallel-mapping"
SIZE = "64x64"
STEPS = 2
SEED = 7
GUIDANCE = 5.0
PROMPT = "a red cat sits on the mat"
# A flat image (the random model's VAE painting the same colour whatever the latents hold) has a pixel std of a few
# 1/255; this model's reference image has ~60-75.
MIN_PIXEL_STD = 20.0
HEALTHY_TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Case:
    """One server of the run: its parallel layout, shim or stock, and what it is asked."""
    shim: bool
    tp: int = 1
    cfg: int = 1
    ulysses: int = 1
    ring: int = 1
    ep: bool = False
    # --lora-backend distill (0.32.0rc1): see test_032_shim_equals_stock_and_says_why_idle_detach_has_nothing_to_do
    distill: bool = False
    # One request per entry, the same prompt and seed each time. Guidance > 1: classifier-free guidance, two
    # forwards per step -- what a CFG-parallel server splits over its CFG ranks.
    guidance: tuple = (GUIDANCE,)
    # Served by the README's ``examples/run_default.py --moe`` (its ``--report`` read back) instead of by the test:
    # that command's server is this case's (``serving.hy3_server``, TP2·CFG2 with EP, the shim on, one request
    # with PROMPT, SEED, GUIDANCE, SIZE, STEPS), so the seed's job in one command is one of the run's servers.
    example: bool = False


CASES = {
    "one_worker": Case(shim=True, guidance=(GUIDANCE, GUIDANCE)),
    "tp2_cfg2_ep_stock": Case(shim=False, tp=2, cfg=2, ep=True),
    "tp2_cfg2_ep_shim": Case(shim=True, tp=2, cfg=2, ep=True, example=True),
    "tp2_sp2_ep_shim": Case(shim=True, tp=2, ulysses=2, ep=True),
    "sp2_cfg2_ep_stock": Case(shim=False, ulysses=2, cfg=2, ep=True),
    "sp2_cfg2_ep_shim": Case(shim=True, ulysses=2, cfg=2, ep=True),
    # vllm-omni 0.32.0rc1 (run32): one worker each, --lora-backend distill
    "distill_stock": Case(shim=False, distill=True),
    "distill_shim": Case(shim=True, distill=True),
}
OMNI_032 = "0.32.0rc1"


class MoeRun(serving.Steps):
    """The servers of the module's run on ``omni``; each case runs once, its results (or error) kept."""

    def __init__(self, omni: str, workdir: Path):
        super().__init__()
        self.omni, self.workdir = omni, workdir
        self.model = serving.tiny_hy3_model(omni)
        self.servers: list[serving.Server] = []

    def case(self, name: str) -> dict:
        return self.step(name, lambda: self._run(name, CASES[name]))

    def _dump(self, name: str) -> None:
        plain = {k: v for k, v in self.results[name].items() if not isinstance(v, (bytes, serving.Server, list))
                 or (isinstance(v, list) and not any(isinstance(x, bytes) for x in v))}
        (self.workdir / f"{name}.json").write_text(json.dumps(plain, indent=1, default=repr))

    def serve(self, name: str, case: Case) -> serving.Server:
        """A server (not started) for ``case``: its deploy YAML, and the platform's switches for several ranks / EP
        (``serving.hy3_server``)."""
        # HunyuanImage3 has no load_lora_weights: with the distill backend vllm-omni warns ("does not support
        # loading distilled LoRA weights") and never opens the file; the flag keeps the PEFT manager out, which on a
        # LoRA config picks Triton MoE experts (no Triton on CPU). Any existing file names it.
        args = ("--lora-backend", "distill", "--lora-path", str(Path(self.model["model"]) / "config.json")) \
            if case.distill else ()
        s = serving.hy3_server(self.omni, self.model["model"], shim=case.shim, name=f"{self.omni}-{name}",
                               workdir=self.workdir / name, tp=case.tp, cfg=case.cfg, ulysses=case.ulysses,
                               ring=case.ring, ep=case.ep, args=args)
        self.servers.append(s)
        return s

    def _run(self, name: str, case: Case) -> dict:
        out = {"case": dataclasses.asdict(case)}
        log = self._by_example(name, out) if case.example else self._by_test(name, case, out)
        out["rss_total_bytes"] = sum(v["bytes"] for v in out["rss"].values())
        out["layout"] = moe_standins.layout_facts(log)
        out["ep_rank_lines"] = [ln[ln.index("[EP Rank"):] for ln in log.splitlines() if "[EP Rank" in ln]
        out["patch_log_lines"] = [ln for ln in log.splitlines() if f"{PATCH}:" in ln]
        out["log_tail"] = "\n".join(log.splitlines()[-60:])
        if out.get("pngs"):
            out["pixel_std"] = round(serving.pixel_std(self.omni, out["pngs"][0]), 2)
        return out

    def _by_test(self, name: str, case: Case, out: dict) -> str:
        """Serve ``case`` here: start, images, records and ``status`` while serving, stop. The server's log."""
        s = self.serve(name, case)
        try:
            s.start()
            out["healthy_s"] = round(s.wait_healthy(HEALTHY_TIMEOUT_S), 1)
            pngs, seconds = [], []
            for guidance in case.guidance:
                t0 = time.monotonic()
                pngs.append(s.image(PROMPT, size=SIZE, steps=STEPS, seed=SEED, guidance_scale=guidance))
                seconds.append(round(time.monotonic() - t0, 2))
            out["pngs"], out["image_s"] = pngs, seconds
            out["rss"] = serving.rss_by_process(s)
            out["records"] = s.records()
            # --all-patches on the distill cases: a patch skipped in every process (there: moe-lora-idle-detach,
            # skipped:absent) is only listed with it.
            status = s.cli("status", "--all-processes", *(("--all-patches",) if case.distill else ()),
                           "--state-dir", str(s.state_dir))
            out["status_text"] = status.stdout + status.stderr
        finally:
            out["stopped"] = s.stop(grace=30)
        return s.log_text()

    def _by_example(self, name: str, out: dict) -> str:
        """Serve the case by ``examples/run_default.py --moe`` (see ``Case.example``) as an operator would run it,
        and read its ``--report`` back. The server's log."""
        workdir = self.workdir / name
        workdir.mkdir(parents=True, exist_ok=True)
        png, report = workdir / "moe.png", workdir / "report.json"
        report.unlink(missing_ok=True)
        proc = subprocess.run([sys.executable, str(EXAMPLE), "--moe", "--out", str(png), "--report", str(report)],
                              capture_output=True, text=True, timeout=1800, env=serving.clean_child_env())
        out["example_output"] = proc.stdout + proc.stderr
        facts = json.loads(report.read_text()) if report.exists() else {}
        if proc.returncode or facts.get("returncode") != 0:
            raise RuntimeError(f"examples/run_default.py --moe exited {proc.returncode} (report: "
                               f"{facts.get('error', 'none')}):\n{out['example_output'][-5000:]}")
        out.update(healthy_s=facts["healthy_s"], image_s=[facts["image_s"]], pngs=[png.read_bytes()],
                   rss=facts["rss"], records=facts["records"], status_text=facts["status_text"], stopped=facts["stopped"])
        return Path(facts["log"]).read_text(errors="replace")

    def stop_all(self) -> None:
        for s in self.servers:
            s.stop(grace=5)


def _moe_run(omni: str):
    serving.serving_python(omni)  # the stack, with this checkout installed
    started = time.monotonic()
    r = MoeRun(omni, serving.session_workdir(f"moe-{omni}"))
    try:
        yield r
    finally:
        r.stop_all()
        print(f"\nserving tier (MoE), vllm-omni {omni}: {time.monotonic() - started:.0f}s (cases {r.timings})")
        for name, res in r.results.items():
            print(f"  {name}: healthy {res.get('healthy_s')} s, s/image {res.get('image_s')}, "
                  f"RSS {res.get('rss_total_bytes', 0) / 2**30:.2f} GiB over {len(res.get('rss', {}))} processes, "
                  f"pixel std {res.get('pixel_std')}")


@pytest.fixture(scope="module")
def run():
    yield from _moe_run(OMNI)


@pytest.fixture(scope="module")
def run32():
    yield from _moe_run(OMNI_032)


def patch_states(record: dict) -> dict:
    return {k: v["state"] for k, v in record["patches"].items()}


def test_layout_facts_are_read_where_ranks_wrote_them_onto_one_line():
    """Four ranks write to one server log at once: a fact may stand right after another rank's, before that one's
    newline (CI 2026-12-07: ``Extra data`` from json on such a line). Each fact is read, whole, once."""
    tag = moe_standins.LAYOUT_TAG
    fact = {r: json.dumps({"pid": 100 + r, "rank": r, "experts": [2 * r, 2 * r + 1], "ep_rank": r, "ep_size": 4})
            for r in range(4)}
    log = (f"(Worker_TP2 pid=102) {tag} {fact[2]}(Worker_TP3 pid=103) {tag} {fact[3]}\n\n"
           f"INFO noise {{not json}}\n(Worker_TP0 pid=100) {tag} {fact[0]}\n{tag} {fact[1]}\n")
    facts = moe_standins.layout_facts(log)
    assert [f["rank"] for f in facts] == [0, 1, 2, 3] and facts[3] == json.loads(fact[3])
    assert moe_standins.layout_facts("no facts here\n") == []


# -- one worker, shim on ------------------------------------------------------------------------------------------
def test_one_worker_serves_an_image_with_contrast(run):
    r = run.case("one_worker")
    print(f"\none worker (shim): healthy after {r['healthy_s']} s, s/image {r['image_s']}, pixel std "
          f"{r['pixel_std']}/255, RSS {r['rss_total_bytes'] / 2**20:.0f} MiB: "
          + ", ".join(f"{pid} {v['bytes'] / 2**20:.0f} MiB" for pid, v in r["rss"].items()))
    assert r["healthy_s"] < HEALTHY_TIMEOUT_S
    assert len(r["pngs"]) == len(CASES["one_worker"].guidance)
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


# -- 4 worker ranks with EP: stock (the layout's negative control) vs shim -----------------------------------------
LAYOUTS = ["tp2_cfg2", "tp2_sp2"]
# The one stock server of the 4-rank layouts (the module docstring says why one serves both).
STOCK_LAYOUT = "tp2_cfg2"
WORKERS = 4
EXPERTS = 8
COMBINE_NOTE = "MoE runner combines over DP before PCP"


def describe(r: dict, facts: list[dict]) -> str:
    return (f"healthy {r['healthy_s']} s, s/image {r['image_s']}, RSS {r['rss_total_bytes'] / 2**30:.2f} GiB; "
            + "; ".join(f"rank {f['rank']} experts {f['experts']}" for f in facts))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shim_builds_ep_over_every_rank_each_expert_once(run, layout):
    r = run.case(f"{layout}_ep_shim")
    facts = r["layout"]
    print(f"\n{layout} shim: {describe(r, facts)}")
    assert [f["rank"] for f in facts] == list(range(WORKERS)), r["layout"]
    for f in facts:
        assert (f["ep_rank"], f["ep_size"], f["ep_ranks"]) == (f["rank"], WORKERS, list(range(WORKERS))), f
        assert len(f["experts"]) == EXPERTS // WORKERS, f
    assert sorted(e for f in facts for e in f["experts"]) == list(range(EXPERTS))  # each expert exactly once
    assert r["ep_rank_lines"] and all(f"/{WORKERS}]" in line for line in r["ep_rank_lines"]), r["ep_rank_lines"]


def test_stock_builds_fused_moe_ep_over_tp_only(run):
    """The negative control: stock 0.22.0 gives FusedMoE an expert map for EP 2 (TP) inside omni's 4-rank EP
    group, so every expert sits on 2 ranks -- the mismatch of the seed. On CPU that does not crash (vLLM's CPU
    experts and combine still give right numbers, see the image test); the seed's crash is on the NPU path."""
    r = run.case(f"{STOCK_LAYOUT}_ep_stock")
    facts = r["layout"]
    print(f"\n{STOCK_LAYOUT} stock: {describe(r, facts)}")
    assert [f["rank"] for f in facts] == list(range(WORKERS)), r["layout"]
    assert {f["ep_size"] for f in facts} == {WORKERS}  # omni's EP group: all 4 ranks
    held = moe_standins.holders(facts)
    assert held == {e: 2 for e in range(EXPERTS)}, held  # ... while FusedMoE's map is EP 2: each expert twice
    assert r["ep_rank_lines"] and all("/2]" in line for line in r["ep_rank_lines"]), r["ep_rank_lines"]
    assert r["records"] == []  # the shim never ran there


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shim_image_equals_one_worker_within_the_layouts_bound(run, layout):
    """The shim's image against the one-worker reference, within a bound derived from stock at TP 2.

    Both split each linear layer over the same 2 TP ranks, whose bf16 partial sums add in another order than one
    worker's: stock's distance from the reference, measured in this run (mean ~2.8/255, max ~22 on 2026-12-05), is
    that layout's rounding floor. The shim also spreads the experts over 4 ranks instead of 2, which reorders the
    MoE combine's sums once more: bound 1.5x stock's mean and 2x its max. A wrong layout is far outside it (an
    expert missing or counted twice: shifting the expert ids by one moved the image by mean 46/255, max 255).
    TP2·SP2 and TP2·CFG2 give the same pixels (measured): Ulysses SP and CFG-parallel are exact here, TP's bf16
    partial sums are the whole difference from one worker -- so TP2·CFG2 stock's distance is both layouts' floor."""
    ref = run.case("one_worker")["pngs"][0]
    stock, shim = run.case(f"{STOCK_LAYOUT}_ep_stock"), run.case(f"{layout}_ep_shim")
    s_stock, s_shim = serving.image_stats(run.omni, ref, stock["pngs"][0], shim["pngs"][0])
    bound = {"mean": max(1.5 * s_stock["mean"], 1.0), "max": max(2 * s_stock["max"], 8.0)}
    print(f"\n{layout} vs one worker: stock mean {s_stock['mean']:.2f} max {s_stock['max']:.0f}, shim mean "
          f"{s_shim['mean']:.2f} max {s_shim['max']:.0f} (bound mean {bound['mean']:.2f} max {bound['max']:.0f}); "
          f"pixel std stock {stock['pixel_std']} shim {shim['pixel_std']}")
    assert shim["pixel_std"] >= MIN_PIXEL_STD and stock["pixel_std"] >= MIN_PIXEL_STD
    assert s_shim["mean"] <= bound["mean"] and s_shim["max"] <= bound["max"], (s_shim, bound)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shim_status_lists_every_worker_rank_applied(run, layout):
    """``status --all-processes``: "4 of 4 worker rank(s)", each rank's row with the patch applied, and the EP rank
    the patch noted in each."""
    r = run.case(f"{layout}_ep_shim")
    text = r["status_text"]
    print("\n" + text)
    assert re.search(rf"instance \S+: {WORKERS} of {WORKERS} worker rank\(s\) recorded \(vLLM world size "
                     rf"{WORKERS}", text), text
    workers = {int(rec["rank"]): rec for rec in r["records"] if rec.get("rank") is not None}
    assert sorted(workers) == list(range(WORKERS)), [(rec.get("pid"), rec.get("rank")) for rec in r["records"]]
    rows = {line.split()[0]: line for line in text.splitlines() if line.split()[:1] and line.split()[0].isdigit()}
    for rank, rec in workers.items():
        assert patch_states(rec)[PATCH] == "applied", rec["patches"][PATCH]
        assert "applied" in rows[str(rec["pid"])], text
        assert re.search(rf"{PATCH} in {rec['pid']} \(rank {rank}\): mapped: vLLM EP rank {rank} of {WORKERS} "
                         rf"over ranks \[0, 1, 2, 3\]", text), text


# -- SP2·CFG2 with EP: the combine-order warning, and the server runs as stock ---------------------------------
def test_sp_with_cfg_shim_warns_and_serves_as_stock(run):
    """vLLM's MoE runner cannot combine SP > 1 with CFG > 1 once mapped (a mapped server fails its start-up dummy
    run: ``reduce_scatterv: 1172 rows against sizes [293, 293]``). The shim says so in the server log and in
    ``status``, keeps the stock groups in every worker rank, and serves what stock serves: FusedMoE without EP
    (TP 1), the same image."""
    stock, shim = run.case("sp2_cfg2_ep_stock"), run.case("sp2_cfg2_ep_shim")
    assert any(COMBINE_NOTE in line for line in shim["patch_log_lines"]), shim["patch_log_lines"]
    assert COMBINE_NOTE in shim["status_text"] and "Not mapped" in shim["status_text"], shim["status_text"]
    workers = [rec for rec in shim["records"] if rec.get("rank") is not None]
    assert len(workers) == WORKERS
    for rec in workers:
        assert patch_states(rec)[PATCH] == "applied"
        assert any(COMBINE_NOTE in n for n in rec["patches"][PATCH]["notes"]), rec["patches"][PATCH]
        assert not any(n.startswith("mapped:") for n in rec["patches"][PATCH]["notes"])
    assert shim["layout"] == stock["layout"] == []  # no expert map: FusedMoE without EP, as stock
    assert shim["ep_rank_lines"] == stock["ep_rank_lines"]
    [same] = serving.image_stats(run.omni, stock["pngs"][0], shim["pngs"][0])
    print(f"\nSP2·CFG2 shim vs stock: {same}; healthy stock {stock['healthy_s']} s, shim {shim['healthy_s']} s")
    assert same["differing"] == 0, same


# -- vllm-omni 0.32.0rc1: the same model, one worker, --lora-backend distill ---------------------------------------
def test_032_shim_equals_stock_and_says_why_idle_detach_has_nothing_to_do(run32):
    """On 0.32.0rc1 (the EP patch is out of range there) the shim's image is stock's, pixel for pixel, and
    ``status --all-processes`` says why ``moe-lora-idle-detach`` has nothing to act on here: it requires vllm-ascend
    (only its MoE runners take a MoE-LoRA context), none is installed, so it is skipped:absent, not applied."""
    stock, shim = run32.case("distill_stock"), run32.case("distill_shim")
    [same] = serving.image_stats(run32.omni, stock["pngs"][0], shim["pngs"][0])
    print(f"\n0.32.0rc1 shim vs stock: {same}; healthy stock {stock['healthy_s']} s, shim {shim['healthy_s']} s, "
          f"pixel std {shim['pixel_std']}\n{shim['status_text']}")
    assert same["differing"] == 0, same
    assert shim["pixel_std"] >= MIN_PIXEL_STD
    idle = [rec["patches"]["moe-lora-idle-detach"] for rec in shim["records"]
            if "moe-lora-idle-detach" in rec["patches"]]
    assert idle and all(p["state"] == "skipped:absent" and "vllm-ascend is not installed" in p["reason"]
                        for p in idle), idle
    # The table (with --all-patches) reads skipped:absent in its column on every row, and the reason under it.
    lines = shim["status_text"].splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("pid "))
    col = lines[header].split().index("moe-lora-idle-detach")
    rows = [ln.split() for ln in lines[header + 2:] if ln.split()[:1] and ln.split()[0].isdigit()]
    assert rows and all(r[col] == "skipped:absent" for r in rows), shim["status_text"]
    assert "  moe-lora-idle-detach: skipped:absent — vllm-ascend is not installed" in lines, shim["status_text"]
    assert patch_states(shim["records"][0]).get(PATCH) == "skipped:version"  # EP patch: fixed upstream there


# -- the seed's job in one command: examples/run_default.py --moe ---------------------------------------------------
def test_run_default_moe_serves_tp2_cfg2_with_ep_and_shows_each_ranks_place(run):
    """What the README offers as the seed's job: ``examples/run_default.py --moe`` (the ``tp2_cfg2_ep_shim`` case's
    server, ``Case.example``) exits 0, writes an image with contrast, and prints ``status --all-processes`` with
    4 of 4 worker ranks and each rank's EP place."""
    r = run.case("tp2_cfg2_ep_shim")
    text = r["example_output"]
    print("\n" + text[-2500:])
    assert r["pixel_std"] >= MIN_PIXEL_STD
    assert re.search(rf"instance \S+: {WORKERS} of {WORKERS} worker rank\(s\) recorded", text), text[-3000:]
    for rank in range(WORKERS):
        assert f"(rank {rank}): mapped: vLLM EP rank {rank} of {WORKERS} over ranks [0, 1, 2, 3]" in text
