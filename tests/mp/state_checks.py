"""torchrun worker: real process groups from initialize_model_parallel vs the pure math.

    torchrun --standalone --nproc-per-node 8 tests/mp/state_checks.py

For each configuration every rank reports its groups (as seen through the getters and
through torch.distributed's own view of each process group), then an all-reduce over each
group proves the group really connects those ranks.
"""
import torch
import torch.distributed as dist


from mpu_lab.training import initialize
from mpu_lab import launcher
from mpu_lab.core import parallel_state as ps

CONFIGS = [dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=2),
           dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4),
           dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2),
           # experts split 4 ways, each whole (etp 1): expert-dp [[0, 4], ...] is not dense dp
           dict(tensor_model_parallel_size=2, expert_model_parallel_size=4,
                expert_tensor_parallel_size=1)]


def probe(cfg):
    ps.initialize_model_parallel(**cfg)
    rank = dist.get_rank()
    out = ps.describe()
    getters = {
        "tp": ps.get_tensor_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group(),
        "dp": ps.get_data_parallel_group(), "cp": ps.get_context_parallel_group(),
        "tp-pp": ps.get_model_parallel_group(),
        "ep": ps.get_expert_model_parallel_group(), "expert-tp": ps.get_expert_tensor_parallel_group(),
        "expert-tp-ep": ps.get_expert_tensor_and_model_parallel_group(),
        "expert-dp": ps.get_expert_data_parallel_group(),
    }
    if ps.is_rank_in_embedding_group():
        getters["embedding"] = ps.get_embedding_group()
    out["torch_group_ranks"] = {k: dist.get_process_group_ranks(g) for k, g in getters.items()}
    # sum of global ranks over each group, computed by a real collective
    out["group_sums"] = {}
    for k, g in getters.items():
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=g)
        out["group_sums"][k] = t.item()
    out["sizes"] = {"tp": ps.get_tensor_model_parallel_world_size(),
                    "pp": ps.get_pipeline_model_parallel_world_size(),
                    "dp": ps.get_data_parallel_world_size(),
                    "cp": ps.get_context_parallel_world_size(),
                    "ep": ps.get_expert_model_parallel_world_size(),
                    "etp": ps.get_expert_tensor_parallel_world_size(),
                    "edp": ps.get_expert_data_parallel_world_size()}
    out["expert_ranks"] = {"ep": ps.get_expert_model_parallel_rank(),
                           "expert-tp": ps.get_expert_tensor_parallel_rank(),
                           "expert-dp": ps.get_expert_data_parallel_rank()}
    out["first"], out["last"] = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    out["next"], out["prev"] = ps.get_pipeline_model_parallel_next_rank(), ps.get_pipeline_model_parallel_prev_rank()
    out["src"] = ps.get_tensor_model_parallel_src_rank()
    ps.destroy_model_parallel()
    out["initialized_after_destroy"] = ps.model_parallel_is_initialized()
    return out


@launcher.entrypoint
def main():
    initialize.init()
    launcher.report([probe(cfg) for cfg in CONFIGS])
    initialize.shutdown()


if __name__ == "__main__":
    main()
