"""Every rank builds Megatron's process groups and says which groups it is in (lab 01).

    torchrun --standalone --nproc-per-node 8 launch/rank_groups.py --tp 2 --pp 2
    torchrun --standalone --nproc-per-node 8 launch/rank_groups.py --tp 2 --ep 2   # + experts

From a notebook: ``mpu_lab.launcher.run("rank_groups.py", ["--tp", 2, "--pp", 2], nproc=8)``.

Each rank calls ``initialize_model_parallel`` (every rank creates every group, as
``torch.distributed.new_group`` requires), prints one line with its coordinates and its
tensor / data / pipeline groups, then all-reduces its own rank number over each of those three
groups: the sums prove the process groups really connect those ranks. With experts split
(``--ep`` > 1 or ``--etp`` other than ``--tp``) the line also shows the expert-model-parallel
and expert-data-parallel groups, all-reduced the same way. It reports
``parallel_state.describe()`` plus the sums to :func:`mpu_lab.launcher.report`.
"""
import torch

from mpu_lab.core import comm
from mpu_lab.training import initialize
from mpu_lab import launcher
from mpu_lab.core import parallel_state as ps
from mpu_lab.training.rank_groups_args import parse_and_check_args

# Checked by the launcher before torchrun starts (read from this source, not imported).
PRECHECK = "mpu_lab.training.rank_groups_args:check_rank_groups_args"

FAMILIES = {"tp": ps.get_tensor_model_parallel_group, "dp": ps.get_data_parallel_group,
            "pp": ps.get_pipeline_model_parallel_group}
EXPERT_FAMILIES = {"ep": ps.get_expert_model_parallel_group,
                   "expert-dp": ps.get_expert_data_parallel_group}


def parse_args(argv=None):
    """The flags, checked for the world torchrun launched: a configuration that cannot work is
    refused here, before any process group starts (one message, on rank 0; exit status 2)."""
    return parse_and_check_args(argv, description=__doc__.splitlines()[0])


@launcher.entrypoint
def main(argv=None):
    args = parse_args(argv)
    initialize.init()   # backend: MPU_LAB_BACKEND (auto, gloo, nccl)
    ps.initialize_model_parallel(args.tp, args.pp, args.cp, order=args.order,
                                 expert_model_parallel_size=args.ep,
                                 expert_tensor_parallel_size=args.etp)
    info = ps.describe()
    experts = args.ep > 1 or (args.etp is not None and args.etp != args.tp)
    families = dict(FAMILIES, **(EXPERT_FAMILIES if experts else {}))
    sums = {}
    for name, get_group in families.items():
        mine = torch.tensor([float(info["rank"])], device=initialize.get_device())
        sums[name] = int(comm.all_reduce(mine, group=get_group()).item())
    groups = info["groups"]
    print(f"rank {info['rank']}: tp_rank {info['tp_rank']}, dp_rank {info['dp_rank']}, "
          f"pp_rank {info['pp_rank']} | tp {groups['tp']} dp {groups['dp']} pp {groups['pp']} "
          f"| all-reduce of ranks over tp {sums['tp']}, dp {sums['dp']}, pp {sums['pp']}"
          + (f" | ep_rank {info['ep_rank']}: ep {groups['ep']} expert-dp {groups['expert-dp']}"
             f", sums {sums['ep']}, {sums['expert-dp']}" if experts else ""))
    launcher.report(dict(info, sums=sums))
    initialize.shutdown()


if __name__ == "__main__":
    main()
