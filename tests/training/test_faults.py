"""Injected faults (``train_gpt.py --inject-fault``, :mod:`mpu_lab.training.faults`): each kind
fails as documented within its time bound with no process left (by PID), the failure report
names the right ranks, call and likely cause, the dense-twin check flags a diverged run and
passes a correct one, and a bad spec is refused before any process starts.

One torchrun job per kind, each a tiny model with a 5 s collective timeout, run once for the
module (``fault_jobs``). The reference for each job is the fault put in, never the report."""
from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from mpu_lab import launcher, training
from mpu_lab.launcher import LaunchError, diagnosis, runner
from mpu_lab.training import faults
from mpu_lab.labkit.debugging import twin_check
from mpu_lab.core.optimizer import DynamicGradScaler
from mpu_lab.training import checkpointing
from mpu_lab.training import training as loop
from process_watch import ProcessWatch

TIMEOUT_S = 5.0
JOBS_AT_ONCE = int(os.environ.get("MPU_LAB_FAULT_JOBS_AT_ONCE", "3"))
# A timed-out collective: every rank gone within the timeout plus torchrun's teardown
# (SIGTERM, the stack dumps, its summary) on a busy 2-core machine.
TIMEOUT_BOUND_S = TIMEOUT_S + 10.0
# A rank that raised or aborted: the others lose their peer at once.
PEER_LOST_BOUND_S = 10.0
TINY = ["--num-layers", 1, "--hidden-size", 32, "--num-attention-heads", 2, "--seq-length", 16,
        "--micro-batch-size", 2, "--vocab-size", 64, "--make-vocab-size-divisible-by", 16,
        "--train-iters", 4, "--log-interval", 1, "--quiet"]
TP, PP = "--tensor-model-parallel-size", "--pipeline-model-parallel-size"
JOBS = {   # id: (ranks, flags)
    "hang": (2, ["--inject-fault", "hang"]),                             # rank 1, iteration 2
    "skip-collective": (2, ["--inject-fault", "skip-collective:1:2"]),
    "mismatched-shape": (2, ["--inject-fault", "mismatched-shape:1:2"]),
    "wrong-group": (4, [TP, 2, "--inject-fault", "wrong-group:1:2"]),
    "crash": (2, ["--inject-fault", "crash:0:2"]),
    "pp-deadlock": (2, [PP, 2, "--num-layers", 2, "--inject-fault", "pp-deadlock:0:2"]),
    "divergence": (2, ["--dense-twin", "--inject-fault", "divergence:1:3"]),
    "fp16-overflow": (2, ["--fp16", "--hysteresis", "1", "--inject-fault", "fp16-overflow:1:2"]),
    "correct": (2, ["--dense-twin"]),                                  # divergence's twin
}


def _fault_time(lines):
    """The wall clock the faulty rank printed when its fault fired (faults.announce)."""
    for _, text in lines:
        m = re.search(r"\[inject-fault\] .* \(time ([\d.]+)\)", text)
        if m:
            return float(m.group(1))
    return None


def _run_job(name, watch, folder):
    nproc, flags = JOBS[name]
    marker = str(folder / f"{name}.jsonl")     # --metrics-file: tells the jobs' agents apart
    entry = {}
    try:
        entry["result"] = launcher.run("train_gpt.py", TINY + flags + ["--metrics-file", marker],
                                       nproc=nproc, show="none", timeout_s=180,
                                       env={"MPU_LAB_TIMEOUT_S": f"{TIMEOUT_S:g}"})
        lines = entry["result"].lines
    except LaunchError as exc:
        entry["error"], lines = exc, exc.output
    entry["raised_at"] = time.time()
    entry["agents"], entry["workers"] = watch.job(marker)
    entry["left"] = watch.still_alive(watch.tree(entry["agents"]))   # and workers, children
    fired = _fault_time(lines)
    entry["seconds"] = None if fired is None else entry["raised_at"] - fired
    return entry


@pytest.fixture(scope="module")
def fault_jobs(tmp_path_factory):
    """Run every job of JOBS once, ``JOBS_AT_ONCE`` at a time (a collective fault mostly
    waits for its timeout): ``{id: dict(error or result, seconds from the fault to the end,
    the job's workers, its processes still alive when run() returned)}``."""
    folder = tmp_path_factory.mktemp("faults")
    with ProcessWatch() as watch, ThreadPoolExecutor(JOBS_AT_ONCE) as pool:
        futures = {name: pool.submit(_run_job, name, watch, folder) for name in JOBS}
        out = {name: f.result() for name, f in futures.items()}
    for name, entry in out.items():
        print(f"\n[faults] {name}: {'LaunchError' if 'error' in entry else 'finished'}"
              + (f" {entry['seconds']:.1f} s after the fault fired" if entry["seconds"] else ""))
    return out


def _error(jobs, name) -> str:
    entry = jobs[name]
    assert "error" in entry, f"{name}: the job finished instead of failing"
    assert entry["left"] == [], f"{name}: processes left behind: {entry['left']}"
    # one set of workers per start (the launcher starts a job once more when its ranks could
    # not connect: runner.ranks_could_not_connect)
    assert entry["agents"], f"{name}: no torchrun agent was seen"
    assert len(entry["workers"]) == JOBS[name][0] * len(entry["agents"]), entry["workers"]
    return str(entry["error"])


# --------------------------------------------------------------------------- the failing kinds
def test_hang_names_the_rank_that_never_came_and_where_it_was(fault_jobs):
    message = _error(fault_jobs, "hang")
    assert fault_jobs["hang"]["seconds"] <= TIMEOUT_BOUND_S
    assert "A collective timed out (MPU_LAB_TIMEOUT_S: 5 s): " in message
    assert "reached by rank(s) [0]" in message
    assert re.search(r"Not in it: rank 1 was stopped at mpu_lab/training/faults\.py:\d+ in "
                     r"hang", message)
    assert "likely cause: rank 1 never reached the collective" in message


def test_skipped_collective_pairs_unrelated_calls(fault_jobs):
    """Rank 1 skips the all-reduce of the loss that rank 0 enters after the step and enters
    its next data-parallel collective (the gradient all-reduce of iteration 3): gloo pairs the
    two, and rank 0, which expects one float, aborts on the bucket's size."""
    message = _error(fault_jobs, "skip-collective")
    assert fault_jobs["skip-collective"]["seconds"] <= PEER_LOST_BOUND_S
    assert re.search(r"rank 0 aborted \(SIGABRT.*\) at mpu_lab/training/training\.py:\d+ in "
                     r"average_losses_across_data_parallel_group", message)
    assert re.search(r"all_reduce at mpu_lab/core/distributed/finalize_model_grads\.py:\d+ in "
                     r"ddp_allreduce_hook, reached by rank\(s\) \[1\]", message)
    assert "likely cause: rank 0 aborted in a collective at" in message
    assert "another order" in message


def test_mismatched_shape_times_out_in_the_same_call_on_every_rank(fault_jobs):
    message = _error(fault_jobs, "mismatched-shape")
    assert fault_jobs["mismatched-shape"]["seconds"] <= TIMEOUT_BOUND_S
    assert re.search(r"timed out .*: all_reduce at mpu_lab/training/training\.py:\d+ in "
                     r"average_losses_across_data_parallel_group, reached by rank\(s\) \[0, 1\]",
                     message)
    assert "likely cause: every rank reached the same all_reduce" in message
    assert "another size or dtype" in message and "TORCH_DISTRIBUTED_DEBUG=DETAIL" in message


def test_wrong_group_leaves_ranks_in_different_collectives(fault_jobs):
    """Rank 1 sums its gradient norm over the data-parallel group {1, 3} where rank 0 sums
    over the tensor-parallel group {0, 1}: rank 1's next call on {0, 1} completes rank 0's,
    and rank 0 then waits in the loop's own clipping; the others end up in other
    collectives."""
    message = _error(fault_jobs, "wrong-group")
    assert fault_jobs["wrong-group"]["seconds"] <= TIMEOUT_BOUND_S
    assert re.search(r"rank 0 (at|raised at) mpu_lab/core/optimizer/clip_grads\.py:\d+ in "
                     r"clip_grad_norm", message) or \
        re.search(r"all_reduce at mpu_lab/core/optimizer/clip_grads\.py:\d+ in clip_grad_norm, "
                  r"reached by rank\(s\) \[0\]", message)
    assert "likely cause: the ranks wait in different collectives" in message
    assert "another process group" in message


def test_crash_names_the_rank_that_raised_first(fault_jobs):
    message = _error(fault_jobs, "crash")
    err = fault_jobs["crash"]["error"]
    assert fault_jobs["crash"]["seconds"] <= PEER_LOST_BOUND_S
    assert err.rank == 0 and "rank 0 raised first" in message
    assert "RuntimeError: rank 0 raised at iteration 2" in err.traceback
    assert re.search(r"Rank 0 raised in its own code at mpu_lab/training/faults\.py:\d+ in "
                     r"crash, not in a collective", message)
    # rank 1 lost its peer: it raised in the training loop, or (under load) torchrun stopped it
    # there before it had raised; either way the report places it in the training code
    assert re.search(r"The others: rank 1 (raised|was stopped) at mpu_lab/training/", message)
    assert "likely cause: rank 0 raised RuntimeError in its own code" in message


def test_pp_deadlock_blocks_both_stages_in_send(fault_jobs):
    message = _error(fault_jobs, "pp-deadlock")
    assert fault_jobs["pp-deadlock"]["seconds"] <= TIMEOUT_BOUND_S
    assert re.search(r"timed out .*: send at mpu_lab/training/faults\.py:\d+ in "
                     r"send_first_to_neighbour, reached by rank\(s\) \[0, 1\]", message)
    assert "likely cause: every rank is blocked in send" in message
    assert "batch_isend_irecv" in message


# --------------------------------------------------------------------------- the silent kinds
def test_dense_twin_check_flags_the_diverged_run_and_passes_a_correct_one(fault_jobs):
    for name in ("divergence", "correct"):
        assert "result" in fault_jobs[name], f"{name}: {fault_jobs[name].get('error')}"
        assert fault_jobs[name]["left"] == []
    broken = fault_jobs["divergence"]["result"].results[0]
    verdict = twin_check.compare_with_dense_twin(broken, broken["dense_losses"])
    assert not verdict and verdict.iteration == 3 and verdict.rel_diff > 1e-3
    assert str(verdict).startswith("Drifts from the dense twin at iteration 3: loss ")
    good = fault_jobs["correct"]["result"].results[0]
    verdict = twin_check.compare_with_dense_twin(fault_jobs["correct"]["result"])  # the job
    assert verdict and verdict.checked == 4, str(verdict)
    # the twin starts from the run's weights before the fault: the same in both jobs
    assert good["dense_losses"] == broken["dense_losses"]


def test_fp16_overflow_skips_the_step_on_every_rank_and_halves_the_scale(fault_jobs):
    """Megatron's DynamicGradScaler: an inf gradient on any rank skips the step everywhere and,
    with --hysteresis 1 (the job's: Megatron's default of 2 would wait for a second overflow),
    halves the loss scale (2^16 -> 2^15); the run goes on."""
    entry = fault_jobs["fp16-overflow"]
    assert "result" in entry, f"the fp16 run failed: {entry.get('error')}"
    assert entry["left"] == []
    for rank_result in entry["result"].results:
        m = rank_result["metrics"]
        assert [r["skipped_iter"] for r in m] == [False, True, False, False]
        assert [r["loss_scale"] for r in m] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 15]
        assert m[-1]["skipped_iterations"] == 1
        assert m[1]["grad_norm"] != m[1]["grad_norm"]            # NaN: no norm, no step


# --------------------------------------------------------------------------- before anything
@pytest.fixture
def no_process(monkeypatch):
    def popen(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[0] if args else kwargs}")
    monkeypatch.setattr(runner.subprocess, "Popen", popen)
    monkeypatch.setattr(runner.agent, "start", popen)   # the forked torchrun agent


BAD_SPECS = [
    ("boom", 2, [], ["unknown fault kind 'boom'", "hang, skip-collective, mismatched-shape, "
                     "wrong-group, crash, pp-deadlock, divergence, fp16-overflow"]),
    ("hang:one", 2, [], ["RANK must be an integer, got 'one'", "KIND[:RANK[:ITERATION]]"]),
    ("hang:1:2:3", 2, [], ["expected KIND[:RANK[:ITERATION]]"]),
    ("crash:1:0", 2, [], ["ITERATION >= 1"]),
    ("crash:2", 2, [], ["rank 2 is outside the world of 2 ranks", "0..1"]),
    ("crash:0:9", 2, [], ["iteration 9 is after the last one (--train-iters 4)"]),
    ("hang", 1, [], ["needs at least 2 ranks"]),
    ("wrong-group", 2, [], ["needs --tensor-model-parallel-size > 1 and a data-parallel size > 1",
                            "here: 2 ranks"]),
    ("pp-deadlock", 2, [], ["needs --pipeline-model-parallel-size > 1"]),
    ("skip-collective", 2, [TP, 2], ["needs a data-parallel size > 1"]),
    ("mismatched-shape:0", 4, [PP, 2, "--num-layers", 2],
     ["runs on the last stage only; pick one of its ranks [2, 3]"]),
    ("fp16-overflow", 2, [], ["needs --fp16"]),
]


@pytest.mark.parametrize("spec,nproc,flags,needles", BAD_SPECS, ids=[b[0] for b in BAD_SPECS])
def test_bad_fault_is_refused_before_any_process_starts(spec, nproc, flags, needles, no_process):
    with pytest.raises(ValueError) as err:
        launcher.run("train_gpt.py", TINY + flags + ["--inject-fault", spec], nproc=nproc)
    for needle in needles:
        assert needle in str(err.value)


def test_parse_fault_defaults_and_every_kind_documented():
    assert faults.parse_fault("hang") == faults.Fault("hang", 1, 2)
    assert faults.parse_fault("Divergence:0:5") == faults.Fault("divergence", 0, 5)
    for kind, doc in faults.FAULT_KINDS.items():
        assert faults.parse_fault(kind).kind == kind
        assert doc["what"] and doc["cause"].endswith(".")
    assert set(faults.FAULT_KINDS) == {"hang", "skip-collective", "mismatched-shape",
                                       "wrong-group", "crash", "pp-deadlock", "divergence",
                                       "fp16-overflow"}


# --------------------------------------------------------------------------- the check itself
def test_compare_with_dense_twin_on_hand_worked_losses():
    dense = [4.0, 3.0, 2.0, 1.0]
    # logged every 2 iterations: each record is the mean over its window (3.5, 1.5)
    records = [{"iteration": 2, "lm_loss": 3.5}, {"iteration": 4, "lm_loss": 1.5}]
    verdict = twin_check.compare_with_dense_twin(records, dense)
    assert verdict and verdict.checked == 2 and verdict.max_rel_diff == 0.0
    records[1]["lm_loss"] = 1.5 * (1 + 3e-5)
    verdict = twin_check.compare_with_dense_twin({"metrics": records}, dense, rtol=1e-5)
    assert not verdict and verdict.iteration == 4
    assert verdict.rel_diff == pytest.approx(3e-5) and verdict.dense_loss == 1.5
    assert "iteration 4" in str(verdict) and "the 1 before it matched" in str(verdict)
    assert not twin_check.compare_with_dense_twin([{"iteration": 1, "lm_loss": float("nan")}],
                                                  dense)
    with pytest.raises(ValueError, match="--dense-twin"):
        twin_check.compare_with_dense_twin({"metrics": records})
    with pytest.raises(ValueError, match="only 4 losses"):
        twin_check.compare_with_dense_twin([{"iteration": 5, "lm_loss": 1.0}], dense)


def test_likely_cause_from_records_alone(tmp_path):
    """The report's last line from the ranks' records (no processes): DETAIL's mismatch
    report, and a rank that vanished with an exit code of its own."""
    tb = ('Traceback (most recent call last):\n'
          f'  File "{launcher.REPO_ROOT}/launch/x.py", line 7, in main\n    dist.all_reduce(t)\n'
          '  File "/site-packages/torch/distributed/distributed_c10d.py", line 9, in all_reduce\n'
          'RuntimeError: Detected mismatch between collectives on ranks\n')
    (tmp_path / "failed_rank0.json").write_text(json.dumps(
        {"rank": 0, "time": 1.0, "message": "RuntimeError: Detected mismatch between "
         "collectives on ranks. Rank 0 is running collective: ...", "traceback": tb}))
    text, _ = diagnosis.diagnose(tmp_path, 2, "RuntimeError: Detected mismatch between "
                                  "collectives on ranks", tb, None, {1: 9})
    assert text.splitlines()[-1].startswith("likely cause: TORCH_DISTRIBUTED_DEBUG=DETAIL")
    text, _ = diagnosis.diagnose(tmp_path, 2, "RuntimeError: Connection closed by peer", tb,
                                  None, {1: 9})
    assert "likely cause: rank 1 exited with code 9 without a Python exception" in text


# --------------------------------------------------------------------------- the injection itself
def test_training_loop_and_checkpoint_save_carry_no_fault_code():
    """The code a learner reads has no fault branch: the lab kit's faults enter through its
    callbacks and its checkpoint writer."""
    for path in ("mpu_lab/training/training.py", "mpu_lab/training/checkpointing/save_load.py"):
        source = (launcher.REPO_ROOT / path).read_text()
        assert not re.search(r"\bfaults?\b|inject|os\._exit|MPU_LAB_FAULT|import.*labkit",
                             source), path


def test_inject_gives_one_callback_and_rebinds_nothing(world):
    """The faults enter as a callback of the loop: nothing of the loop's module is replaced."""
    before = dict(vars(loop))
    assert faults.inject(None) == []
    for kind in faults.FAULT_KINDS:
        callbacks = faults.inject(faults.Fault(kind, 0, 2))
        assert len(callbacks) == 1 and isinstance(callbacks[0], loop.Callback)
    assert dict(vars(loop)) == before


def _one_step(fault, iteration, scale=2.0 ** 16):
    """Run the fault's callback through one step's three hook points, as train_step calls
    them, on a stand-in state; returns what the step would have seen."""
    seen = {}
    state = SimpleNamespace(iteration=iteration, scaler=DynamicGradScaler(scale, 1.0, 2.0, 0.5,
                                                                          1000, 2))
    injection, = faults.inject(fault)
    injection.on_step_begin(state)
    seen["scale_in_backward"] = state.scaler.scale
    seen["armed"] = injection.armed
    injection.on_before_optimizer_step(state)
    seen["scale_at_optimizer_step"] = state.scaler.scale
    seen["logged"] = injection.loss_for_log(torch.tensor(3.0))
    state.iteration += 1
    injection.on_step_end(state, {"lm_loss": 3.0})   # one rank: the average is the identity
    seen["armed_after"] = injection.armed
    return seen


def test_fp16_overflow_scales_one_backward_by_2_to_the_64_on_its_rank_only(world):
    fault = faults.Fault("fp16-overflow", 0, 2)
    seen = _one_step(fault, iteration=1)          # iteration 2, rank 0: armed
    assert seen["armed"] and not seen["armed_after"]
    assert seen["scale_in_backward"] == 2.0 ** 80
    assert seen["scale_at_optimizer_step"] == 2.0 ** 16       # the scaler's own, exactly
    seen = _one_step(fault, iteration=2)          # iteration 3: untouched
    assert seen["scale_in_backward"] == seen["scale_at_optimizer_step"] == 2.0 ** 16
    seen = _one_step(faults.Fault("fp16-overflow", 1, 2), iteration=1)   # rank 1
    assert seen["scale_in_backward"] == 2.0 ** 16


def test_loss_faults_change_the_all_reduce_input_on_their_step_only(world):
    """What the rank all-reduces when the loss is averaged again for the log line."""
    logged = _one_step(faults.Fault("mismatched-shape", 0, 2), 1)["logged"]
    assert logged.tolist() == [3.0, 1.0]                        # 2 elements, not 1
    assert _one_step(faults.Fault("mismatched-shape", 0, 2), 0)["logged"].shape == ()
    assert _one_step(faults.Fault("mismatched-shape", 1, 2), 1)["logged"].shape == ()
    assert _one_step(faults.Fault("skip-collective", 0, 2), 1)["logged"] is None   # skipped
    assert _one_step(faults.Fault("skip-collective", 0, 2), 2)["logged"].item() == 3.0
    with pytest.raises(RuntimeError, match="rank 0 raised at iteration 2"):
        _one_step(faults.Fault("crash", 0, 2), 1)
    assert _one_step(faults.Fault("crash", 0, 2), 2)["logged"].item() == 3.0


def test_kill_in_save_is_a_dcp_file_writer_and_refuses_a_bad_spec(monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter
    writer = faults.kill_in_save(1, 4)
    assert isinstance(writer, FileSystemWriter)
    assert type(writer).write_data is not FileSystemWriter.write_data
    monkeypatch.delenv(faults.SAVE_FAULT_ENV, raising=False)
    assert faults.kill_in_save_from_env() is None              # DCP's own writer
    monkeypatch.setenv(faults.SAVE_FAULT_ENV, "1-4")
    with pytest.raises(ValueError, match=r"MPU_LAB_FAULT_IN_SAVE='1-4': expected RANK:ITERATION"):
        faults.kill_in_save_from_env()


def test_kill_in_save_writes_other_ranks_and_iterations_as_dcp_does(world, tmp_path):
    """Rank 0 of a one-rank world, saving iteration 1: a writer for rank 1, or for rank 0 at
    iteration 4, writes the checkpoint as DCP's own writer does (complete, verified)."""
    argv = ["--num-layers", 1, "--hidden-size", 16, "--num-attention-heads", 2,
            "--seq-length", 8, "--micro-batch-size", 2, "--vocab-size", 32,
            "--make-vocab-size-divisible-by", 16, "--train-iters", 1, "--quiet"]
    args = training.validate_args(training.parse_args([str(a) for a in argv]), 1)
    state = training.setup(args, log=lambda s: None)
    training.train(state, log=lambda s: None)
    for name, writer in (("default", None), ("rank1", faults.kill_in_save(1, 1)),
                         ("iter4", faults.kill_in_save(0, 4))):
        path = checkpointing.save_checkpoint(tmp_path / name, state, writer)
        checkpointing.verify_checkpoint(path)
        assert checkpointing.read_checkpoint_info(path)["iteration"] == 1
    files = {name: sorted(p.name for p in (tmp_path / name / "iter_0000001").iterdir())
             for name in ("default", "rank1", "iter4")}
    assert files["rank1"] == files["iter4"] == files["default"]
