"""ascend-execute-model-timeout: raise vLLM's execute_model timeout default (300 s) above the HCCL operator timeout (1836 s) on Ascend

Why:         vLLM's multiprocessing executor waits ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (default 300 s) for the
             workers' ``execute_model`` / ``sample_tokens`` replies, while an HCCL collective may legitimately
             wait up to the HCCL operator timeout (1836 s). With DP/TP engines on Ascend the RPC gives up first:
             the engine times out and the communication hangs without logs.
Upstream:    https://github.com/vllm-project/vllm-ascend/pull/13233 (main) and
             https://github.com/vllm-project/vllm-ascend/pull/13232 (cherry-pick to v0.23.0): in
             ``_fix_incompatible_config`` (run by ``NPUPlatform.check_and_update_config``), a value below 1836
             becomes 3000, set as an attribute of ``vllm.envs`` (in-process only).
Affected:    vllm-ascend >=0.9.2rc1,<0.27.1rc1: every release on the index in that range except 0.23.0 and
             0.23.0.post1, which carry the fix (skipped as fixed by feature). The bug is
             fixed upstream in vllm-ascend 0.27.1rc1 (and 0.23.0 on the v0.23 line). vllm-ascend <=0.9.1
             (vLLM 0.8.5-0.9.1) waits a module constant that no environment variable changes: out of reach.
How:         when ``vllm_ascend.platform`` is imported (in every vLLM process on Ascend, before any executor
             exists) and the variable is unset, set it to upstream's 3000 in ``os.environ`` (inherited by the
             engine core and every worker, fork or spawn; copied to Ray actors like every registered ``VLLM_*``
             variable) and, as upstream does, as an attribute of ``vllm.envs``. A value the user set is never
             changed (upstream raises one below 1836 to 3000): below 1836 or not an integer it is kept with a
             warning, once per process. Undo restores both exactly. Details: docs/patches.md.
Remove when: the oldest supported vllm-ascend is 0.27.1rc1 (0.23.0 on the v0.23 line)
"""
import inspect
import os
import sys
import types

#: Its ``[[patch]]`` table in patches.toml (generated from here: python -m omni_patches.tools.tables --write).
TABLE = {
    "default": True,
    "requires": {"vllm-ascend": ">=0.9.2rc1,<0.27.1rc1"},
    "fixed_in": {"vllm-ascend": "0.27.1rc1"},
    "targets": ["vllm_ascend.platform"],
}

NAME = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
DEFAULT = 3000  # what upstream sets
HCCL_TIMEOUT = 1836  # upstream's threshold: the HCCL operator timeout, in seconds
VLLM_DEFAULT = 300
_MISSING = object()


def _codes(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _mentions(func):
    code = getattr(func, "__code__", None)
    if not isinstance(code, types.CodeType):
        return False
    return any(NAME in c.co_names or NAME in c.co_consts for c in _codes(code))


def _own_functions(module):
    """(qualified name, function) of every function and class method defined in ``module``."""
    modname = getattr(module, "__name__", None)
    for obj in list(vars(module).values()):
        if inspect.isfunction(obj) and obj.__module__ == modname:
            yield obj.__qualname__, obj
        elif isinstance(obj, type) and obj.__module__ == modname:
            for attr in list(vars(obj).values()):
                func = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
                if inspect.isfunction(func):
                    yield func.__qualname__, func


def upstream_handler(module):
    """Qualified name of the platform function that handles the variable itself (the upstream fix), or None."""
    for qualname, func in _own_functions(module):
        if _mentions(func):
            return qualname
    return None


def _envs(module):
    """vLLM's env module as the platform module sees it (``envs_vllm``), else the imported ``vllm.envs``."""
    envs = getattr(module, "envs_vllm", None)
    return envs if envs is not None else sys.modules.get("vllm.envs")


def _defines(envs):
    """Whether vLLM defines the variable: True / False, or None when these files cannot tell."""
    table = getattr(envs, "environment_variables", None)
    if isinstance(table, dict):
        return NAME in table
    if not isinstance(envs, types.ModuleType):
        return None
    try:  # a module without the evaluated table (audit skeletons): read the table's keys from its source
        import ast

        tree = ast.parse(inspect.getsource(envs))
    except (OSError, TypeError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "environment_variables" and isinstance(node.value, ast.Dict):
            return any(isinstance(k, ast.Constant) and k.value == NAME for k in node.value.keys)
    return None


def _vllm_default(envs):
    """vLLM's own default for the variable (read with it unset), or None when it cannot be read safely."""
    table = getattr(envs, "environment_variables", None)
    if not isinstance(table, dict) or NAME not in table or NAME in os.environ:
        return None
    try:
        return int(table[NAME]())
    except Exception:  # not ours to judge; the stock code will say so when it reads it
        return None


def parse(raw):
    """The integer vLLM would read from ``raw`` (``int()``, as vllm.envs does), or None."""
    try:
        return int(raw)
    except (TypeError, ValueError):
        return None


def check(ctx):
    handler = upstream_handler(ctx.module)
    if handler is not None:
        ctx.describe(f"{handler} handles {NAME} (upstream fix)")
        ctx.fixed_upstream(f"vllm_ascend.platform.{handler} already raises {NAME}")
    envs = _envs(ctx.module)
    if _defines(envs) is False:
        ctx.drift(f"vllm.envs does not define {NAME}: this vLLM reads its execute_model timeout elsewhere "
                  f"(vLLM before 0.9.2 hard-codes it)")
    default = _vllm_default(envs)
    if default is not None and default >= HCCL_TIMEOUT:
        ctx.describe(f"vLLM's own default for {NAME} is {default} s")
        ctx.fixed_upstream(f"vLLM's own default for {NAME} is already {default} s (>= {HCCL_TIMEOUT})")
    ctx.describe(f"vllm_ascend.platform without an execute_model timeout rule: default {VLLM_DEFAULT} s -> "
                 f"{DEFAULT} s unless {NAME} is set")


def apply(ctx):
    from omni_patches import log

    raw = os.environ.get(NAME)
    if raw is None:
        if ctx.dry_run:
            return
        envs = _envs(ctx.module)
        envs = envs if isinstance(envs, types.ModuleType) else None
        before_attr = vars(envs).get(NAME, _MISSING) if envs is not None else _MISSING
        os.environ[NAME] = str(DEFAULT)
        if envs is not None:
            setattr(envs, NAME, DEFAULT)

        def restore():
            if os.environ.get(NAME) == str(DEFAULT):
                del os.environ[NAME]
            if envs is not None and vars(envs).get(NAME, _MISSING) == DEFAULT:
                if before_attr is _MISSING:
                    delattr(envs, NAME)
                else:
                    setattr(envs, NAME, before_attr)

        ctx.on_undo(restore)
        ctx.describe(f"{NAME} unset: set to {DEFAULT} (this process and its children)")
        log.once(20, ("execute-model-timeout", "set"), "ascend-execute-model-timeout: %s was unset (vLLM default "
                 "%d s, shorter than the HCCL operator timeout %d s): set to %d for this process and its children",
                 NAME, VLLM_DEFAULT, HCCL_TIMEOUT, DEFAULT)
        return
    if raw == str(DEFAULT):
        ctx.describe(f"{NAME}={DEFAULT} already in place (set by this patch in a parent process, or by the user)")
        return
    value = parse(raw)
    if value is not None and value >= HCCL_TIMEOUT:
        ctx.describe(f"{NAME}={raw} set by the user: kept")
        return
    if value is None:
        short, detail = "not an integer", "is not an integer: vLLM will fail to read it"
    else:
        short = f"below the HCCL operator timeout ({HCCL_TIMEOUT} s)"
        detail = (f"is {short}: execute_model may time out while a collective still waits, and the engine hang "
                  f"without logs (vllm-ascend 0.27.1rc1+ raises such a value to {DEFAULT})")
    ctx.describe(f"{NAME}={raw} set by the user: kept, {short}")
    if not ctx.dry_run:
        log.once(30, ("execute-model-timeout", "user", raw), "ascend-execute-model-timeout: %s=%s %s; kept as set",
                 NAME, raw, detail)
