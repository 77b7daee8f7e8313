"""ZB-H1 against 1F1B on the machine a learner has (``launch/zero_bubble_timing.py``): ``p``
ranks, each pinned to a core of its own (lab 11's rule: no more ranks than cores), the idle
share of each schedule measured, and set against two predictions:

* **unit time** — :func:`mpu_lab.perf.pipeline_schedules.idle_slots` with ``F = B = W = 1``
  (``BW = 2``): the zero-bubble paper's accounting (Qi et al. 2024, §2.3: 1F1B idles
  ``3(p - 1)`` slots per rank, ZB-H1 ``p - 1``);
* **measured time** — the same action lists laid out with each kind's *measured* mean CPU time
  (:func:`~mpu_lab.perf.pipeline_schedules.simulate` with those durations): where ``W`` is
  shorter than ``B`` it fills less of the bubble (the paper's ZB-H1 bubble is
  ``(p - 1)(T_F + T_B - T_W)``, 1F1B's ``(p - 1)(T_F + T_B + T_W)``).

The idle share of a run is ``1 - Σ_ranks CPU time / Σ_ranks wall time`` per iteration, the
median over the iterations (a rank waiting for a message sleeps; a rank that a busy machine
takes off its core also counts as idle, which is why the verdict compares with a tolerance and
says when the machine could not show the gap).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import textwrap
from typing import Dict, List, Optional

from mpu_lab import launcher
from mpu_lab.perf.pipeline_schedules import schedule_actions, simulate

SCHEDULES = ("1F1B", "ZBH1")
REL_TOL = 0.25        # a measured share agrees with a prediction within 25 % of it
GAP_TOL = 0.5         # the gap is shown when the measured one is at least half the predicted


def share_of(actions, duration: Dict[str, float]) -> float:
    """Idle share of a list of actions laid out with ``duration`` per kind."""
    placed = simulate(actions, duration=duration)
    makespan = max(s.end for slots in placed.values() for s in slots)
    busy = sum(s.end - s.start for slots in placed.values() for s in slots)
    return 1 - busy / (len(placed) * makespan)


@dataclasses.dataclass
class Timing:
    """What :func:`measure` found."""

    pp: int
    microbatches: int
    measured: Dict[str, float]            # median idle share per schedule
    per_iteration: Dict[str, List[float]]
    kind_s: Dict[str, float]              # mean CPU seconds of one F, B, W, BW
    cores: List[Optional[int]]
    cores_available: int
    load: float                           # the machine's 1-minute load average after the run

    def unit_share(self, schedule: str) -> float:
        return share_of(schedule_actions(schedule, self.pp, self.microbatches),
                        {"F": 1, "B": 1, "W": 1, "BW": 2})

    def time_share(self, schedule: str) -> float:
        return share_of(schedule_actions(schedule, self.pp, self.microbatches), self.kind_s)

    @property
    def busy_machine(self) -> bool:
        return self.load > self.cores_available

    def report(self, rel_tol: float = REL_TOL, gap_tol: float = GAP_TOL) -> str:
        k = self.kind_s
        pinned = ("each pinned to a core of its own" if all(c is not None for c in self.cores)
                  else "NOT pinned (this system refused)")
        lines = [f"p = {self.pp} ranks {pinned}, m = {self.microbatches}; this machine: "
                 f"{self.cores_available} cores, load average {self.load:.1f}",
                 f"mean CPU time of one action: F {k['F'] * 1e3:.1f} ms, B {k['B'] * 1e3:.1f} ms,"
                 f" W {k['W'] * 1e3:.1f} ms, BW {k['BW'] * 1e3:.1f} ms "
                 f"(W/B = {k['W'] / k['B']:.2f})",
                 "idle share: predicted with unit times, with the measured times, and measured;",
                 f"{'schedule':8}  {'unit time':>9}  {'measured time':>13}  {'measured':>8}  "
                 f"within {rel_tol:.0%} of the measured-time prediction?"]
        for s in SCHEDULES:
            ok = abs(self.measured[s] - self.time_share(s)) <= rel_tol * self.time_share(s)
            lines.append(f"{s:8}  {self.unit_share(s):>9.1%}  {self.time_share(s):>13.1%}  "
                         f"{self.measured[s]:>8.1%}  {'yes' if ok else 'no'}")
        unit_gap = self.unit_share("1F1B") - self.unit_share("ZBH1")
        time_gap = self.time_share("1F1B") - self.time_share("ZBH1")
        gap = self.measured["1F1B"] - self.measured["ZBH1"]
        lines.append(f"gap 1F1B - ZBH1: unit time {unit_gap:.1%}, measured time {time_gap:.1%}, "
                     f"measured {gap:.1%}")
        if gap >= gap_tol * time_gap:
            lines.append(f"Verdict: ZB-H1 idles less than 1F1B here, by at least {gap_tol:.0%} "
                         f"of the measured-time prediction's gap.")
        else:
            lines.append(f"Verdict: this run did NOT show the gap (measured {gap:.1%}, below "
                         f"{gap_tol:.0%} of the predicted {time_gap:.1%})"
                         + (f": the load average {self.load:.1f} is above the "
                            f"{self.cores_available} cores, other processes took the cores"
                            if self.busy_machine else "; run the cell again")
                         + ". The counted idle slots below do not depend on the machine.")
        if time_gap < unit_gap:
            lines.append(f"The measured-time gap is below the unit-time one: W takes "
                         f"{k['W'] / k['B']:.2f} of B's time (B also runs the attention, the "
                         f"norms and the biases; W only the linear weight GEMMs), and W is what "
                         f"fills the bubble.")
        if any(self.measured[s] > (1 + rel_tol) * self.time_share(s) for s in SCHEDULES):
            lines.append("Measured above prediction: the messages, the runtime's own work and a "
                         "rank off its core while it had work count as idle here.")
        return "\n".join(textwrap.fill(line, 100) for line in lines)


def measure(pp: int = 2, microbatches: int = 4, iterations: int = 5,
            env: Optional[Dict[str, str]] = None) -> Timing:
    """Launch ``launch/zero_bubble_timing.py`` on ``pp`` ranks and read what they report. The
    ranks compute on the CPU even where there are GPUs: a rank's CPU time is its busy time only
    there (a GPU rank's thread returns before its kernels end)."""
    if pp < 2:
        raise ValueError(f"a bubble needs at least 2 pipeline ranks, got pp={pp}")
    if microbatches < 1 or iterations < 1:
        raise ValueError(f"microbatches ({microbatches}) and iterations ({iterations}) must "
                         f"be >= 1")
    job = launcher.run("zero_bubble_timing.py", ["--microbatches", str(microbatches),
                                                 "--iterations", str(iterations)],
                       nproc=pp, show="none", env={**(env or {}), "MPU_LAB_DEVICE": "cpu"})
    reports = job.results
    per_iteration, kinds = {}, {}
    for s in SCHEDULES:
        n = len(reports[0]["runs"][s])
        per_iteration[s] = [1 - sum(r["runs"][s][i]["cpu_s"] for r in reports)
                            / sum(r["runs"][s][i]["wall_s"] for r in reports) for i in range(n)]
        for r in reports:
            for it in r["runs"][s]:
                for kind, seconds in it["actions"]:
                    kinds.setdefault(kind, []).append(seconds)
    kind_s = {kind: statistics.mean(v) for kind, v in kinds.items()}
    return Timing(pp, microbatches, {s: statistics.median(v) for s, v in per_iteration.items()},
                  per_iteration, kind_s, [r["core"] for r in reports],
                  reports[0]["cores_available"], os.getloadavg()[0])
