"""What is wrong with the ``OMNI_PATCHES*`` variables: logged once at start-up, shown by ``status`` / ``doctor``,
and one error in strict mode."""
import os

from . import flags


def environment_problems(reg, environ=None):
    """What is wrong with the ``OMNI_PATCHES*`` variables of ``environ``, as messages (empty when fine)."""
    from . import log

    environ = os.environ if environ is None else environ
    shown = flags.shown
    problems = []
    raw = environ.get(flags.MASTER)
    if raw is not None and flags.parse(raw) is None:
        problems.append(flags.master_problem(raw))
    for name in ("OMNI_PATCHES_STRICT",):
        if environ.get(name) is not None and flags.parse(environ[name]) is None:
            problems.append(f"{name}={shown(environ[name])} is not an on/off value: treated as off")
    for pid in reg.specs:
        name = flags.env_name(pid)
        if environ.get(name) is not None and flags.parse(environ[name]) is None:
            problems.append(f"{name}={shown(environ[name])} is not an on/off value: {pid} is off")
    for name, close in flags.unknown_names(reg.specs, environ):
        problems.append(f"unknown variable {shown(name)[1:-1] if len(name) > flags.SHOWN else name} ignored" +
                        (f"; did you mean {close}?" if close else ""))
    level = log.level_problem(environ)
    if level:
        problems.append(level)
    kernel = environ.get(KERNEL_VAR)
    if kernel is not None and (kernel or "auto").strip().lower() not in KERNEL_CHOICES:
        # the text lora-cpu-fused-delta logs when it reads the variable: one log line for both
        problems.append(f"{KERNEL_VAR}={shown(kernel)} is not one of {'|'.join(KERNEL_CHOICES)}; using auto")
    state_dir = (environ.get("OMNI_PATCHES_STATE_DIR") or "").strip()
    if state_dir and os.path.exists(state_dir) and not os.path.isdir(state_dir):
        problems.append(f"OMNI_PATCHES_STATE_DIR={shown(state_dir)} is not a directory: no process record is "
                        "written")
    if environ.get("OMNI_PATCHES_ASSUME_VERSION"):
        from . import gates

        assumed, bad = gates.assumed_versions(environ)
        known = {d for spec in reg.specs.values() for d in spec.requires}
        bad = [f"OMNI_PATCHES_ASSUME_VERSION: {b}; ignored" for b in bad]
        bad += [f"OMNI_PATCHES_ASSUME_VERSION names {d}, which no patch gates on; ignored"
                for d in assumed if d not in known]
        problems.extend(bad)
    return problems


# OMNI_PATCHES_LORA_CPU_FUSED_KERNEL (read by lora-cpu-fused-delta at its first load; checked here at start-up so
# that status shows it and strict mode stops on it). tests/test_engine.py keeps these equal to the kernel module's.
KERNEL_VAR = "OMNI_PATCHES_LORA_CPU_FUSED_KERNEL"
KERNEL_CHOICES = ("auto", "addmm", "fp32")
