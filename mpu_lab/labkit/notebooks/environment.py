"""Start_Here's environment check: what the labs will run on (Python, torch, GPUs or CPU ranks,
the backend a job picks, the lab tools installed)."""
from __future__ import annotations

import os
import platform
from typing import Dict


def environment(nranks: int = 8) -> Dict[str, object]:
    """Print (and return) what the labs will run on: Start_Here's environment check."""
    # torch and the mpu_lab modules that load it are imported when the check runs, not when
    # pytest loads this package as its nbval plugin (which would cost every run seconds).
    import torch

    from mpu_lab import launcher  # loads torch: only when the check runs
    from mpu_lab.training import initialize  # likewise

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    forced = os.environ.get("MPU_LAB_BACKEND", "auto")
    backend = initialize.choose_backend(nranks, gpus) if forced == "auto" else forced
    info = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cpu_cores": os.cpu_count(), "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "backend_for_ranks": backend, "ranks": nranks, "max_ranks": launcher.max_ranks(),
    }
    for module in ("ipywidgets", "matplotlib", "papermill", "nbval"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            info[module] = "not installed"
    print(f"Python {info['python']}, torch {info['torch']}, {info['cpu_cores']} CPU cores")
    print(f"GPUs seen: {gpus}" + (f" ({', '.join(info['gpus'])})" if gpus else
                                  " -> ranks are CPU processes"))
    how = ("one GPU per rank" if backend == "nccl" else
           "ranks share the GPU(s)" if gpus else "CPU tensors")
    print(f"a job of {nranks} ranks uses backend {backend} ({how}); this machine starts at most "
          f"{info['max_ranks']} ranks per job")
    print("lab tools: " + ", ".join(f"{m} {info[m]}" for m in ("ipywidgets", "matplotlib",
                                                               "papermill", "nbval")))
    return info

