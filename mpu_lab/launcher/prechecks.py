"""A launch script's pre-check: the pure check of its flags that :func:`mpu_lab.launcher.run`
calls before torchrun starts, so that a configuration that cannot work fails in well under a
second with a ``ValueError`` naming the numbers. A script names its check in a module-level
string, ``PRECHECK = "package.module:function"``, read from the source (the script is not
imported) and resolved by import, so the launcher itself imports no training code."""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import io
import pathlib
import threading
from typing import Any, Callable, Dict, Optional, Sequence

from mpu_lab.launcher.paths import LAUNCH_DIR

# Two launches at once (threads) both read their script's PRECHECK with ast.parse, which in
# CPython 3.11 can fail with "AST constructor recursion depth mismatch" when run concurrently.
_PARSE_LOCK = threading.Lock()
# sys.stdout and sys.stderr are process-wide: two pre-checks redirecting them from two threads
# at once (jobs launched side by side) could restore them in the wrong order and leave the
# notebook's stdout pointing at a dead buffer, so one pre-check runs at a time
_REDIRECT_LOCK = threading.Lock()


def precheck_spec(path) -> Optional[str]:
    """The ``PRECHECK`` string a script declares at module level (``"module:function"``), read
    from its source with :mod:`ast` — the script is not imported — or None."""
    try:
        with _PARSE_LOCK:    # CPython 3.11's parser is not safe in two threads at once
            tree = ast.parse(pathlib.Path(path).read_text(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "PRECHECK" for t in targets):
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                return value.value
            raise ValueError(f"{pathlib.Path(path).name}: PRECHECK must be a string literal "
                             f"'package.module:function', got {ast.dump(value)}")
    return None


def resolve_precheck(spec: str) -> Callable[..., Any]:
    """The function a ``PRECHECK`` string names: ``"package.module:function"``, imported with
    :func:`importlib.import_module` — a plugin-style lookup, so the launcher itself imports no
    training code; each script names the check of its own flags."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"PRECHECK {spec!r} is not of the form 'package.module:function'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def script_prechecks(directory=LAUNCH_DIR) -> Dict[str, Callable[..., Any]]:
    """``{script name: check}`` for the scripts of ``directory`` that declare a ``PRECHECK``;
    each check is resolved when it is called (``check(argv, nproc, cwd=None)``)."""
    out: Dict[str, Callable[..., Any]] = {}
    for path in sorted(pathlib.Path(directory).glob("*.py")):
        spec = precheck_spec(path)
        if spec:
            out[path.name] = functools.partial(_call_precheck, spec)
    return out


def _call_precheck(spec: str, argv: Sequence[str], nproc: int, cwd=None):
    return resolve_precheck(spec)(argv, nproc, cwd=cwd)


def precheck(path: pathlib.Path, args: Sequence[str], nproc: int, cwd=None) -> None:
    """Run the pure flag check that the script ``path`` declares for ``nproc`` ranks.

    Each script owns its pre-check: it declares at module level, e.g.
    ``PRECHECK = "mpu_lab.training.arguments:check_launch_args"``; the launcher reads that
    string from the source (:func:`precheck_spec`, no import of the script), resolves it
    (:func:`resolve_precheck`) and calls it as ``fn(argv, nproc, cwd=cwd)`` in this process,
    before torchrun starts (no ``torch.distributed``), so a configuration that cannot work
    fails in well under a second with a ``ValueError`` naming the numbers. An argparse error
    becomes a ``ValueError`` with argparse's message; ``--help`` is left to the job."""
    spec = precheck_spec(path)
    if spec is None:
        return
    check = resolve_precheck(spec)
    err = io.StringIO()
    try:
        with _REDIRECT_LOCK, contextlib.redirect_stderr(err), \
                contextlib.redirect_stdout(io.StringIO()):
            check([str(a) for a in args], nproc, cwd=cwd)
    except SystemExit as exc:
        if exc.code in (0, None):
            return
        raise ValueError(f"{path.name}: bad arguments {list(map(str, args))}: "
                         f"{err.getvalue().strip().splitlines()[-1] if err.getvalue() else exc}"
                         ) from None
