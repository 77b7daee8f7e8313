"""The GPU acceptance check, ``python -m mpu_lab.labkit.notebooks gpu-check``: every lab at a
machine profile, then the throughput and bandwidth benchmarks, as one table.

1. Each lab runs through papermill (watched: :mod:`~mpu_lab.labkit.notebooks.watchdog`) with
   the profile's parameters and is written under the output folder, never over the committed
   notebooks: pass/fail and seconds.
2. ``launch/bench_gpt_vs_plain.py`` (one process under torchrun): GPT-2 small in bf16 on a
   GPU (a tiny fp32 shape on the CPU): tokens/s and MFU of ``GPTModel`` (TP=1) and
   ``PlainGPT``.
3. ``launch/bench_bandwidth.py`` under torchrun (one rank per GPU; two ranks sharing the GPU,
   or the CPU, where there are fewer than two): the best busbw per collective.

The table is printed and written as markdown to ``DIR/gpu_check.md`` with the device name,
torch version and date, ready to paste into docs/TESTING.md.

On a machine lent for a short while: ``--jobs N`` runs N labs at once (their ranks then share
the GPUs, so a lab's seconds are wall time under that sharing; the benchmarks still run alone,
after the labs), and ``--time-budget S`` starts no lab and no benchmark after S seconds: what
did not start is in the table as "not run", and the table is written all the same.
"""
from __future__ import annotations

import concurrent.futures
import datetime
import pathlib
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from mpu_lab import launcher
from mpu_lab.labkit import REPO_ROOT, profiles
from mpu_lab.labkit.notebooks.regenerate import Outcome, run_notebooks
from mpu_lab.labkit.notebooks.selection import lab_paths, notebook_paths, select
from mpu_lab.labkit.notebooks.watchdog import DEFAULT_STALL_S

PROFILES = profiles.NAMES
DEFAULT_OUTPUT_DIR = REPO_ROOT / "runs" / "gpu_check"     # /runs/ is git-ignored

# Benchmark flags per profile: (bench_gpt_vs_plain.py flags, bench_bandwidth.py flags).
THROUGHPUT_ARGS = {
    "cpu": ["--device", "cpu", "--num-layers", "2", "--hidden-size", "128",
            "--num-attention-heads", "4", "--seq-length", "128", "--micro-batch-size", "2",
            "--vocab-size", "1024", "--rounds", "4", "--steps", "1", "--warmup", "1"],
    "1gpu": ["--preset", "gpt2-small", "--precision", "bf16"],
    "8gpu": ["--preset", "gpt2-small", "--precision", "bf16"],
}
BANDWIDTH_ARGS = {
    "cpu": ["--min-bytes", "4K", "--max-bytes", "1M", "--iters", "5", "--warmup", "2"],
    "1gpu": ["--min-bytes", "1M", "--max-bytes", "64M", "--iters", "10", "--dtype", "bfloat16"],
    "8gpu": ["--min-bytes", "1M", "--max-bytes", "1G", "--iters", "20", "--dtype", "bfloat16"],
}


def profile_params(name: str) -> Tuple[Dict[str, dict], str]:
    """The parameters of machine profile ``name`` and the file they come from: the one place
    that maps a profile to parameters (:func:`mpu_lab.labkit.profiles.load`: the cpu base under
    the profile's own values), plus ``profile: name`` so each lab's parameters cell resolves
    the names it still holds ``None`` from the same profile rather than from ``auto``."""
    params = profiles.load(name)
    params.setdefault("all", {})["profile"] = name
    path = profiles.profile_path(name)
    return params, str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path)


def machine() -> Tuple[int, str, str]:
    """(GPUs seen, device name, torch version)."""
    import torch   # the command needs torch; importing this package must not

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    name = torch.cuda.get_device_name() if gpus else "no GPU (CPU)"
    return gpus, (f"{gpus} x {name}" if gpus > 1 else name), torch.__version__


# --------------------------------------------------------------------------- the benchmarks
def run_throughput(profile: str, timeout_s: float) -> Dict:
    """``bench_gpt_vs_plain.py`` in one process under torchrun: its report."""
    job = launcher.run("bench_gpt_vs_plain.py", THROUGHPUT_ARGS[profile], nproc=1,
                       show="none", timeout_s=timeout_s)
    return job.results[0]


def run_bandwidth(profile: str, gpus: int, timeout_s: float) -> Dict:
    """``bench_bandwidth.py`` under torchrun, one rank per GPU (at least two ranks); two CPU
    ranks at the cpu profile."""
    cpu = profile == "cpu"
    job = launcher.run("bench_bandwidth.py", BANDWIDTH_ARGS[profile],
                       nproc=2 if cpu else max(2, gpus), show="none", timeout_s=timeout_s,
                       env={"MPU_LAB_DEVICE": "cpu"} if cpu else None)
    return job.results[0]


def best_per_collective(rows: Sequence[Dict]) -> Dict[str, Dict]:
    """Per collective, the row with the highest busbw."""
    best: Dict[str, Dict] = {}
    for r in rows:
        if r["op"] not in best or r["busbw"] > best[r["op"]]["busbw"]:
            best[r["op"]] = r
    return best


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


# --------------------------------------------------------------------------- the table
def markdown(header: Dict[str, str], labs: Sequence[Outcome], throughput, bandwidth) -> str:
    """The report: ``throughput`` / ``bandwidth`` are the benchmarks' reports or the text of
    their failure."""
    lines = ["## GPU acceptance check (`python -m mpu_lab.labkit.notebooks gpu-check`)", "",
             " · ".join(f"{k}: {v}" for k, v in header.items()), "",
             "| lab | result | seconds |", "|---|---|---:|"]
    for o in labs:
        result = "pass" if o.ok else f"FAIL: {o.message.replace('|', '/')[:120]}"
        lines.append(f"| {o.name.removesuffix('.ipynb')} | {result} | {o.seconds:.1f} |")
    lines.append("")
    failed = [o for o in labs if not o.ok and not o.message.startswith("not run")]
    if failed:      # the table cuts a message short: a stall's "the kernel was at: ..." with it
        lines += ["Each failure in full:", ""]
        lines += [f"- {o.name.removesuffix('.ipynb')}: {o.message}" for o in failed] + [""]
    if isinstance(throughput, dict):
        s = throughput["shape"]
        lines += [f"| throughput: {s['num_layers']} layers, hidden {s['hidden_size']}, "
                  f"seq {s['seq_length']}, batch {s['micro_batch_size']}, "
                  f"{throughput['precision']} | tokens/s | MFU |", "|---|---:|---:|"]
        mfu = throughput.get("mfu", {})
        for model, tps in throughput["tokens_per_s"].items():
            m = f"{100 * mfu[model]:.1f} %" if model in mfu else "n/a (no GPU)"
            lines.append(f"| {model} | {tps:,.0f} | {m} |")
        lines.append(f"| step-time ratio GPTModel / PlainGPT | "
                     f"{throughput['step_time_ratio']:.3f} | |")
    else:
        lines.append(f"throughput benchmark FAILED: {throughput}")
    lines.append("")
    if isinstance(bandwidth, dict):
        lines += [f"| collective ({bandwidth['world_size']} ranks, {bandwidth['backend']}, "
                  f"{bandwidth['dtype']}) | best busbw GB/s | at size |", "|---|---:|---:|"]
        for op, r in best_per_collective(bandwidth["rows"]).items():
            wrong = f" ({r['wrong']} wrong)" if r["wrong"] else ""
            lines.append(f"| {op} | {r['busbw'] / 1e9:.2f}{wrong} | {_size(r['size_bytes'])} |")
    else:
        lines.append(f"bandwidth benchmark FAILED: {bandwidth}")
    return "\n".join(lines) + "\n"


def _failure(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def gpu_check(output_dir=None, profile: str = "auto", only: Optional[List[str]] = None,
              stall_s: float = DEFAULT_STALL_S, cell_timeout: Optional[int] = 900,
              bench_timeout: float = 600.0, kernel: str = "python3", out=sys.stdout,
              jobs: int = 1, time_budget_s: Optional[float] = None) -> int:
    """Run the labs and the benchmarks at ``profile``; print and write the table. Returns the
    exit code: 0 when every lab passed and both benchmarks ran. ``jobs``: labs run at once;
    ``time_budget_s``: nothing starts after this many seconds (see the module's docstring)."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise SystemExit(f"--jobs must be a whole number >= 1, got {jobs!r}")
    if time_budget_s is not None and not time_budget_s > 0:
        raise SystemExit(f"--time-budget must be a number of seconds > 0, got {time_budget_s!r}")
    output_dir = pathlib.Path(output_dir or DEFAULT_OUTPUT_DIR).resolve()
    if output_dir == REPO_ROOT.resolve():
        raise SystemExit("--output-dir must not be the repository: the committed notebooks "
                         "are never overwritten by gpu-check")
    if profile not in ("auto",) + PROFILES:
        raise SystemExit(f"--profile must be auto or one of {', '.join(PROFILES)}")
    gpus, device, torch_version = machine()
    chosen = profiles.profile_for(gpus) if profile == "auto" else profile
    if not gpus:
        print(f"no GPU on this machine: running at profile {chosen}", file=out, flush=True)
    params, shown = profile_params(chosen)
    print(f"profile {chosen} ({shown}); {device}; torch {torch_version}; writing under "
          f"{output_dir}", file=out, flush=True)

    started = time.monotonic()
    not_run = f"not run: past --time-budget {time_budget_s:g} s" if time_budget_s else ""

    def in_budget() -> bool:
        return time_budget_s is None or time.monotonic() - started < time_budget_s

    def one_lab(path: pathlib.Path) -> Outcome:
        if not in_budget():
            return Outcome(path.name, False, 0.0, not_run)
        return run_notebooks([path], params, output_dir=output_dir, kernel=kernel,
                             timeout_s=cell_timeout, stall_s=stall_s, out=out,
                             known=notebook_paths())[0]

    labs = select(lab_paths(), only)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        outcomes = list(pool.map(one_lab, labs))     # in the labs' order, whatever finished first
    throughput = bandwidth = not_run
    if in_budget():
        print("benchmark: bench_gpt_vs_plain.py ...", file=out, flush=True)
        try:
            throughput = run_throughput(chosen, bench_timeout)
        except Exception as exc:  # LaunchError, LaunchTimeout: reported in the table
            throughput = _failure(exc)
    if in_budget():
        print("benchmark: bench_bandwidth.py ...", file=out, flush=True)
        try:
            bandwidth = run_bandwidth(chosen, gpus, bench_timeout)
        except Exception as exc:  # as above
            bandwidth = _failure(exc)

    header = {"device": device, "torch": torch_version,
              "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
              "profile": f"{chosen} ({shown})"}
    if jobs > 1:
        header["labs at once"] = f"{jobs} (seconds are wall time while sharing)"
    table = markdown(header, outcomes, throughput, bandwidth)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "gpu_check.md").write_text(table)
    print("\n" + table, file=out, flush=True)
    print(f"written: {output_dir / 'gpu_check.md'}", file=out, flush=True)
    ok = all(o.ok for o in outcomes) and isinstance(throughput, dict) and \
        isinstance(bandwidth, dict)
    return 0 if ok else 1
