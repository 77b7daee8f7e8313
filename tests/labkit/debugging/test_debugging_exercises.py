"""Lab 17's checks and its write-the-code exercise, on the shared 4-rank grading world.

* ``check_cause``: the letter of each fault's cause, read back from the printed list of
  suspects (the list the learner reads), is right; another letter, or a word, is not.
* ``check_culprit``: the rank given to ``--inject-fault`` is right, another is not.
* ``EXCHANGE`` (one pipeline stage's blocking sends and receives, every rank one stage, real
  messages): the lab's solution passes, so does the mirror rule (odd stages send first); every
  stage sending first deadlocks and the verdict names the waiting ranks; neighbours' messages
  swapped, or one neighbour skipped, fail naming the stage and the message; the stub has no
  answer yet. The world keeps its own groups (tp = 2, pp = 1) and works afterwards.
* The lab's tools on the same world: the stack dump finds the sleeping rank in its own code and
  the others in the all-reduce; the Flight Recorder names the rank that skipped a collective;
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` names both shapes.
"""
import re

import pytest

from mpu_lab import launcher
from mpu_lab.labkit.debugging import broken_jobs, tools as debugging
from mpu_lab.labkit.debugging import exercises as checks
from mpu_lab.labkit.grader import grade
from mpu_lab.training.faults import FAULT_KINDS
from mpu_lab.labkit.debugging.readings import READINGS
from mpu_lab.labkit.notebooks.solutions import solution_source

# The lab's solution, as labs/solutions/ holds it (the learner loads it with %load): it must pass
# under its own name, and the verdict must name it, not the learner's function.
OWN_SOLUTION = solution_source("17")

STUB = '''
def my_exchange(stage, num_stages, mine):
    raise NotImplementedError("send to and receive from both neighbours")
'''

SOLUTION = '''
def my_exchange(stage, num_stages, mine):
    got = {}
    for peer in [p for p in (stage - 1, stage + 1) if 0 <= p < num_stages]:
        got[peer] = torch.empty_like(mine)
        if stage % 2 == 0:
            dist.send(mine, peer); dist.recv(got[peer], peer)
        else:
            dist.recv(got[peer], peer); dist.send(mine, peer)
    return got.get(stage - 1), got.get(stage + 1)
'''

ODD_FIRST = SOLUTION.replace("stage % 2 == 0", "stage % 2 == 1")
ALL_SEND_FIRST = SOLUTION.replace("stage % 2 == 0", "True")
SWAPPED = SOLUTION.replace("return got.get(stage - 1), got.get(stage + 1)",
                           "return got.get(stage + 1), got.get(stage - 1)")
NEXT_ONLY = SOLUTION.replace("(stage - 1, stage + 1)", "(stage + 1,)")


def _grade(source, world, as_notebook):
    return grade(as_notebook(source)["my_exchange"], checks.EXCHANGE, world)


def _groups(world):
    return world.run("(parallel_state.get_tensor_model_parallel_world_size(), "
                     "parallel_state.get_pipeline_model_parallel_world_size())")


# --------------------------------------------------------------------------- name the cause
def _printed_suspects(capsys):
    checks.print_suspects()
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 100
    entries = re.split(r"\n(?=[A-Z]\. )", out.strip())      # continuation lines are indented
    return dict(re.match(r"^([A-Z])\. (.*)$", " ".join(e.split()), re.S).groups()
                for e in entries)


def test_each_cause_is_right_under_its_printed_letter_and_wrong_under_another(capsys):
    printed = _printed_suspects(capsys)
    assert len(printed) == len(FAULT_KINDS) == 8
    assert list(printed.values()) == sorted(printed.values())      # not in the lab's order
    for kind, info in FAULT_KINDS.items():
        (letter,) = [k for k, text in printed.items() if text == info["cause"]]
        assert checks.check_cause(letter, kind)
        assert capsys.readouterr().out.startswith(f"Right: {letter}. {info['cause'][:20]}")
        assert checks.check_cause(letter.lower(), kind)               # a lower-case letter too
        capsys.readouterr()
        other = next(k for k in printed if k != letter)
        assert not checks.check_cause(other, kind)
        out = capsys.readouterr().out
        assert out.startswith(f"Not yet: {other} (") and "Hint:" in out, out


def test_cause_answers_that_are_not_a_letter(capsys):
    assert not checks.check_cause(None, "hang")
    assert capsys.readouterr().out.startswith("No answer yet: replace None with a letter A, B")
    assert not checks.check_cause("hang", "hang")                      # the kind is not a letter
    assert "is not one of the letters" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown fault kind 'hnag'"):
        checks.letter_of("hnag")


def test_the_culprit_is_the_rank_the_fault_was_injected_into(capsys):
    assert checks.check_culprit(1, "hang:1")
    assert capsys.readouterr().out.startswith("Right: rank 1")
    assert checks.check_culprit(3, "crash:3:5")
    capsys.readouterr()
    assert not checks.check_culprit(0, "hang:1")
    assert "Hint:" in capsys.readouterr().out
    assert not checks.check_culprit(None, "hang:1")
    assert capsys.readouterr().out.startswith("No answer yet")
    with pytest.raises(ValueError, match="names no rank"):
        checks.check_culprit(1, "hang")


# --------------------------------------------------------------------------- write the code
def test_the_solution_passes_and_the_world_keeps_its_groups(grading_world, as_notebook, capsys):
    before = _groups(grading_world)
    assert grade(as_notebook(OWN_SOLUTION)["solution_exchange"], checks.EXCHANGE, grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Right: solution_exchange agrees with the reference on all 4 ranks for 3 "
                          "inputs: a 1-element message;"), out
    assert _groups(grading_world) == before == [(2, 1)] * 4


def test_the_mirror_rule_odd_stages_first_also_cannot_deadlock(grading_world, as_notebook,
                                                                 capsys):
    assert _grade(ODD_FIRST, grading_world, as_notebook)
    assert capsys.readouterr().out.startswith("Right:")


def test_every_stage_sending_first_deadlocks_and_names_the_waiting_ranks(
        grading_world, as_notebook, capsys):
    assert not _grade(ALL_SEND_FIRST, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: on input 'a 1-element message' ranks [0, 1, 2, 3]"), out
    assert "(The world was restarted.)" in out and "which part to play" in out
    assert "even" not in out and "odd" not in out     # the hint points to the idea only
    assert _groups(grading_world) == [(2, 1)] * 4
    assert grading_world.run("x = torch.ones(1); dist.all_reduce(x); x.item()") == [4.0] * 4


def test_swapped_neighbours_name_the_stage_and_the_message(grading_world, as_notebook, capsys):
    assert not _grade(SWAPPED, grading_world, as_notebook)
    out = capsys.readouterr().out
    # stage 0 has no previous stage: its from_prev must be None, it returned stage 1's message
    assert out.startswith("Not yet: rank 0, input 'a 1-element message': stage 0 of 4: "
                          "from_prev (there is no stage -1) expected None, got shape (1,) "
                          "[100]."), out


def test_a_stage_that_skips_its_previous_neighbour_leaves_it_waiting(grading_world, as_notebook,
                                                                     capsys):
    assert not _grade(NEXT_ONLY, grading_world, as_notebook)
    out = capsys.readouterr().out
    # stage 1 sends to 2 first, and 2 (only talking to 3) never receives: they wait
    assert out.startswith("Not yet: on input 'a 1-element message' ranks ["), out
    assert "(The world was restarted.)" in out


def test_the_stub_has_no_answer_yet(grading_world, as_notebook, capsys):
    assert not _grade(STUB, grading_world, as_notebook)
    assert capsys.readouterr().out.startswith("No answer yet: my_exchange still raises")


# Megatron-core's _p2p_ops (core_v0.19.2 and 0.16.1 alike), read by hand: an even group rank
# posts send-next, recv-prev, send-prev, recv-next; an odd one recv-prev, send-next, recv-next,
# send-prev; the calls towards a neighbour that does not exist are left out.
MEGATRON_AT_4 = {0: ["send>1", "recv<1"],
                 1: ["recv<0", "send>2", "recv<2", "send>0"],
                 2: ["send>3", "recv<1", "send>1", "recv<3"],
                 3: ["recv<2", "send>2"]}


def test_after_the_attempt_the_learners_order_sits_next_to_megatrons(as_notebook, capsys):
    from mpu_lab.megatron_reference import runtime as megatron_core
    if not megatron_core.available():
        pytest.skip(megatron_core.missing())
    got = checks.compare_with_megatron(as_notebook(OWN_SOLUTION)["solution_exchange"])
    assert {s: theirs for s, (_, theirs) in got.items()} == MEGATRON_AT_4
    # the solution: even stages send then receive, towards the previous stage first
    assert got[1][0] == ["recv<0", "send>0", "recv<2", "send>2"]
    assert got[2][0] == ["send>1", "recv<1", "send>3", "recv<3"]
    out = capsys.readouterr().out
    assert "1      recv<0  send>0  recv<2  send>2  recv<0  send>2  recv<2  send>0" in out, out


def test_before_the_attempt_nothing_of_megatrons_order_is_shown(as_notebook, capsys):
    assert checks.compare_with_megatron(as_notebook(STUB)["my_exchange"]) is None
    out = capsys.readouterr().out
    assert out.startswith("No answer yet: my_exchange still raises") and "send>" not in out


def test_messages_name_their_stage():
    """The grader's expected messages, worked by hand: 100 * stage + 0, 1, 2, ..."""
    assert checks.message_of(0, (1,)).tolist() == [0.0]
    assert checks.message_of(3, (2, 2)).tolist() == [[300.0, 301.0], [302.0, 303.0]]


# --------------------------------------------------------------------------- the lab's tools
def test_the_stack_dump_finds_the_sleeping_rank_in_its_own_code(grading_world, capsys):
    stacks = debugging.dump_hung_stacks(grading_world, late_rank=2)
    capsys.readouterr()
    assert sorted(stacks) == [0, 1, 2, 3]
    assert [line.split()[0] for line in stacks[2]] == ["stuck_step"]
    for rank in (0, 1, 3):
        assert stacks[rank][0].split()[0] == "all_reduce", stacks[rank]
        assert stacks[rank][-1].split()[0] == "stuck_step"
    assert grading_world.run("x = torch.ones(1); dist.all_reduce(x); x.item()") == [4.0] * 4


def test_the_flight_recorder_names_the_rank_that_skipped(grading_world, capsys):
    entries = debugging.flight_recorder_demo(grading_world, skipper=3)
    out = capsys.readouterr().out
    assert [len(entries[r]) for r in range(4)] == [3, 3, 3, 2]
    assert [e["profiling_name"] for e in entries[0]] == ["gloo:all_reduce", "gloo:broadcast",
                                                         "gloo:all_reduce"]
    assert out.splitlines()[-1] == ("collective #3 (gloo:all_reduce) was issued by ranks "
                                    "[0, 1, 2]; ranks [3] never issued it.")


def test_detail_names_both_shapes_on_every_rank(grading_world, capsys):
    lines = debugging.detail_demo(grading_world, odd_rank=2)
    capsys.readouterr()
    assert lines[0] == ("rank 0: rank 0 runs ALLREDUCE([1]); rank 2 runs ALLREDUCE([2]) "
                        "(they differ in: Tensor shapes)")
    assert lines[2].startswith("rank 2: rank 2 runs ALLREDUCE([2]); rank 0 runs")
    assert grading_world.run("x = torch.ones(1); dist.all_reduce(x); x.item()") == [4.0] * 4


def test_steady_states_drop_what_depends_on_timing():
    gloo = "raised at a.py:3 in f: RuntimeError: [/__w/gloo/pair.cc:537] Read error "
    assert broken_jobs.steady_state(gloo + "[127.0.0.1]:1737: Connection reset by peer.") == \
        "stuck waiting at a.py, in f"
    assert broken_jobs.steady_state("raised at a.py:3 in f: RuntimeError: [/__w/x.cc:1] Timed "
                                    "out waiting 8000ms for send operation to complete") == \
        "stuck waiting at a.py, in f"
    assert broken_jobs.steady_state("was stopped at a.py:3 in f, waiting in all_reduce") == \
        "stuck waiting at a.py, in f"
    assert broken_jobs.steady_state("was stopped at c.py:7 in h") == "was stopped at c.py, in h"
    assert broken_jobs.steady_state("raised at b.py:9 in g: RuntimeError: boom") == \
        "raised at b.py, in g: RuntimeError: boom"
    assert broken_jobs.steady_state("was stopped at linecache.py:137 in updatecache", after=1) \
        == "ended after rank 1 failed (it lost its peer)"


def test_every_fault_kind_has_one_lab_job_that_the_launcher_accepts():
    jobs = broken_jobs.lab_jobs(4)
    assert sorted(job.fault.split(":")[0] for job in jobs.values()) == sorted(FAULT_KINDS)
    for job in jobs.values():
        launcher.precheck(launcher.resolve_script("train_gpt.py"), job.args, job.nproc)


def test_one_ranks_fp16_overflow_makes_every_rank_skip_the_step(grading_world, capsys):
    """tp = 2, dp = 2: the model-parallel groups are [0, 1], [2, 3], the data-parallel ones
    [0, 2], [1, 3]. Rank 1 overflows, twice in a row; its data-parallel partner 3 gets the inf
    through the gradient all-reduce; 0 and 2 learn of it from the overflow check of their
    model-parallel group. Every rank skips both steps; with Megatron's hysteresis of 2 the scale
    (2^16) stays at the first overflow and is halved at the second (Megatron's
    DynamicGradScaler.update, worked by hand)."""
    per_rank = debugging.overflow_demo(grading_world, bad_rank=1)
    capsys.readouterr()
    for step in (0, 1):
        rows = [rows[step] for rows in per_rank]
        assert [row["own"] for row in rows] == [False, True, False, False]
        assert [row["after_dp"] for row in rows] == [False, True, False, True]
        assert all(row["skipped"] for row in rows)
    assert {(rows[0]["before"], rows[0]["after"], rows[1]["after"]) for rows in per_rank} == {
        (65536.0, 65536.0, 32768.0)}
    no_fault = debugging.overflow_demo(grading_world, bad_rank=1, factor=1.0)
    capsys.readouterr()
    assert not any(row["skipped"] for rows in no_fault for row in rows)
    assert all(row["after"] == 65536.0 for rows in no_fault for row in rows)


# --------------------------------------------------------------------------- the jobs, unnamed
class _FakeRun:
    """A broken run's report as the launcher prints it (worked from lab 17's stored hang job)."""
    fault = "hang:1"

    def show(self, command=True):
        if command:
            print("torchrun --nproc-per-node 2 launch/train_gpt.py --train-iters 3 "
                  "--inject-fault hang:1 (+ a tiny GPT)")
        print("Not in it: rank 1 was stopped at mpu_lab/training/faults.py:231 in hang.")

    def diagnosis(self):
        print("  rank 1: was stopped at mpu_lab/training/faults.py, in hang")

    def likely_cause(self):
        print("likely cause: rank 1 never reached the collective")


def test_the_report_hides_the_fault_until_reveal(capsys):
    run = _FakeRun()
    checks.print_report(run)
    checks.print_report(run, "diagnosis")
    out = capsys.readouterr().out
    assert out == ("Not in it: rank 1 was stopped at mpu_lab/training/<hidden>.py:231 in "
                   "<hidden>.\n"
                   "  rank 1: was stopped at mpu_lab/training/<hidden>.py, in <hidden>\n")
    assert "hang" not in out and "fault" not in out
    checks.reveal(run.fault, run)
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 100
    assert " ".join(out.split()) == " ".join(
        f"it was --inject-fault hang:1: {FAULT_KINDS['hang']['what']} {READINGS['hang']} "
        "likely cause: rank 1 never reached the collective".split())
    with pytest.raises(ValueError, match="part must be 'show' or 'diagnosis', got 'all'"):
        checks.print_report(run, "all")


def test_jobs_are_numbered_in_the_labs_order_with_their_faults_hidden(capsys):
    class Jobs:      # what the helpers read of broken_jobs.BrokenJobs: its jobs, by name
        jobs = {n: j for n, j in broken_jobs.lab_jobs(4).items() if n not in broken_jobs.NOT_RUN}

        def result(self, name):
            return f"the {name} run"

    jobs = Jobs()
    assert checks.job_names(jobs)[:2] == ["hang", "skip-collective"]
    assert checks.job_result(jobs, 1) == "the hang run"
    assert checks.lab_job(jobs, 5) is jobs.jobs["crash"]
    checks.print_jobs(jobs)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("each job: launch/train_gpt.py --inject-fault ?")
    lines = lines[1:]
    assert len(lines) == len(jobs.jobs) and lines[0].startswith("job 1  2 ranks  --")
    assert lines[4].endswith("(you start this one yourself)")
    assert not any(kind in line for line in lines for kind in FAULT_KINDS)
    with pytest.raises(ValueError, match=f"there is no job 0: the jobs are 1 to {len(lines)}"):
        checks.job_result(jobs, 0)


def test_check_cause_takes_the_jobs_fault_spec(capsys):
    letter = checks.letter_of("crash")
    assert checks.check_cause(letter, "crash:1")
    assert checks.check_cause(letter, "crash:1:2")
    assert capsys.readouterr().out.startswith(f"Right: {letter}.")
