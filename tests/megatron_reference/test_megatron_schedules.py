"""Megatron-core's pipeline schedules next to mpu_lab's (mpu_lab.megatron_reference.schedules and
launch/megatron_core_schedules.py), with whichever megatron-core this Python has (0.16.x below
Python 3.12, 0.19+ from 3.12 on); skipped where it cannot be imported.

The references are independent of both schedules: the single-process twin of the toy model
(its gradients of the mean loss over the micro-batches), and each library against the other.
"""
import pytest

from documented import COMMANDS, script_and_flags
from mpu_lab.megatron_reference import runtime as mc
from mpu_lab.labkit.pipeline_parallel import megatron_core as mcs
from mpu_lab.megatron_reference import schedules as megatron_schedules

TOL = 1e-6   # fp32
needs_megatron = pytest.mark.skipif(not mc.available(), reason=mc.missing() or "")


@pytest.fixture(scope="module")
def side_by_side():
    """The command megatron_core_schedules.py's docstring shows (tests/documented.py): its
    cases on its 2 ranks (the script's 4 micro-batches), and Megatron's batched p2p besides."""
    script, flags, nproc = script_and_flags(COMMANDS["megatron_core_schedules.py:1"])
    assert script == "megatron_core_schedules.py" and flags[0] == "--cases" and nproc == 2
    return mcs.run_side_by_side([*flags[1:], "interleaved-batched"], nproc=nproc)


def _worst(side_by_side, case, key):
    return max(next(c for c in rank["cases"] if c["case"] == case)[key]
               for rank in side_by_side["results"])


@needs_megatron
@pytest.mark.parametrize("case", ["1f1b", "interleaved"])
def test_megatron_core_schedule_gives_mpu_lab_and_twin_stage_gradients(side_by_side, case):
    assert _worst(side_by_side, case, "megatron_vs_mpu_lab") <= TOL
    assert _worst(side_by_side, case, "megatron_vs_twin") <= TOL
    assert _worst(side_by_side, case, "mpu_lab_vs_twin") <= TOL


@needs_megatron
def test_megatron_core_batched_p2p_interleaved_at_two_stages_is_wrong_on_gloo(side_by_side):
    # Megatron-core's default (batch_p2p_comm=True) at p = 2, v = 2: the previous and the next
    # stage are the same rank, and on gloo the gradients come out wrong, silently. mpu_lab's
    # interleaved schedule on the same stages stays right.
    assert _worst(side_by_side, "interleaved-batched", "megatron_vs_twin") > 0.1
    assert _worst(side_by_side, "interleaved-batched", "mpu_lab_vs_twin") <= TOL


@needs_megatron
def test_format_results_names_each_schedule_and_verdict(side_by_side):
    text = mcs.format_results(side_by_side)
    assert text.startswith("p = 2 stages on the CPU (gloo)")
    assert side_by_side["version"] == mc.version()
    only = mcs.format_results(side_by_side, cases=["interleaved-batched", "1f1b"]).splitlines()
    assert len(only) == 5 and megatron_schedules.CASES["interleaved-batched"].label in only[3]
    rows = {case.name: next(line for line in text.splitlines() if case.label in line)
            for case in megatron_schedules.CASES.values()}
    assert rows["1f1b"].count("< 1e-06") == 3
    assert rows["interleaved"].count("< 1e-06") == 3
    # wrong against both references, while mpu_lab's own interleaved schedule is right
    assert rows["interleaved-batched"].count("< 1e-06") == 1


def test_without_megatron_core_the_driver_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(mc, "missing", lambda: mc.INSTALL_HINT)
    result = mcs.run_side_by_side()
    assert result == {"skipped": mc.INSTALL_HINT}
    assert mcs.format_results(result) == mc.INSTALL_HINT


def test_bad_arguments_are_refused_before_a_job_starts():
    if not mc.available():
        pytest.skip(mc.missing())
    with pytest.raises(ValueError, match="unknown case"):
        mcs.run_side_by_side(["gpipe"])
    with pytest.raises(ValueError, match="at least 2"):
        mcs.run_side_by_side(nproc=1)
