"""Rank-side tensors live on the rank's device (docs/ARCHITECTURE.md), read statically.

With one GPU per rank the backend is NCCL, and NCCL refuses CPU tensors: a tensor factory
called without ``device=`` makes a CPU tensor, which works on a laptop (gloo) and fails on a
DGX. This test parses, with :mod:`ast` (nothing is run), the package (``mpu_lab/**/*.py``), the
``launch/*.py`` scripts and every notebook's code cells (``labs/*.ipynb``,
``Start_Here.ipynb``; each cell parsed after dropping the IPython lines that start with ``%``
or ``!``), and reports:

* **a tensor factory without ``device=``**: ``torch.<f>(...)`` for ``f`` in :data:`FACTORIES`
  (also through ``import torch as t`` or ``from torch import zeros``). The ``*_like`` functions
  inherit their input's device and are fine. A call that passes ``**kwargs`` is trusted (the
  keyword may be in there).
* **``.cuda(...)``**: always. ``.cuda()`` picks the current CUDA device, which is not there on
  a CPU machine; write ``.to(device)`` with the rank's device.
* **``.to()`` that moves nothing**: a ``.to`` call with neither an argument that can name a
  device nor ``device=`` (``.to()``, ``.to(non_blocking=True)``, ``.to(memory_format=...)``)
  is a device move whose device was left out.

How a dtype-only ``.to`` is told from a device move: the only positional argument of a
dtype-only ``.to`` is a dtype, recognised by how it is written: an attribute of ``torch``
that *is* a ``torch.dtype`` (``torch.float32``, ``torch.bfloat16``, ... checked against torch
itself, so ``torch.device`` is not mistaken for one), or a name or attribute spelled
``dtype`` / ``*_dtype`` (``dtype``, ``x.dtype``, ``self.params_dtype``), or ``dtype=`` alone.
Such a call keeps the tensor where it is, so it is not reported. Every other ``.to(arg)``
(``.to(device)``, ``.to(other_tensor)``, ``.to(x.device)``) names its device and is fine.

The allow-list, for tensors that are on the CPU on purpose, has two forms:

* a ``# cpu: <reason>`` comment on any line of the call (the reason is required): for a
  single deliberate CPU tensor, e.g. a host staging buffer in :mod:`mpu_lab.core.comm`;
* :data:`ALLOWED`: ``(file, function)`` -> reason, for a whole function (the innermost
  enclosing ``def``/``class`` qualified name, ``"*"`` for the whole file): the CPU master
  weights of the layers, CPU-only reference code of the lab kit, pure maths.

``tests/`` is not scanned: the tests build dense CPU twins on purpose.
"""
from __future__ import annotations

import ast
import json
import pathlib
import re
import time
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent

FACTORIES = frozenset({
    "zeros", "ones", "full", "empty", "rand", "randn", "randint", "randperm", "arange",
    "linspace", "logspace", "eye", "tensor", "as_tensor", "empty_strided", "tril_indices",
    "triu_indices",
})
DTYPE_NAMES = frozenset(n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype))
CPU_COMMENT = re.compile(r"#\s*cpu:\s*\S")

# (path relative to the repository, qualified function name or "*") -> why it is on the CPU
_CHECKPOINT = ("checkpoint tensors go through host memory: DCP runs over a CPU device mesh "
               "(checkpointing/state_dict.py), the read buffers are copied to each parameter's "
               "device, and AdamW keeps its 'step' on the CPU (not fused/capturable)")
ALLOWED: Dict[Tuple[str, str], str] = {
    ("mpu_lab/training/checkpointing/save_load.py", "save_checkpoint"): _CHECKPOINT,
    ("mpu_lab/training/checkpointing/save_load.py", "load_checkpoint"): _CHECKPOINT,
    ("mpu_lab/training/checkpointing/save_load.py", "_Reads"): _CHECKPOINT,
    ("mpu_lab/training/checkpointing/save_load.py", "_want_optimizer"): _CHECKPOINT,
    ("mpu_lab/training/checkpointing/save_load.py", "_want_rng"): _CHECKPOINT,
    ("mpu_lab/training/checkpointing/consolidate.py", "consolidate"):
        "an offline, single-process tool (no torch.distributed): an ordinary CPU state_dict",
    ("mpu_lab/training/datasets.py", "_sample"):
        "dataset samples live in host memory, like a DataLoader's; get_batch / broadcast_data "
        "move each micro-batch to the rank's device",
    ("mpu_lab/perf/pipeline_toy.py", "ToyModel.__init__"):
        "the single-process twin is drawn on the CPU from a seeded generator (the same numbers "
        "on any device); callers move it with .to(device)",
    ("mpu_lab/perf/pipeline_toy.py", "ToyModelChunk.__init__"):
        "a chunk is filled from the CPU ToyModel; build_toy_model_chunks moves it to `device`",
    ("mpu_lab/perf/pipeline_toy.py", "toy_batches"):
        "tokens drawn from a seeded CPU generator (the same on any device), moved to `device` "
        "at once",
    ("mpu_lab/perf/calibrate.py", "calibrate_matmul"):
        "times this machine's CPU for the cost model's CPU cluster (cpu_cluster)",
    ("mpu_lab/perf/calibrate.py", "calibrate_memory_bandwidth"):
        "times this machine's CPU for the cost model's CPU cluster (cpu_cluster)",
    ("mpu_lab/labkit/column_parallel/viz.py", "shard_shapes"):
        "a notebook-side picture helper: reads only the shapes of torch.split's pieces",
}


class Finding(NamedTuple):
    where: str      # "mpu_lab/core/comm.py:12" or "labs/06_column_parallel.ipynb cell 7 line 3"
    scope: str      # qualified function name ("" at module level)
    call: str       # the call's source text

    def __str__(self):
        return f"{self.where} ({self.scope or 'module level'}): {self.call}"


# --------------------------------------------------------------------------- the scanner
def _is_dtype_expr(node: ast.AST, torch_names: set) -> bool:
    if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id in torch_names:
            return node.attr in DTYPE_NAMES
        return node.attr == "dtype" or node.attr.endswith("_dtype")
    if isinstance(node, ast.Name):
        return node.id == "dtype" or node.id.endswith("_dtype") or node.id in DTYPE_NAMES
    return False


def _is_cpu_literal(node: ast.AST, torch_names: set) -> bool:
    """``"cpu"`` or ``torch.device("cpu")`` written out."""
    if isinstance(node, ast.Constant):
        return node.value == "cpu"
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "device" and isinstance(node.func.value, ast.Name)
            and node.func.value.id in torch_names and len(node.args) == 1
            and _is_cpu_literal(node.args[0], torch_names))


def _problem(call: ast.Call, torch_names: set, factory_names: Dict[str, str]) -> Optional[str]:
    """Why ``call`` is reported, or None."""
    keywords = {k.arg for k in call.keywords}
    if None in keywords:                       # **kwargs: trusted
        return None
    func = call.func
    factory = None
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
            and func.value.id in torch_names and func.attr in FACTORIES:
        factory = func.attr
    elif isinstance(func, ast.Name) and func.id in factory_names:
        factory = factory_names[func.id]
    if factory is not None:
        if "device" not in keywords:
            return f"torch.{factory} without device="
        device = next(k.value for k in call.keywords if k.arg == "device")
        if _is_cpu_literal(device, torch_names):
            return f"torch.{factory} on the CPU on purpose? say why"
        return None
    if isinstance(func, ast.Attribute) and func.attr == "cuda":
        if isinstance(func.value, ast.Name) and func.value.id in torch_names:
            return None                        # torch.cuda (the module), not a method call
        return ".cuda(): use .to(device) with the rank's device"
    if isinstance(func, ast.Attribute) and func.attr == "to":
        if _to_kind(call, torch_names) == "nothing":
            return ".to() without a device"
    return None


def _to_kind(call: ast.Call, torch_names: set) -> str:
    """What a ``.to`` call does: ``"device"`` (names a device, or a tensor to follow),
    ``"dtype"`` (dtype only: the tensor stays where it is) or ``"nothing"``."""
    keywords = {k.arg for k in call.keywords}
    if "device" in keywords or "other" in keywords:
        return "device"
    if any(not _is_dtype_expr(a, torch_names) for a in call.args):
        return "device"       # .to(device), .to(x.device), .to("cpu"), .to(other_tensor)
    if call.args or "dtype" in keywords:
        return "dtype"
    return "nothing"


def _torch_aliases(tree: ast.AST) -> Tuple[set, Dict[str, str]]:
    torch_names, factory_names = {"torch"}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch":
                    torch_names.add(a.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            for a in node.names:
                if a.name in FACTORIES:
                    factory_names[a.asname or a.name] = a.name
    return torch_names, factory_names


def scan_source(source: str, rel: str, where=None, allowed=None) -> List[Finding]:
    """Findings of one file's (or one cell's) source. ``where(lineno)`` names a line."""
    allowed = ALLOWED if allowed is None else allowed
    where = where or (lambda n: f"{rel}:{n}")
    tree = ast.parse(source)
    lines = source.splitlines()
    torch_names, factory_names = _torch_aliases(tree)
    found: List[Finding] = []

    def visit(node: ast.AST, scope: List[str]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = scope + [node.name]
        if isinstance(node, ast.Call):
            why = _problem(node, torch_names, factory_names)
            qual = ".".join(scope)
            if why and not _allowed(rel, scope, allowed) and not any(
                    CPU_COMMENT.search(lines[i - 1])
                    for i in range(node.lineno, (node.end_lineno or node.lineno) + 1)):
                found.append(Finding(where(node.lineno), qual,
                                     f"{ast.get_source_segment(source, node)}  <- {why}"))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, [])
    return found


def _allowed(rel: str, scope: List[str], allowed) -> bool:
    if (rel, "*") in allowed:
        return True
    return any((rel, ".".join(scope[:i])) in allowed for i in range(1, len(scope) + 1))


def cell_source(cell: dict) -> str:
    """A code cell's source with the IPython magic / shell lines blanked (numbers kept)."""
    text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in text.splitlines())


def scan_notebook(path: pathlib.Path, rel: str, allowed=None) -> List[Finding]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    found = []
    code_cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for i, cell in enumerate(code_cells):
        found += scan_source(cell_source(cell), rel,
                             where=lambda n, i=i: f"{rel} code cell {i} line {n}",
                             allowed=allowed)
    return found


def scanned_files() -> Iterable[pathlib.Path]:
    yield from sorted((ROOT / "mpu_lab").rglob("*.py"))
    yield from sorted((ROOT / "launch").glob("*.py"))
    yield from sorted((ROOT / "labs").glob("*.ipynb"))
    yield ROOT / "Start_Here.ipynb"


def scan_repository(allowed=None) -> List[Finding]:
    found = []
    for path in scanned_files():
        rel = path.relative_to(ROOT).as_posix()
        if path.suffix == ".ipynb":
            found += scan_notebook(path, rel, allowed)
        else:
            found += scan_source(path.read_text(encoding="utf-8"), rel, allowed=allowed)
    return found


# --------------------------------------------------------------------------- the tests
def test_every_rank_side_tensor_names_its_device():
    t0 = time.perf_counter()
    found = scan_repository()
    elapsed = time.perf_counter() - t0
    assert not found, ("tensors made without the rank's device (add device=..., or, if the CPU "
                       "is meant, a '# cpu: <reason>' comment):\n  "
                       + "\n  ".join(map(str, found)))
    # a figure, not a timed assertion (it took 3.4 s on a loaded 2-core machine, 0.5 s idle)
    print(f"\n[device placement] scanned the repository in {elapsed:.2f} s")


def test_allow_list_entries_still_exist():
    """Every ``ALLOWED`` entry names a file and a function that are still there."""
    for (rel, qual), reason in ALLOWED.items():
        assert reason.strip(), (rel, qual)
        path = ROOT / rel
        assert path.is_file(), rel
        if qual == "*":
            continue
        names = set()

        def visit(node, scope):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                scope = scope + [node.name]
                names.add(".".join(scope))
            for child in ast.iter_child_nodes(node):
                visit(child, scope)

        visit(ast.parse(path.read_text(encoding="utf-8")), [])
        assert qual in names, f"{rel}: no function {qual} (stale ALLOWED entry)"


def _tiny_notebook(tmp_path: pathlib.Path, source: str) -> pathlib.Path:
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": ["torch.ones(3)"]},
                    {"cell_type": "code", "execution_count": None, "metadata": {},
                     "outputs": [], "source": source.splitlines(True)}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "tiny.ipynb"
    path.write_text(json.dumps(nb), encoding="utf-8")
    return path


def test_scanner_catches_a_cpu_tensor_in_a_notebook_cell(tmp_path):
    path = _tiny_notebook(tmp_path, "%%ranks\nx = torch.full((2,), 1.0)\nprint(x)\n")
    found = scan_notebook(path, "tiny.ipynb")
    assert len(found) == 1 and "torch.full((2,), 1.0)" in found[0].call, found
    assert found[0].where == "tiny.ipynb code cell 0 line 2"


def test_scanner_passes_a_cell_with_the_device(tmp_path):
    path = _tiny_notebook(tmp_path, "%%ranks\nx = torch.full((2,), 1.0, device=device)\n"
                                    "!echo hi\ny = torch.zeros_like(x).to(torch.float64)\n")
    assert scan_notebook(path, "tiny.ipynb") == []


@pytest.mark.parametrize("code, reported", [
    ("torch.zeros(3)", True),
    ("torch.zeros(3, device=device)", False),
    ("torch.zeros(3, **kw)", False),
    ("import torch as t\nt.arange(4)", True),
    ("from torch import tensor\ntensor([1.0])", True),
    ("torch.ones_like(x)", False),
    ("torch.zeros(3, device='cpu')", True),             # a CPU tensor on purpose says why
    ("torch.zeros(3, device=torch.device('cpu'))", True),
    ("torch.zeros(3, device='cpu')  # cpu: host staging", False),
    ("torch.tensor([1.0])  # cpu: pure maths", False),
    ("torch.tensor(\n  [1.0],  # cpu: pure maths\n)", False),
    ("torch.tensor([1.0])  # cpu:", True),              # a reason is required
    ("x.cuda()", True),
    ("torch.cuda.is_available()", False),
    ("x.to(torch.float32)", False),
    ("x.to(dtype=torch.float32)", False),
    ("x.to(y.dtype)", False),
    ("x.to(self.params_dtype)", False),
    ("x.to(device)", False),
    ("x.to(y)", False),
    ("x.to(device=d, dtype=torch.half)", False),
    ("x.to()", True),
    ("x.to(non_blocking=True)", True),
])
def test_scanner_rules(code, reported):
    assert bool(scan_source(code, "snippet.py", allowed={})) is reported


def test_allow_list_by_function():
    code = "def master():\n    return torch.randn(4, 4)\ndef shard():\n    return torch.randn(2)\n"
    found = scan_source(code, "m.py", allowed={("m.py", "master"): "CPU master weight"})
    assert [f.scope for f in found] == ["shard"]


if __name__ == "__main__":
    for finding in scan_repository():
        print(finding)
