"""``omni-patches status|doctor|list|audit [--json]``: what the shim does (or would do) in this environment."""
import argparse
import dataclasses
import json
import os
import sys
import time

from . import __version__, engine, flags


def _requires(st):
    parts = []
    for dist, spec in st.requires.items():
        have = st.installed.get(dist)
        parts.append(f"{dist}{spec} (installed: {have or 'none'})")
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
    return list(reg.errors), engine.environment_problems(reg)


def cmd_all_processes(args):
    """Records of every process that applied a patch: the state directory, or the Ray cluster with ``--ray``.

    Ghosts (dead processes older than their instance's live ones) are hidden unless ``--all``; ``--prune``
    removes the records of dead processes (state directory, and the cluster's KV entries with ``--ray``).
    """
    from . import proof

    directory = args.state_dir or proof.state_dir()
    use_ray = getattr(args, "ray", None) is not None
    address = proof.ray_address(args.ray or None) if use_ray else None
    cluster = None
    try:
        records = proof.collect(directory)
        if use_ray:
            cluster = proof._Cluster(address)
            records = proof.merge_local(proof.collect_ray(cluster=cluster), records)
    except proof.RayUnavailable as exc:
        print(f"status --ray: {exc}", file=sys.stderr)
        return 2
    where = f"Ray cluster {cluster.address} (+ this host's {directory})" if use_ray else directory
    if getattr(args, "prune", False):
        removed = proof.prune(directory)
        if use_ray:
            removed += proof.prune_ray(records, cluster=cluster)
        if args.json:
            json.dump({"omni_patches": __version__, "mode": "status --prune", "state_dir": directory,
                       "ray": cluster.address if use_ray else None, "removed": removed}, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            print(f"removed {len(removed)} record(s) of dead processes from {where}")
            for item in removed:
                print(f"  {item}")
        return 0
    shown = proof.visible(records, show_all=getattr(args, "all", False))
    hidden = len(records) - len(shown)
    if args.json:
        json.dump({"omni_patches": __version__, "mode": "status --all-processes", "state_dir": directory,
                   "ray": cluster.address if use_ray else None, "hidden": hidden, "processes": shown},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0 if shown else 1
    if not shown:
        print(f"no process has recorded an applied patch in {where} (is OMNI_PATCHES=1 set in the serving "
              "processes, and OMNI_PATCHES_STATE_DIR the same here?)" +
              (f"; {hidden} record(s) of dead processes hidden (--all shows them)" if hidden else ""))
        return 1
    ids = []
    for r in shown:
        ids.extend(i for i in r.get("patches", {}) if i not in ids)
    head = ("node", "node id", "pid", "rank", "role", "instance") if use_ray else ("pid", "group", "rank", "role",
                                                                                 "instance")
    rows = []
    for r in shown:
        if "error" in r:
            name = os.path.basename(r["file"]) if "file" in r else r.get("key")
            rows.append((name, *["-"] * (len(head) - 1), "unreadable", r["error"], *["-"] * len(ids)))
            continue
        rank = r.get("rank") if r.get("rank") is not None else "-"
        common = (r.get("pid"), rank, r.get("role"), r.get("instance") or "-")
        if use_ray:
            node_id = ((r.get("ray") or {}).get("node_id") or "-")[:8]
            node = r.get("node_ip") or ("this host" if r.get("source") == "local" else "-")
            first = (node, node_id, *common)
        else:
            first = (r.get("pid"), r.get("pgid"), *common[1:])
        patches = r.get("patches", {})
        rows.append((*first, r["status"], time.strftime("%H:%M:%S", time.localtime(r.get("updated", 0))),
                     *[patches.get(i, {}).get("state", "-") for i in ids]))
    print(f"processes recorded in {where}")
    print(_table(rows, (*head, "process", "recorded", *ids)))
    gone = sum(1 for r in shown if r.get("status") == "gone")
    if gone:
        print(f"{gone} record(s) of processes that are gone (killed before they could clean up; "
              "`omni-patches status --prune` removes them)")
    if hidden:
        print(f"{hidden} record(s) of dead processes older than their instance's live ones hidden (--all shows them)")
    return 0


class _ImpliesAllProcesses(argparse.Action):
    """``--ray``, ``--all`` and ``--prune`` are about every process: they imply ``--all-processes``."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.all_processes = True
        setattr(namespace, self.dest, True if self.nargs == 0 else (values or ""))


def _add_all_processes_arguments(p):
    p.add_argument("--all-processes", action="store_true",
                   help="every process of the serving instance that applied a patch (node, pid, rank, role, "
                        "instance, states), read from the state directory; dead ones are marked gone")
    p.add_argument("--state-dir", metavar="DIR",
                   help="state directory to read (default: $OMNI_PATCHES_STATE_DIR, else the per-user one)")
    p.add_argument("--ray", nargs="?", metavar="ADDRESS", action=_ImpliesAllProcesses, default=None,
                   help="read every node's records from the Ray cluster's KV store (default address: "
                        "$RAY_ADDRESS, else auto); needs ray installed where this runs")
    p.add_argument("--all", nargs=0, action=_ImpliesAllProcesses, default=False,
                   help="with --all-processes: also show dead processes older than their instance's live ones")
    p.add_argument("--prune", nargs=0, action=_ImpliesAllProcesses, default=False,
                   help="remove the records of dead processes (state directory; with --ray also the cluster's)")


def cmd_status(args):
    if getattr(args, "all_processes", False):
        return cmd_all_processes(args)
    records = engine.status()
    errors, env_problems = _environment()
    header = None
    if not engine.is_active():
        header = (f"omni-patches is {engine.inactive_reason()}.\nEvery state is 'inactive'; the reasons say what a "
                  f"process started with {flags.MASTER}=1 in this environment would do.")
        if not args.json:  # the header says why once; each row keeps the prediction
            records = [dataclasses.replace(r, reason=r.reason.partition(engine.INACTIVE_SEP)[2] or r.reason)
                       for r in records]
    _print(records, args.json, "status", errors, env_problems, header)
    return 1 if any(r.state == "failed" for r in records) else 0


def cmd_doctor(args):
    if not args.json:
        print("doctor: importing every target and dry-running each patch's checks (nothing is wrapped)")
    records = engine.doctor()
    errors, env_problems = _environment()
    _print(records, args.json, "doctor", errors, env_problems)
    bad = [r for r in records if r.enabled and (r.state in ("drifted", "failed") or r.warnings)]
    return 1 if bad or errors else 0


def cmd_audit(args):
    import time
    import warnings

    from . import audit, gates

    started = time.perf_counter()
    blocks = []
    try:
        with warnings.catch_warnings():  # third-party noise (an import's own warnings) is not the audit's to show
            warnings.simplefilter("ignore")
            for specs in audit.plan(args.specs):
                dists = audit.obtain(specs, args.wheel, args.source, args.cache)
                blocks.append((dists, audit.run(dists)))
    except audit.AuditError as exc:
        if args.json:
            json.dump({"omni_patches": __version__, "mode": "audit", "error": str(exc)}, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            print(f"audit: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - started
    assumed, _ = gates.assumed_versions()
    assumed_note = (f"versions assumed for the gates ({gates.ASSUME}): " +
                    ", ".join(f"{d}={v}" for d, v in assumed.items())) if assumed else None
    if args.json:
        audits = [{"distributions": [d.to_dict() for d in dists.values()],
                   "patches": [r.to_dict() for r in results]} for dists, results in blocks]
        doc = {"omni_patches": __version__, "mode": "audit", "seconds": round(elapsed, 3), "assumed": assumed,
               "audits": audits}
        if len(audits) == 1:
            doc.update(audits[0])
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for n, (dists, results) in enumerate(blocks):
            if n:
                print()
            given = "; ".join(f"{d.name} {d.version} ({d.origin})" for d in dists.values()) or "nothing"
            print(f"audit of {given} -- read statically, nothing installed or imported")
            if assumed_note:
                print(assumed_note)
            rows = [(r.id, "on" if r.enabled else "off", r.line) for r in results]
            print(_table(rows, ("patch", "switch", "verdict")))
            for r in results:
                for note in r.notes:
                    print(f"  {r.id}: {note}")
        print(f"({elapsed:.1f} s)")
    return max(audit.exit_code(results) for _, results in blocks)


def registry_markdown(reg=None):
    """The README's patch table, generated from the registry (tests keep the README in sync)."""
    from . import registry

    reg = reg or registry.load([registry.builtin_path()])
    rows = ["| patch | switch (default) | applies to | fixed upstream in | what it fixes |",
            "|---|---|---|---|---|"]
    for s in reg.specs.values():
        applies = "<br>".join(f"`{d} {v}`" for d, v in s.requires.items())
        fixed = "<br>".join(f"`{d} {v}`" for d, v in s.fixed_in.items()) or "—"
        default = "on" if s.default else "off"
        rows.append(f"| `{s.id}` | `{flags.env_name(s.id)}` ({default}) | {applies} | {fixed} | {s.summary} |")
    return "\n".join(rows)


def cmd_list(args):
    from . import registry

    reg = registry.load()
    if args.json:
        json.dump([{k: getattr(s, k) for k in registry.KEYS} | {"env": flags.env_name(s.id)}
                   for s in reg.specs.values()], sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(registry_markdown(reg))
    return 1 if reg.errors else 0


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
    p = sub.add_parser("audit", help="what every patch would do with other versions, read from their wheels "
                                     "without installing them; non-zero if an enabled patch would drift")
    p.add_argument("specs", nargs="*", metavar="DIST==VERSION",
                   help="e.g. vllm-omni==0.30.0 vllm-ascend==0.23.0 (downloaded with pip download --no-deps)")
    p.add_argument("--wheel", action="append", default=[], metavar="PATH", help="a wheel or sdist (repeatable)")
    p.add_argument("--source", action="append", default=[], metavar="DIR",
                   help="unpacked files or a checkout (repeatable); a DIST==VERSION argument names its version")
    p.add_argument("--cache", metavar="DIR", help="download/unpack cache (default "
                                                  "$XDG_CACHE_HOME/omni-patches/audit or ~/.cache/omni-patches/audit)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_audit)
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = parser.parse_known_args(argv)
    if not getattr(args, "func", None):
        args, extra = parser.parse_known_args(["status", *argv])
    if args.func is cmd_audit:  # DIST==VERSION may come anywhere, also after --source DIR
        args.specs += [e for e in extra if "==" in e and not e.startswith("-")]
        extra = [e for e in extra if e not in args.specs]
    if extra:
        parser.error("unrecognized arguments: " + " ".join(extra))
    return args.func(args)


def main(argv=None):
    try:
        code = _main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # `omni-patches ... | head`: the reader left. Point stdout at /dev/null so the interpreter's final
        # flush does not raise again, and exit without a traceback (Python docs, "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
