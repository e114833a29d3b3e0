"""``omni-patches status|doctor|list [--json]``: what the shim does (or would do) in this environment."""
import argparse
import json
import sys

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


def _print(records, as_json, title, errors):
    if as_json:
        json.dump({"omni_patches": __version__, "mode": title, "registry_errors": errors,
                   "patches": [r.to_dict() for r in records]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    rows = [(r.id, r.env, _requires(r), r.state, r.reason) for r in records]
    print(_table(rows, ("patch", "switch", "requires", "state", "reason")))
    for err in errors:
        print(f"registry error: {err}")


def cmd_status(args):
    master = None
    note = None
    if not engine.is_active() and not flags.master_enabled():
        master = True
        note = (f"{flags.MASTER} is not set in this shell: showing what would happen with {flags.MASTER}=1 "
                "(targets are not imported here, so patches that would apply show as pending)")
    records = engine.status(master=master)
    if note and not args.json:
        print(note)
    _print(records, args.json, "status", engine.registry_errors())
    return 1 if any(r.state == "failed" for r in records) else 0


def cmd_doctor(args):
    if not args.json:
        print("doctor: importing every target and dry-running each patch's checks (nothing is wrapped)")
    records = engine.doctor()
    _print(records, args.json, "doctor", engine.registry_errors())
    bad = [r for r in records if r.enabled and r.state in ("drifted", "failed")]
    return 1 if bad else 0


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


def main(argv=None):
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
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        args = parser.parse_args(["status", *(argv or [])])
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
