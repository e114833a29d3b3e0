"""``omni-patches status|doctor|list|audit [--json]``: what the shim does (or would do) in this environment."""
import argparse
import dataclasses
import json
import os
import sys
import time

from . import __version__, engine, envcheck, flags, reports
from .states import State, is_skipped


def _requires(st):
    parts = []
    for dist, spec in st.requires.items():
        have = st.installed.get(dist)
        assumed = f"; assumed: {st.assumed[dist]}" if dist in st.assumed else ""
        parts.append(f"{dist}{spec} (installed: {have or 'none'}{assumed})")
    return "; ".join(parts) or "-"


def _table(rows, headers):
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def _print(records, as_json, title, errors, env_problems=(), header=None):
    if as_json:
        doc = {"omni_patches": __version__, "mode": title, "registry_errors": errors,
               "environment_problems": list(env_problems), "patches": [r.to_dict() for r in records]}
        if header:
            doc["note"] = header
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    if header:
        print(header)
    rows = [(r.id, r.env, _requires(r), r.state, r.reason) for r in records]
    print(_table(rows, ("patch", "switch", "requires", "state", "reason")))
    for err in errors:
        print(f"registry error: {err}")
    for problem in env_problems:
        print(f"environment: {problem}")


def _environment():
    """Registry errors and OMNI_PATCHES* problems of this shell (reported by status and doctor)."""
    from . import registry

    reg = registry.load()
    return list(reg.errors), envcheck.environment_problems(reg)


def _gone_hint(shown, use_ray):
    """How to clean the records of dead processes: which command, and where (each node keeps its own files)."""
    if use_ray:
        return ("`omni-patches status --prune --ray` removes them from the cluster and from this host's state "
                "directory; every other node keeps its own local record files until `omni-patches status --prune` "
                "runs there")
    if any(r.get("ray") for r in shown if r.get("status") == "gone"):
        return ("`omni-patches status --prune` removes them here; Ray processes among them are also in the "
                "cluster's store: `omni-patches status --prune --ray` removes those")
    return "`omni-patches status --prune` removes them"


def _empty_view(directory, where, hidden, problems, leftovers):
    """Nothing to list: tell "nothing ever recorded here" (exit 1) from "they all exited or were pruned" (0)."""
    from . import fleet

    suffix = f"; {hidden} record(s) of dead processes hidden (--all shows them)" if hidden else ""
    if problems:
        print(f"no process record could be read from {where}{suffix}")
        return 2
    if not os.path.isdir(directory):
        print(f"no process has ever recorded itself in {where} (is OMNI_PATCHES=1 set in the serving "
              "processes, and OMNI_PATCHES_STATE_DIR the same here?)" + suffix)
        return 1
    pruned = fleet.last_prune(directory)
    how = (f"; `--prune` removed the last {pruned['removed']} record(s) of dead processes at "
           f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(pruned['time']))}") if pruned else ""
    print(f"no process is recorded in {where} now: the processes that recorded here have exited (a clean exit "
          f"removes its record){how}{suffix}")
    if leftovers:
        print(f"{len(leftovers)} temp file(s) of writers killed mid-write (`omni-patches status --prune` removes them)")
    return 0


def cmd_all_processes(args):
    """Records of every process the shim runs in: the state directory, or the Ray cluster with ``--ray``.

    Ghosts (dead processes older than their instance's live ones) are hidden unless ``--all``; ``--prune``
    removes the records of dead processes (state directory, and the cluster's KV entries with ``--ray``).
    Exit: 0 listed (or nothing left after clean exits / a prune), 1 nothing ever recorded here, 2 the records
    could not be read (state directory, Ray cluster).
    """
    from . import fleet, proof

    directory = args.state_dir or proof.state_dir()
    use_ray = getattr(args, "ray", None) is not None
    address = fleet.ray_address(args.ray or None) if use_ray else None
    cluster = None
    problems = []
    try:
        records = fleet.collect(directory, problems)
        if use_ray:
            cluster = fleet.Cluster(address)
            records = fleet.merge_local(fleet.collect_ray(cluster=cluster), records)
    except fleet.RayUnavailable as exc:
        print(f"status --ray: {exc}", file=sys.stderr)
        if args.json:  # a script reading stdout gets a document either way
            json.dump({"omni_patches": __version__, "mode": "status --prune" if getattr(args, "prune", False) else
                       "status --all-processes", "state_dir": directory, "ray": address, "error": str(exc)},
                      sys.stdout, indent=2)
            sys.stdout.write("\n")
        return 2
    for problem in problems:
        print(f"status: {problem}", file=sys.stderr)
    where = f"Ray cluster {cluster.address} (+ this host's {directory})" if use_ray else directory
    if getattr(args, "prune", False):
        more = []
        removed = fleet.prune(directory, more)
        for problem in more:
            if problem not in problems:
                problems.append(problem)
                print(f"status --prune: {problem}", file=sys.stderr)
        elsewhere = []
        if use_ray:
            removed += fleet.prune_ray(records, cluster=cluster)
            here = proof.boot("boot_id")
            elsewhere = sorted({r.get("node_ip") or r.get("host") or "?" for r in records
                                if r.get("source") == "ray" and r.get("status") == "gone" and r.get("boot_id") != here})
        note = (f"their nodes ({', '.join(elsewhere)}) keep their own local record files: run "
                "`omni-patches status --prune` on each") if elsewhere else None
        if args.json:
            doc = {"omni_patches": __version__, "mode": "status --prune", "state_dir": directory,
                   "ray": cluster.address if use_ray else None, "removed": removed, "problems": problems}
            if note:
                doc["note"] = note
            json.dump(doc, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            print(f"removed {len(removed)} record(s) of dead processes from {where}")
            for item in removed:
                print(f"  {item}")
            if note:
                print(note)
        return 2 if problems else 0
    shown = fleet.visible(records, show_all=getattr(args, "all", False))
    hidden = len(records) - len(shown)
    instances = fleet.instances(shown)
    leftovers = fleet.leftovers(directory)
    if args.json:
        json.dump({"omni_patches": __version__, "mode": "status --all-processes", "state_dir": directory,
                   "ray": cluster.address if use_ray else None, "hidden": hidden, "problems": problems,
                   "leftover_temp_files": leftovers, "instances": instances, "processes": shown},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
        if not shown:
            return 2 if problems else (0 if os.path.isdir(directory) else 1)
        return 0
    if not shown:
        return _empty_view(directory, where, hidden, problems, leftovers)
    ids = []
    for r in shown:
        ids.extend(i for i in r.get("patches", {}) if i not in ids)
    omitted = []
    if not getattr(args, "all_patches", False):  # a column per patch that applies somewhere on this stack
        omitted = [i for i in ids if all(is_skipped(r.get("patches", {}).get(i, {}).get("state", State.DISABLED))
                                         for r in shown if "error" not in r)]
        ids = [i for i in ids if i not in omitted]
    head = ("node", "node id", "pid", "rank", "role", "instance") if use_ray else ("pid", "group", "rank", "role",
                                                                                 "instance")
    rows = []
    for r in shown:
        if "error" in r:
            name = os.path.basename(r["file"]) if "file" in r else r.get("key")
            rows.append((name, *["-"] * (len(head) - 1), "unreadable", r["error"], *["-"] * len(ids)))
            continue
        rank = r.get("rank") if r.get("rank") is not None else "-"
        common = (r.get("pid"), rank, r.get("role") or "-", r.get("instance") or "-")
        if use_ray:
            node_id = ((r.get("ray") or {}).get("node_id") or "-")[:8]
            node = r.get("node_ip") or ("this host" if r.get("source") == "local" else "-")
            first = (node, node_id, *common)
        else:
            first = (r.get("pid"), r.get("pgid") if r.get("pgid") is not None else "-", *common[1:])
        patches = r.get("patches", {})
        updated = time.strftime("%H:%M:%S", time.localtime(r["updated"])) if r.get("updated") else "-"
        states = [State.INACTIVE] * len(ids) if r.get("inactive") else [patches.get(i, {}).get("state", "-") for i in ids]
        rows.append((*first, r["status"], updated, *states))
    print(f"processes recorded in {where}")
    print(_table(rows, (*head, "process", "recorded", *ids)))
    for r in shown:
        if r.get("inactive") and "error" not in r:
            print(f"pid {r.get('pid')} ({r.get('role')}): omni-patches is {r['inactive']}")
    _print_notes(shown, ids)
    if getattr(args, "all_patches", False):
        _print_skip_reasons(shown, ids)
    for inst, info in instances.items():
        if info.get("expected_workers") is not None:
            layout = " × ".join(f"{k.upper()} {info[k + '_size']}" for k in ("tp", "pp", "dp")
                                if info.get(k + "_size") is not None)
            line = (f"instance {inst}: {info['workers_found']} of {info['expected_workers']} worker rank(s) recorded "
                    f"(vLLM world size {info['expected_workers']}" + (f": {layout}" if layout else "") + ")")
            if info["missing_ranks"]:
                line += (f"; missing rank(s) {', '.join(map(str, info['missing_ranks']))}: a process where the shim "
                         "never ran records nothing (VLLM_PLUGINS leaving omni_patches out, omni-patches not "
                         "installed in that node's environment)")
            print(line)
        elif use_ray and not info["workers_found"]:
            print(f"instance {inst}: no worker rank recorded: a worker where the shim never ran records nothing "
                  "(VLLM_PLUGINS leaving omni_patches out, omni-patches not installed in that node's environment)")
    if omitted:
        print(f"{len(omitted)} patch(es) skipped in every process listed are not shown (--all-patches shows them)")
    gone = sum(1 for r in shown if r.get("status") == "gone")
    if gone:
        print(f"{gone} record(s) of processes that are gone (killed before they could clean up; "
              f"{_gone_hint(shown, use_ray)})")
    if hidden:
        print(f"{hidden} record(s) of dead processes older than their instance's live ones hidden (--all shows them)")
    if leftovers:
        print(f"{len(leftovers)} temp file(s) of writers killed mid-write (`omni-patches status --prune` removes them)")
    return 0


def _print_notes(shown, ids):
    """What the patches noted at call time in each live process (a mapping made, a fallback taken, a warning),
    under the table: one line per distinct note, with the processes that hold it."""
    held = {}
    for r in shown:
        if "error" in r or r.get("status") == "gone":
            continue
        who = f"{r.get('pid')}" + (f" (rank {r['rank']})" if r.get("rank") is not None else "")
        for pid in ids:
            for text in (r.get("patches", {}).get(pid, {}).get("notes") or ()):
                held.setdefault((pid, text), []).append(who)
    if held:
        print("noted at call time:")
        for (pid, text), who in held.items():
            print(f"  {pid} in {', '.join(who)}: {text}")


def _print_skip_reasons(shown, ids):
    """``--all-patches``: why each patch skipped in every live process listed is skipped -- the reason once when
    every process gives the same one."""
    live = [r for r in shown if "error" not in r and r.get("status") != "gone" and not r.get("inactive")]
    lines = []
    for pid in ids:
        entries = [r.get("patches", {}).get(pid) for r in live]
        if not entries or any(e is None or not is_skipped(e.get("state", State.DISABLED)) for e in entries):
            continue
        why = {(e.get("state"), e.get("reason") or "") for e in entries}
        if len(why) > 1:
            lines.append(f"  {pid}: skipped for {len(why)} different reasons across the processes (--json lists them)")
            continue
        [(state, reason)] = why
        lines.append(f"  {pid}: {state} — {reason}" if reason else f"  {pid}: {state}")
    if lines:
        print("skipped in every process, and why:")
        print("\n".join(lines))


class _ImpliesAllProcesses(argparse.Action):
    """``--ray``, ``--all`` and ``--prune`` are about every process: they imply ``--all-processes``."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.all_processes = True
        setattr(namespace, self.dest, True if self.nargs == 0 else (values or ""))


def _add_all_processes_arguments(p):
    p.add_argument("--all-processes", action="store_true",
                   help="every process of the serving instance the shim runs in (node, pid, rank, role, instance, "
                        "states), read from the state directory; dead ones are marked gone. Exit 0: listed (or "
                        "every process exited / was pruned), 1: nothing ever recorded there, 2: the records could "
                        "not be read (state directory, Ray cluster)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="state directory to read (default: $OMNI_PATCHES_STATE_DIR, else the per-user one)")
    p.add_argument("--ray", nargs="?", metavar="ADDRESS", action=_ImpliesAllProcesses, default=None,
                   help="read every node's records from the Ray cluster's KV store (default address: "
                        "$RAY_ADDRESS, else auto); needs ray installed where this runs")
    p.add_argument("--all", nargs=0, action=_ImpliesAllProcesses, default=False,
                   help="with --all-processes: also show dead processes older than their instance's live ones")
    p.add_argument("--prune", nargs=0, action=_ImpliesAllProcesses, default=False,
                   help="remove the records of dead processes and the temp files of writers killed mid-write "
                        "(state directory; with --ray also the cluster's); exit 2 if something could not be read "
                        "or removed")
    p.add_argument("--all-patches", nargs=0, action=_ImpliesAllProcesses, default=False,
                   help="with --all-processes: a column for every patch (default: only the patches that are not "
                        "skipped in every process listed; --json always holds all), and under the table why each "
                        "patch skipped in every process is skipped")


def cmd_status(args):
    if getattr(args, "all_processes", False):
        return cmd_all_processes(args)
    records = reports.status()
    errors, env_problems = _environment()
    header = None
    if not engine.is_active():
        header = (f"omni-patches is {reports.inactive_reason()}.\nEvery state is 'inactive'; the reasons say what a "
                  f"process started with {flags.MASTER}=1 in this environment would do.")
        if not args.json:  # the header says why once; each row keeps the prediction
            records = [dataclasses.replace(r, reason=f"{r.would} ({r.would_reason})") if r.would else r
                       for r in records]
    _print(records, args.json, "status", errors, env_problems, header)
    return 1 if any(r.state is State.FAILED for r in records) else 0


def cmd_doctor(args):
    if not args.json:
        print("doctor: importing every target and dry-running each patch's checks (nothing is wrapped)")
    records = reports.doctor()
    errors, env_problems = _environment()
    _print(records, args.json, "doctor", errors, env_problems)
    bad = [r for r in records if r.enabled and (r.state in (State.DRIFTED, State.FAILED) or r.warnings)]
    return 1 if bad or errors else 0


def cmd_audit(args):
    """``omni-patches audit``: exit codes as :data:`omni_patches.tools.audit.EXIT_CODES` (one meaning each)."""
    import time
    import traceback
    import warnings

    from . import gates, registry
    from .tools import audit

    started = time.perf_counter()
    blocks, latest = [], None
    try:
        reg = registry.load()
        with audit.usable_cache(args.cache) as cache, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # third-party noise (an import's own warnings) is not the audit's
            if args.latest is not None:
                latest = audit.resolve_latest(args.latest or audit.DEFAULT_LATEST, args.fetch_timeout)
                plans = audit.latest_plan(latest, args.specs)
            else:
                plans = [(None, specs) for specs in audit.plan(args.specs)]
            for label, specs in plans:
                dists = audit.obtain(specs, args.wheel, args.source, cache, args.fetch_timeout)
                blocks.append((label, dists, audit.run(dists, reg)))
    except audit.AuditError as exc:
        if args.json:
            json.dump({"omni_patches": __version__, "mode": "audit", "error": str(exc), "exit": exc.code},
                      sys.stdout, indent=2)
            sys.stdout.write("\n")
        print(f"audit: {exc}", file=sys.stderr)
        return exc.code
    except Exception:  # a bug of ours: never mistaken for a verdict (1) or a fetch failure (3)
        traceback.print_exc()
        print(f"audit: internal error (exit {audit.EXIT_INTERNAL}); please report it with the traceback above",
              file=sys.stderr)
        return audit.EXIT_INTERNAL
    elapsed = time.perf_counter() - started
    assumed, _ = gates.assumed_versions()
    assumed_note = (f"versions assumed for the gates ({gates.ASSUME}): " +
                    ", ".join(f"{d}={v}" for d, v in assumed.items())) if assumed else None
    code = max(audit.exit_code(results) for _, _, results in blocks)
    if reg.errors:  # a registry that cannot be read gives no verdict for what it holds: never a pass
        code = audit.EXIT_REGISTRY
    if args.json:
        audits = [{"label": label, "distributions": [d.to_dict() for d in dists.values()],
                   "patches": [r.to_dict() for r in results]} for label, dists, results in blocks]
        doc = {"omni_patches": __version__, "mode": "audit", "seconds": round(elapsed, 3), "assumed": assumed,
               "registry_errors": list(reg.errors), "exit": code, "audits": audits}
        if latest is not None:
            doc["latest"] = {d: {"newest": n, "newest_final": f} for d, (n, f) in latest.items()}
        if len(audits) == 1:
            doc.update(audits[0])
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        if latest is not None:
            print("newest on the index: " + "; ".join(f"{d} {n} (final: {f or 'none'})"
                                                        for d, (n, f) in latest.items()))
        for n, (label, dists, results) in enumerate(blocks):
            if n or latest is not None:
                print()
            given = "; ".join(f"{d.name} {d.version} ({d.origin})" for d in dists.values()) or "nothing"
            print(f"audit of {given}{f' [{label}]' if label else ''} -- read statically, nothing installed or "
                  "imported")
            if assumed_note:
                print(assumed_note)
            rows = [(r.id, "on" if r.enabled else "off", r.line) for r in results]
            print(_table(rows, ("patch", "switch", "verdict")))
            for r in results:
                for note in r.notes:
                    print(f"  {r.id}: {note}")
        for err in reg.errors:
            print(f"registry error: {err}")
        print(f"({elapsed:.1f} s)")
    if reg.errors:
        print(f"audit: the registry cannot be read (exit {code}): " + "; ".join(reg.errors), file=sys.stderr)
    return code


def _seconds(text):
    """``--fetch-timeout``: seconds (> 0), or 0 for no limit."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if value < 0 or value != value:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: no limit), got {text!r}")
    return value or None


def cmd_list(args):
    from . import prose, registry
    from .tools.tables import registry_markdown

    reg = registry.load()
    bad = prose.problems(reg.specs.values())  # a patch without its prose (no record), or with it twice
    for problem in bad:
        print(f"registry error: {problem}", file=sys.stderr)
    if args.json:
        json.dump([{k: getattr(s, k) for k in registry.KEYS} | {"env": flags.env_name(s.id)}
                   for s in reg.specs.values()], sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(registry_markdown(reg))
    return 1 if reg.errors or bad else 0


def _main(argv=None):
    parser = argparse.ArgumentParser(prog="omni-patches", description=__doc__)
    parser.add_argument("--version", action="version", version=f"omni-patches {__version__}")
    sub = parser.add_subparsers(dest="command")
    for name, func, text in (
        ("status", cmd_status, "one row per patch: state and reason in this environment"),
        ("doctor", cmd_doctor, "import the targets and run every check without wrapping; non-zero on drift/failure"),
        ("list", cmd_list, "the registry as a markdown table (or --json)"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)
        if name == "status":
            _add_all_processes_arguments(p)
    from .tools.audit import DEFAULT_FETCH_TIMEOUT, DEFAULT_LATEST, EXIT_CODES

    p = sub.add_parser("audit", help="what every patch would do with other versions, read from their wheels "
                                     "without installing them; non-zero if an enabled patch would drift",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="exit codes:\n" + "\n".join(f"  {c}  {text}" for c, text in EXIT_CODES.items()))
    p.add_argument("specs", nargs="*", metavar="DIST==VERSION",
                   help="e.g. vllm-omni==0.30.0 vllm-ascend==0.23.0 (downloaded with pip download --no-deps)")
    p.add_argument("--wheel", action="append", default=[], metavar="PATH", help="a wheel or sdist (repeatable)")
    p.add_argument("--source", action="append", default=[], metavar="DIR",
                   help="unpacked files or a checkout (repeatable); a DIST==VERSION argument names its version")
    p.add_argument("--cache", metavar="DIR", help="download/unpack cache (default "
                                                  "$XDG_CACHE_HOME/omni-patches/audit or ~/.cache/omni-patches/audit; "
                                                  "a temporary one when that cannot be written)")
    p.add_argument("--latest", nargs="*", metavar="DIST", default=None,
                   help="audit the newest release and the newest final of each DIST on pip's configured index "
                        f"(default: {' '.join(DEFAULT_LATEST)}); DIST==VERSION arguments join each block")
    p.add_argument("--fetch-timeout", type=_seconds, default=DEFAULT_FETCH_TIMEOUT, metavar="SECONDS",
                   help=f"give up fetching one distribution (or its release list) after this long (default "
                        f"{DEFAULT_FETCH_TIMEOUT:g}; 0: no limit)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_audit)
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = parser.parse_known_args(argv)
    if not getattr(args, "func", None):
        args, extra = parser.parse_known_args(["status", *argv])
    if args.func is cmd_audit:  # DIST==VERSION may come anywhere, also after --source DIR or --latest
        args.specs += [e for e in extra if "==" in e and not e.startswith("-")]
        if args.latest:
            args.specs += [e for e in args.latest if "==" in e]
            args.latest = [e for e in args.latest if "==" not in e]
        extra = [e for e in extra if e not in args.specs]
    if extra:
        parser.error("unrecognized arguments: " + " ".join(extra))
    return args.func(args)


class _ReaderMayLeave:
    """stdout for ``omni-patches ... | head``: once the reader has left, the rest of the output goes to /dev/null
    (no BrokenPipeError, no traceback) and the command finishes, so its exit code keeps its meaning."""

    def __init__(self, stream):
        self._stream = stream

    def _left(self):
        try:  # the interpreter's final flush must not raise again either (Python docs, "Note on SIGPIPE")
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
        except (OSError, ValueError):
            pass

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._left()
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._left()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def main(argv=None):
    real = sys.stdout
    sys.stdout = _ReaderMayLeave(real)
    try:
        code = _main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # a write that bypassed the guard: still quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), real.fileno())
        return 0
    finally:
        sys.stdout = real


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
