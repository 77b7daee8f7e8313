"""torchrun worker for the launcher's retry test: rank 0 notes each start in ``STARTS_FILE``
and, on the first start only, raises ``FAILURE`` (by default the message gloo gives when a peer
closes a connection while a group is being set up, as a CI run printed it); on a later start
every rank reports its rank."""
import os
import pathlib

from mpu_lab import launcher

GLOO = ("RuntimeError: Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/"
        "tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:16536")


@launcher.entrypoint
def main():
    rank = int(os.environ["RANK"])
    starts = pathlib.Path(os.environ["STARTS_FILE"])
    if rank == 0:
        first = not starts.exists()
        with starts.open("a") as f:
            f.write("start\n")
        if first:
            raise RuntimeError(os.environ.get("FAILURE", GLOO))
    launcher.report({"rank": rank})


if __name__ == "__main__":
    main()
