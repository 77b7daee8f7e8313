"""``init_single_process`` (a notebook's, a benchmark's or a test's world of one) needs no
rendezvous port: no ``MASTER_PORT`` is chosen, so another job on the machine cannot take it
between choosing and binding (under the full suite lab 03 once failed with EADDRINUSE, and every
later call retried the same port); its world works, and starts again after a shutdown. Run in a
fresh interpreter."""
import subprocess
import sys

CHECK = r'''
import os, torch, torch.distributed as dist
from mpu_lab.training import initialize

for attempt in (1, 2):                    # the second: a new world after shutdown()
    initialize.init_single_process(backend="gloo")
    t = torch.ones(2)
    dist.all_reduce(t)
    print(attempt, dist.get_world_size(), t.tolist(), os.environ.get("MASTER_PORT"))
    initialize.shutdown()
'''


def test_a_world_of_one_needs_no_rendezvous_port_and_starts_again_after_shutdown():
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["1 1 [1.0, 1.0] None", "2 1 [1.0, 1.0] None"]
