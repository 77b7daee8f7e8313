"""What the GPT multi-rank tests share: one torchrun job of a worker in tests/mp/ whose
per-rank reports a module's tests read, and the relative difference of two loss curves."""
import pathlib

from mpu_lab.launcher import run

MP = pathlib.Path(__file__).resolve().parent / "mp"


def job_reports(worker: str, tmp_path_factory, name: str):
    """Run ``tests/mp/<worker>`` on 4 ranks with a fresh folder as its one argument; return
    each rank's report, in rank order."""
    job = run(MP / worker, [str(tmp_path_factory.mktemp(name))], nproc=4, timeout_s=300,
              show="none")
    assert [rep["rank"] for rep in job.results] == [0, 1, 2, 3]
    return job.results


def rel_diff(a, b):
    """The largest |a - b| / |b| over two equally long sequences (b the reference)."""
    assert len(a) == len(b) > 0
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))
