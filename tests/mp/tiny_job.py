"""The cheapest torchrun worker (no torch import): connect to the rendezvous store torchrun
started for this job (``MASTER_ADDR:MASTER_PORT``) and report the port.

Used by the reliability tests to start many jobs quickly (two at once, 20 back to back): a
port collision between jobs shows as a failed connection or a rendezvous error.
"""
import os
import socket

from mpu_lab import launcher   # standard library only at import time


def main():
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    with socket.create_connection((host, port), timeout=10):
        pass
    launcher.report({"rank": int(os.environ["RANK"]), "port": port, "pid": os.getpid(),
                   "run_id": os.environ.get("TORCHELASTIC_RUN_ID")})


if __name__ == "__main__":
    main()
