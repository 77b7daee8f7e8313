"""The GPU acceptance check's driver (mpu_lab.labkit.notebooks.gpu_check) with the notebook runs
and the benchmarks replaced by stand-ins: labs run N at once, a time budget leaves the rest "not
run", bad options are refused before anything starts, and the table is the one worked by hand
from made-up reports."""
import threading
import time

import pytest

from mpu_lab.labkit import REPO_ROOT
from mpu_lab.labkit.notebooks import gpu_check
from mpu_lab.labkit.notebooks.regenerate import Outcome

LABS = ["01", "02", "04"]
THROUGHPUT = {"shape": {"num_layers": 12, "hidden_size": 768, "seq_length": 1024,
                        "micro_batch_size": 16}, "precision": "bf16",
              "tokens_per_s": {"GPTModel(TP=1)": 371004.4, "PlainGPT": 381158.0},
              "mfu": {"GPTModel(TP=1)": 0.3214, "PlainGPT": 0.3302}, "step_time_ratio": 1.0274}
BANDWIDTH = {"world_size": 2, "backend": "gloo", "dtype": "bfloat16", "rows": [
    {"op": "all_reduce", "busbw": 0.30e9, "size_bytes": 1 << 20, "wrong": 0},
    {"op": "all_reduce", "busbw": 0.42e9, "size_bytes": 4 << 20, "wrong": 0},
    {"op": "broadcast", "busbw": 0.65e9, "size_bytes": 16 << 20, "wrong": 1}]}


@pytest.fixture
def fake(monkeypatch):
    """Labs that take ``seconds`` each (lab 02 fails) and benchmarks that report at once."""
    state = {"seconds": 0.0, "barrier": None, "benchmarks": 0}

    def run_notebooks(paths, params, **kwargs):
        (path,) = paths
        assert params["all"]["profile"] == "1gpu"
        if state["barrier"] is not None:
            state["barrier"].wait()          # breaks (BrokenBarrierError) unless all run at once
        time.sleep(state["seconds"])
        ok = not path.name.startswith("02")
        return [Outcome(path.name, ok, 12.34, "" if ok else "cell 3: boom | again")]

    def bench(report):
        def run(*args):
            state["benchmarks"] += 1
            return report
        return run
    monkeypatch.setattr(gpu_check, "run_notebooks", run_notebooks)
    monkeypatch.setattr(gpu_check, "machine", lambda: (1, "Test GPU", "2.x"))
    monkeypatch.setattr(gpu_check, "run_throughput", bench(THROUGHPUT))
    monkeypatch.setattr(gpu_check, "run_bandwidth", bench(BANDWIDTH))
    return state


def test_labs_run_at_once_and_the_table_is_in_the_labs_order(fake, tmp_path):
    fake["barrier"] = threading.Barrier(3, timeout=30)
    code = gpu_check.gpu_check(tmp_path, profile="1gpu", only=LABS, jobs=3, )
    assert code == 1                                       # lab 02 failed
    table = (tmp_path / "gpu_check.md").read_text()
    assert "device: Test GPU · torch: 2.x" in table and "labs at once: 3" in table
    assert [line for line in table.splitlines() if line.startswith("| 0")] == [
        "| 01_rank_groups | pass | 12.3 |",
        "| 02_collectives | FAIL: cell 3: boom / again | 12.3 |",
        "| 04_data_parallel | pass | 12.3 |"]
    assert "\n- 02_collectives: cell 3: boom | again\n" in table      # in full, below the table
    assert "| GPTModel(TP=1) | 371,004 | 32.1 % |" in table
    assert "| PlainGPT | 381,158 | 33.0 % |" in table
    assert "| step-time ratio GPTModel / PlainGPT | 1.027 | |" in table
    assert "| all_reduce | 0.42 | 4 MiB |" in table             # the best of its two sizes
    assert "| broadcast | 0.65 (1 wrong) | 16 MiB |" in table
    assert fake["benchmarks"] == 2


def test_past_the_time_budget_nothing_more_starts_and_the_table_says_so(fake, tmp_path):
    fake["seconds"] = 2.5                  # lab 01 starts at once and ends past the budget
    code = gpu_check.gpu_check(tmp_path, profile="1gpu", only=LABS, jobs=1, time_budget_s=2)
    table = (tmp_path / "gpu_check.md").read_text()
    assert code == 1
    assert "| 01_rank_groups | pass | 12.3 |" in table
    assert "| 02_collectives | FAIL: not run: past --time-budget 2 s | 0.0 |" in table
    assert "| 04_data_parallel | FAIL: not run: past --time-budget 2 s | 0.0 |" in table
    assert "throughput benchmark FAILED: not run: past --time-budget 2 s" in table
    assert "Each failure in full" not in table           # what did not run did not fail
    assert fake["benchmarks"] == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(jobs=0), "--jobs must be a whole number >= 1, got 0"),
    (dict(jobs=2.5), "--jobs must be a whole number >= 1, got 2.5"),
    (dict(time_budget_s=-5), "--time-budget must be a number of seconds > 0, got -5"),
])
def test_bad_options_are_refused_before_anything_starts(fake, tmp_path, kwargs, message):
    with pytest.raises(SystemExit, match=message.replace(".", r"\.")):
        gpu_check.gpu_check(tmp_path, profile="1gpu", only=LABS, **kwargs)
    assert not (tmp_path / "gpu_check.md").exists() and fake["benchmarks"] == 0


def test_the_committed_notebooks_are_never_the_output(fake):
    with pytest.raises(SystemExit, match="must not be the repository"):
        gpu_check.gpu_check(REPO_ROOT, profile="1gpu", only=LABS)
