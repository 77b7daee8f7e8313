"""A folder of the learner's modules as the capstone reads it (``--code DIR``): which file
defines which top-level function or class, read from the source without importing it. The
capstone's job (``launch/capstone.py``) imports each piece from the file this names; the lab
kit's survey (``mpu_lab.labkit.capstone.lesson``) shows the same table before the run. Lab 11's
loop stands for the schedule (:data:`LAB_BUILDS`), given the same ``p2p`` (:func:`bound_p2p`) by
its grader and by the capstone."""
from __future__ import annotations

import ast
import functools
import pathlib
from types import SimpleNamespace
from typing import Dict, List

import torch

from mpu_lab.core.pipeline_parallel import p2p_communication as p2p


def defining_files(folder) -> Dict[str, List[str]]:
    """``{name: [file, ...]}``: the modules of ``folder`` (names Python can import; the
    ``NN_topic.py`` scripts are not) that define ``name`` at their top level. A file Python
    cannot parse defines nothing (the capstone's pre-check refuses it by name)."""
    found: Dict[str, List[str]] = {}
    for path in sorted(pathlib.Path(folder).glob("*.py")):
        if not path.stem.isidentifier():
            continue
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                found.setdefault(node.name, []).append(path.name)
    return found


# A piece a lab's build writes under its own name and signature: lab 11's loop,
# ``my_1f1b_loop(stage, num_stages, num_microbatches, forward, backward, p2p)``, is the 1F1B
# schedule without Megatron's arguments; the capstone calls it through an adapter that gives it
# the mirror's forward and backward steps and point-to-point functions.
LAB_BUILDS = {"forward_backward_pipelining_without_interleaving": "my_1f1b_loop"}


def piece_source(defined: Dict[str, List[str]], file: str, name: str):
    """``(file, defining name)`` the capstone takes piece ``name`` from, given
    :func:`defining_files`: the documented ``file`` where it defines the piece, else the first
    file that does; else the same for the lab's build that stands for it (:data:`LAB_BUILDS`);
    None where the folder has neither."""
    for wanted in (name, LAB_BUILDS.get(name)):
        files = defined.get(wanted, []) if wanted else []
        if files:
            return (file if file in files else files[0]), wanted
    return None


def bound_p2p(shape, dtype=torch.float32) -> SimpleNamespace:
    """What lab 11's loop is given as ``p2p``, by its grader and by the capstone alike: the
    mirror's p2p functions with the message shape filled in: ``p2p.recv_forward()``,
    ``p2p.send_forward(output)``, ``p2p.recv_backward()``, ``p2p.send_backward(grad)``,
    ``p2p.send_forward_recv_backward(output)`` and ``p2p.send_backward_recv_forward(grad)``;
    at the ends of the pipeline they do nothing and the receives return None (Megatron)."""
    names = ("recv_forward", "recv_backward", "send_forward", "send_backward",
             "send_forward_recv_backward", "send_backward_recv_forward")
    out = SimpleNamespace()
    for name in names:
        fn = getattr(p2p, name)
        if name.startswith("recv"):
            setattr(out, name, functools.partial(lambda f: f(shape, dtype), fn))
        else:
            setattr(out, name, functools.partial(lambda f, t: f(t, shape, dtype), fn))
    return out
