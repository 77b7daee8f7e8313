"""The launcher's one-line report of a failed rank quotes the meaningful part of its message:
gloo's build-machine source path and its boilerplate advice are dropped (the expected lines are
written out by hand from messages gloo 2.x and c10d print)."""
import logging
import pathlib

from mpu_lab.launcher import diagnosis

GLOO_READ_ERROR = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
    "error [127.0.0.1]:41175: Connection reset by peer. This is typically caused by a remote "
    "worker hanging or bugs in the application. Check the logs of the remote worker before "
    "reporting an error. GLHF! \N{UMBRELLA ON GROUND}\N{VARIATION SELECTOR-16}")
GLOO_TIMEOUT = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                "unbound_buffer.cc:129] Timed out waiting 8000ms for send operation to complete")


def test_a_gloo_read_error_is_quoted_without_its_source_path_and_advice():
    assert diagnosis.quote_message(GLOO_READ_ERROR) == (
        "RuntimeError: Read error [127.0.0.1]:41175: Connection reset by peer (in pair.cc:537)")


def test_a_gloo_timeout_keeps_its_whole_sentence_and_the_file_name():
    assert diagnosis.quote_message(GLOO_TIMEOUT) == (
        "RuntimeError: Timed out waiting 8000ms for send operation to complete "
        "(in unbound_buffer.cc:129)")


def test_a_message_of_the_rank_own_code_is_left_as_it_is():
    own = "RuntimeError: rank 1 raised at iteration 2 (fault injected by --inject-fault crash)"
    assert diagnosis.quote_message(own) == own
    assert diagnosis.quote_message("ValueError: shape [2] != [1]\nmore lines") == (
        "ValueError: shape [2] != [1]")
    assert diagnosis.quote_message("") == ""



# ------------------------------------------------- a job in which no rank raised (CI, stop 46)
def _dump(heading, frames):
    """A faulthandler dump of the main thread, innermost frame first, as CPython writes it."""
    from mpu_lab.launcher.paths import REPO_ROOT
    return heading + "\n\nThread 0x00007f2db0872b80 (most recent call first):\n" + "".join(
        f'  File "{REPO_ROOT / path}", line {line} in {func}\n' for path, line, func in frames)


def _summary(first, then):
    """torchrun's failure summary: the other failures first, the root cause last."""
    def entry(rank, code):
        return ["[0]:", "  time      : 2026-11-28_12:00:00", f"  rank      : {rank} "
                f"(local_rank: {rank})", f"  exitcode  : {code} (pid: {100 + rank})"]
    return [(None, t) for t in ["train_gpt.py FAILED", "Failures:", *entry(*then),
                                "Root Cause (first observed failure):", *entry(*first)]]


def test_a_job_whose_ranks_all_ended_by_signals_is_not_blamed_on_a_rank_that_raised(tmp_path):
    """Rank 1 skipped a collective and entered the next one; gloo paired the two and rank 0
    aborted on the size check; under load torchrun stopped rank 1 (SIGTERM, its stack dumped)
    before it noticed the lost peer, so no rank left a Python exception. Written by hand: the
    two stack dumps and torchrun's summary, listing rank 1 first or naming it the root cause."""
    from mpu_lab.launcher import runner
    (tmp_path / "stack_rank0.txt").write_text(_dump("Fatal Python error: Aborted", [
        ("mpu_lab/core/comm/__init__.py", 51, "wait"),
        ("mpu_lab/core/comm/__init__.py", 93, "all_reduce"),
        ("mpu_lab/training/training.py", 113, "average_losses_across_data_parallel_group"),
        ("mpu_lab/training/training.py", 229, "train_step")]))
    (tmp_path / "stack_rank1.txt").write_text(_dump("", [
        ("mpu_lab/core/comm/__init__.py", 51, "wait"),
        ("mpu_lab/core/comm/__init__.py", 93, "all_reduce"),
        ("mpu_lab/core/distributed/finalize_model_grads.py", 55, "ddp_allreduce_hook"),
        ("mpu_lab/training/training.py", 214, "train_step")]))
    printed = [(1, "[inject-fault] skip-collective on rank 1 at iteration 2 (time 1.0)")]
    for first, then in (((0, -6), (1, -15)), ((1, -15), (0, -6))):
        error = runner.failure_error("train_gpt.py", 1, 2, printed + _summary(first, then),
                                     tmp_path / "logs", tmp_path, "5")
        message = str(error)
        assert "raised first" not in message and "no rank raised a Python exception" in message
        assert ("rank 0 aborted (SIGABRT, from C++ code such as gloo's checks) at "
                "mpu_lab/training/training.py:113 in average_losses_across_data_parallel_group"
                in message), message
        assert ("all_reduce at mpu_lab/core/distributed/finalize_model_grads.py:55 in "
                "ddp_allreduce_hook, reached by rank(s) [1]") in message, message
        assert "likely cause: rank 0 aborted in a collective at" in message, message


def test_torchrun_summary_root_cause_is_the_fallback_rank():
    assert diagnosis.first_failed_rank(_summary((2, 1), (0, -15))) == 2
    assert diagnosis.first_failed_rank(_summary((2, 1), (0, -15))[:5]) == 0


# A faulthandler dump of every thread of a rank asleep in main (written out by hand in the
# format CPython 3.11 prints), then a second dump, started by a second SIGTERM, cut short.
_GLOO_THREAD = ('Thread 0x00007f5b6a7146c0 (most recent call first):\n'
                '  File "/usr/lib/python3.11/threading.py", line 982 in run\n'
                '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n\n')
_MAIN_THREAD = ('Current thread 0x00007f5b6b47cb80 (most recent call first):\n'
                '  File "/repo/tests/mp/launch_probe.py", line 31 in main\n'
                '  File "/repo/mpu_lab/launcher/worker.py", line 121 in wrapper\n'
                '  File "/repo/tests/mp/launch_probe.py", line 44 in <module>\n')


def test_the_main_thread_is_read_from_a_dump_even_when_a_second_one_was_cut_short():
    whole = _GLOO_THREAD + _MAIN_THREAD
    assert "line 31 in main" in diagnosis.main_thread_stack(whole)
    cut = whole + _GLOO_THREAD.split("  File")[0] + '  File "/usr/lib/python3.11/thr'
    assert "line 31 in main" in diagnosis.main_thread_stack(cut)
    # the second dump got as far as the main thread's innermost frame: that one is read
    partial = _MAIN_THREAD.replace("line 31", "line 32").split('  File "/repo/mpu_lab')[0]
    second = whole + _GLOO_THREAD + partial
    assert "line 32 in main" in diagnosis.main_thread_stack(second)
    assert "line 982 in run" in diagnosis.main_thread_stack(_GLOO_THREAD)   # one thread
    # a main thread deeper than faulthandler prints (no <module> frame) is still the main one
    deep = _GLOO_THREAD + _MAIN_THREAD.split('  File "/repo/tests/mp/launch_probe.py", line 44')[0]
    assert "line 31 in main" in diagnosis.main_thread_stack(deep)


def test_a_place_without_a_frame_of_the_repository_names_what_the_dump_shows():
    in_torch = ('Current thread 0x00007f5b6b47cb80 (most recent call first):\n'
                '  File "/venv/site-packages/torch/distributed/distributed_c10d.py", '
                'line 2810 in all_reduce\n'
                '  File "/venv/site-packages/torch/distributed/c10d_logger.py", '
                'line 81 in wrapper\n')
    where = diagnosis.where_in(in_torch, innermost_last=False)
    assert where == ("an unknown place (no frame of its own; innermost distributed_c10d.py:2810 "
                     "in all_reduce)")
    assert diagnosis.where_in("") == "an unknown place (its dump has no frame: 'empty')"


def test_a_rank_stopped_while_torch_logs_its_exception_stands_at_the_line_that_called_torch():
    """Seen under load: torchrun's SIGTERM reached a rank while torch's c10d logger handled the
    timeout it had raised; the dump's innermost frames were the standard library's logging."""
    logging_py = logging.__file__   # this interpreter's own library, wherever it is installed
    dump = ('Current thread 0x00007f5b6b47cb80 (most recent call first):\n'
            f'  File "{logging_py}", line 1644 in handle\n'
            f'  File "{logging_py}", line 1586 in _log\n'
            '  File "/venv/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper\n'
            f'  File "{diagnosis.REPO_ROOT}/tests/mp/launch_probe.py", line 36 in main\n')
    assert diagnosis.where_in(dump, innermost_last=False) == "tests/mp/launch_probe.py:36 in main"
    # a file of the repository's own, or an installed package's, is never taken for the library
    site = pathlib.Path(logging_py).parent / "site-packages" / "mylib" / "x.py"
    assert diagnosis.where_in(f'  File "{site}", line 3 in f\n',
                              innermost_last=False) == "x.py:3 in f"
