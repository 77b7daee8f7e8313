"""Machine profiles: the labs' machine-dependent parameters for a laptop CPU, one GPU shared by
N ranks, or an 8-GPU box, so a learner on a GPU runs GPU-sized jobs without editing a cell.

A profile is a YAML file in ``labs/profiles/`` written like an instructor's parameters file
(``all:`` for every lab, then a section per lab; see
:mod:`mpu_lab.labkit.notebooks.selection`):

* ``cpu.yaml`` — the labs' committed defaults: on a CPU nothing changes;
* ``1gpu.yaml`` — one GPU shared by the ranks (gloo, host staging), bf16 (fp16 where the GPU
  has no bf16), GPT-2 small's shape for labs 14 and 15;
* ``8gpu.yaml`` — one GPU per rank over NCCL (a DGX), the lecture-sized GPT.

``cpu.yaml`` is the base: another profile lists only what differs from it.

In a lab, the ``parameters`` cell holds ``profile = "auto"`` and writes the machine-dependent
names ``= None``; the next cell runs::

    globals().update(profiles.resolve(profile, "14_train_gpt", globals()))

which fills the names still ``None`` from the profile (values that papermill injected, or that
the learner typed, win) and prints one line. ``world_size`` and ``backend`` keep their literal
CPU defaults in the cell (the notebooks' structure test holds them CPU-safe); the profile
replaces them while they still hold the ``cpu`` profile's value.
"""
from __future__ import annotations

import os
import pathlib
import sys
import textwrap
from typing import Dict, Mapping, Optional, Tuple

from mpu_lab.labkit import REPO_ROOT
from mpu_lab.labkit.notebooks import stopwatch
from mpu_lab.labkit.notebooks.selection import load_params, matches

PROFILE_DIR = REPO_ROOT / "labs" / "profiles"
NAMES: Tuple[str, ...] = ("cpu", "1gpu", "8gpu")
BASE = "cpu"
# Kept literal in the parameters cells; replaced while they equal the cpu profile's value.
LITERAL_DEFAULTS = ("world_size", "backend")


class Detected(str):
    """A profile name (``"cpu"``, ``"1gpu"``, ``"8gpu"``) that also says what it saw:
    ``.gpus`` (GPUs counted) and ``.seen`` (one phrase)."""
    gpus: int
    seen: str

    def __new__(cls, name: str, gpus: int, seen: str):
        obj = super().__new__(cls, name)
        obj.gpus, obj.seen = gpus, seen
        return obj


def profile_for(gpus: int) -> str:
    """The profile ``auto`` picks for ``gpus`` GPUs: >= 8 -> 8gpu, 1..7 -> 1gpu, else cpu."""
    return "8gpu" if gpus >= 8 else "1gpu" if gpus >= 1 else "cpu"


def detect(device_count: Optional[int] = None) -> Detected:
    """The profile for this machine, from ``torch.cuda.device_count()`` (or ``device_count``
    given, for tests). ``MPU_LAB_DEVICE=cpu`` keeps the ranks on the CPU: profile cpu."""
    if os.environ.get("MPU_LAB_DEVICE") == "cpu":
        return Detected("cpu", 0, "MPU_LAB_DEVICE=cpu")
    if device_count is None:
        import torch  # heavy; only when asked about this machine

        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Detected(profile_for(device_count), device_count,
                    f"torch.cuda.device_count() = {device_count}")


def profile_path(name_or_path) -> pathlib.Path:
    """The YAML file of a profile name (``cpu``, ``1gpu``, ``8gpu``) or a path to one."""
    text = str(name_or_path)
    if text in NAMES:
        return PROFILE_DIR / f"{text}.yaml"
    path = pathlib.Path(text).expanduser()
    if text.endswith((".yaml", ".yml")) or path.is_file():
        if not path.is_file():
            raise ValueError(f"profile file {text!r} does not exist")
        return path
    raise ValueError(f"unknown profile {text!r}: use \"auto\", one of {', '.join(NAMES)} "
                     f"(labs/profiles/<name>.yaml), or the path to a YAML file")


def load(name_or_path) -> Dict[str, dict]:
    """A profile's sections (``{"all": {...}, "14_train_gpt": {...}}``), ``cpu.yaml``'s values
    under the profile's own: every profile names every machine-dependent parameter."""
    path = profile_path(name_or_path)
    base = load_params(PROFILE_DIR / f"{BASE}.yaml")
    own = load_params(path)
    merged = {section: dict(values) for section, values in base.items()}
    # the profile's `all` beats the base's per-notebook values too (8gpu's world_size: 8 over
    # cpu's 14_train_gpt: world_size: 4); then its own sections
    for values in merged.values():
        values.update({k: v for k, v in (own.get("all") or {}).items() if k in values})
    for section, values in own.items():
        merged.setdefault(section, {}).update(values)
    return merged


def values_for(profile: Mapping[str, dict], notebook: str) -> Dict[str, object]:
    """The values a profile gives the notebook called ``notebook`` (stem or number): ``all``,
    then the notebook's own section."""
    path = pathlib.Path(f"{notebook}.ipynb")
    values = dict(profile.get("all") or {})
    for section, own in profile.items():
        if section != "all" and (matches(path, section)
                                 or matches(pathlib.Path(f"{section}.ipynb"), notebook)):
            values.update(own)
    return values


def _dtype_here(dtype: str, gpus: int) -> Tuple[str, str]:
    """bf16 needs a GPU that has it (Ampere and later): fp16 on a T4 or V100."""
    if dtype != "bf16" or gpus == 0:
        return dtype, ""
    import torch  # only on a GPU machine

    if torch.cuda.is_bf16_supported():
        return dtype, ""
    return "fp16", " (bf16 -> fp16: this GPU has no bf16)"


def _show(value) -> str:
    return f"{value:g}" if isinstance(value, float) else repr(value)


def resolve(profile, notebook: str, namespace: Mapping[str, object],
            device_count: Optional[int] = None, out=None) -> Dict[str, object]:
    """The values to put into a notebook's namespace: the profile's value of every name it
    sets that the namespace holds as ``None`` (and of ``world_size``/``backend`` while they hold
    the cpu profile's value). Prints one line: the profile and what it filled.

    ``profile``: ``"auto"`` (:func:`detect`), a name in :data:`NAMES`, or a YAML path.
    """
    out = out or sys.stdout
    found = detect(device_count)
    name = found if profile in (None, "auto") else str(profile)
    why = f" (auto, {found.seen})" if profile in (None, "auto") else ""
    chosen = values_for(load(name), notebook)
    defaults = values_for(load(BASE), notebook)
    filled: Dict[str, object] = {}
    note = ""
    for key, value in chosen.items():
        if key not in namespace:
            continue
        current = namespace[key]
        if current is None or (key in LITERAL_DEFAULTS and current == defaults.get(key)):
            if key == "dtype":
                value, note = _dtype_here(value, found.gpus)
            filled[key] = value
    missing = sorted(k for k, v in namespace.items()
                     if v is None and k in defaults and k not in filled)
    if missing:
        raise ValueError(f"profile {name!r} gives no value for {missing} ({notebook})")
    shown = ", ".join(f"{k}={_show(v)}" for k, v in filled.items())
    line = f"profile {name}{why}: {shown or 'nothing to fill'}{note}"
    print(textwrap.fill(line, width=100, subsequent_indent="  ", break_long_words=False,
                        break_on_hyphens=False), file=out)
    stopwatch.start(notebook, REPO_ROOT / "labs")   # the learner's own time with this lab
    return filled


def describe_choice(device_count: Optional[int] = None) -> str:
    """Start Here's note: what ``auto`` picks on this machine and how to pick another."""
    found = detect(device_count)
    return (f'This machine: {found.seen}, so profile = "auto" picks {found}.\n'
            f"Profiles: {', '.join(NAMES)} (labs/profiles/<name>.yaml). To choose another,\n"
            f'set profile = "1gpu" (or a YAML path) in a lab\'s parameters cell, or run\n'
            f"  python -m mpu_lab.labkit.notebooks regenerate --profile 1gpu "
            f"--output-dir runs/1gpu")
