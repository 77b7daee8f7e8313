"""torchrun worker: train_gpt.py's training with mixture-of-experts MLPs under expert
parallelism against the EP=1 run of the same flags, in one 4-rank job.

    torchrun --standalone --nproc-per-node 4 tests/mp/gpt_moe_checks.py CHECKPOINT_DIR

Each configuration re-initialises the groups in the same processes and trains through the
functions launch/train_gpt.py calls (parse_args, validate_args, setup, train). Every rank
reports a dict; tests/models/moe/test_gpt_moe_mp.py asserts on it (and compares the EP=1 run with a
one-process run of train_gpt.py, which has no data or expert parallelism at all). Then a
checkpoint saved at EP=2 (distributed optimizer) is resumed at EP=4, EP=1, TP=2 x EP=2 with
etp=2 and EP=2 x PP=2 (distributed optimizer).
"""
import sys
import time
import traceback

import torch.distributed as dist

from mpu_lab.training import checkpointing, initialize
from mpu_lab import launcher, training
from mpu_lab.core import parallel_state

ITERS = 5            # the fewest where test_losses_learn holds (iteration 4 is not yet 0.05 down)
BASE = ["--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 16,
        "--global-batch-size", 8, "--vocab-size", 256, "--make-vocab-size-divisible-by", 64,
        "--lr", 3e-3, "--min-lr", 3e-4, "--lr-warmup-iters", 2, "--train-iters", ITERS,
        "--log-interval", 1, "--quiet", "--num-experts", 4, "--moe-router-topk", 2]
# name -> (reference name, flags). Global batch 8 everywhere; DP = 4 / (TP x PP).
CONFIGS = {
    "ep1": (None, ["--micro-batch-size", 2]),
    "ep2": ("ep1", ["--expert-model-parallel-size", 2, "--micro-batch-size", 2]),
    "ep4": ("ep1", ["--expert-model-parallel-size", 4, "--micro-batch-size", 1]),
    "ep4_allgather": ("ep1", ["--expert-model-parallel-size", 4, "--micro-batch-size", 2,
                              "--moe-token-dispatcher-type", "allgather"]),
    "tp2_sp_ep2": ("ep1", ["--tensor-model-parallel-size", 2, "--sequence-parallel",
                           "--expert-model-parallel-size", 2, "--micro-batch-size", 2]),
    "tp2_sp_ep2_etp1": ("ep1", ["--tensor-model-parallel-size", 2, "--sequence-parallel",
                                "--expert-model-parallel-size", 2,
                                "--expert-tensor-parallel-size", 1, "--micro-batch-size", 4]),
    "ep2_pp2": ("ep1", ["--pipeline-model-parallel-size", 2, "--expert-model-parallel-size", 2,
                        "--micro-batch-size", 2]),
    # Megatron's data parallelism: a second gradient buffer for the experts, over expert-DP
    "ep2_distopt": ("ep1", ["--expert-model-parallel-size", 2, "--micro-batch-size", 1,
                            "--use-distributed-optimizer", "--overlap-grad-reduce",
                            "--ddp-bucket-size", 5000]),
    "tp2_sp_ep2_etp1_distopt": ("ep1", ["--tensor-model-parallel-size", 2, "--sequence-parallel",
                                        "--expert-model-parallel-size", 2,
                                        "--expert-tensor-parallel-size", 1,
                                        "--micro-batch-size", 2, "--use-distributed-optimizer"]),
    "ep4_overlap": ("ep1", ["--expert-model-parallel-size", 4, "--micro-batch-size", 2,
                            "--overlap-grad-reduce"]),
    "ep2_pp2_distopt": ("ep1", ["--pipeline-model-parallel-size", 2,
                                "--expert-model-parallel-size", 2, "--micro-batch-size", 2,
                                "--use-distributed-optimizer"]),
    # the load-balancing loss and top-1 routing depend on which tokens a rank routes together:
    # compared with the EP=1 run of the same data-parallel layout
    "ep1_aux_top1": (None, ["--micro-batch-size", 2, "--moe-aux-loss-coeff", 0.1,
                            "--moe-router-topk", 1, "--moe-router-pre-softmax"]),
    "ep4_aux_top1": ("ep1_aux_top1", ["--micro-batch-size", 2, "--moe-aux-loss-coeff", 0.1,
                                      "--moe-router-topk", 1, "--moe-router-pre-softmax",
                                      "--expert-model-parallel-size", 4]),
}


def args_for(flags):
    args = training.parse_args(BASE + list(flags))
    return training.validate_args(args, dist.get_world_size())


def training_runs(out):
    for name, (_, flags) in CONFIGS.items():
        t0 = time.perf_counter()
        try:
            args = args_for(flags)
            state = training.setup(args, log=lambda s: None)
            metrics = training.train(state, log=lambda s: None)
            out["runs"][name] = dict(
                ok=True, losses=[m["lm_loss"] for m in metrics],
                grad_norms=[m["grad_norm"] for m in metrics],
                load_balancing=[m.get("load_balancing_loss") for m in metrics],
                sizes=dict(tp=parallel_state.get_tensor_model_parallel_world_size(),
                           pp=parallel_state.get_pipeline_model_parallel_world_size(),
                           dp=parallel_state.get_data_parallel_world_size(),
                           ep=parallel_state.get_expert_model_parallel_world_size(),
                           etp=parallel_state.get_expert_tensor_parallel_world_size(),
                           edp=parallel_state.get_expert_data_parallel_world_size()),
                micro_batches=args.num_micro_batches)
        except Exception as exc:   # report and stop: a peer may be stuck in a collective
            out["runs"][name] = dict(ok=False, error=repr(exc), traceback=traceback.format_exc())
            raise
        out["seconds"][name] = round(time.perf_counter() - t0, 2)


RESUMES = ("ep4", "ep1", "tp2_sp_ep2", "ep2_pp2_distopt")


def resume_at_other_ep(out, ckpt_dir):
    """EP=2 with the distributed optimizer (expert Adam states sharded over expert-DP = 2):
    3 iterations, save, 2 more (the reference); then each of RESUMES from the checkpoint for
    the same 2 (weights, Adam moments and the schedule read back, the experts under their
    global numbers: the second step's loss depends on the restored moments)."""
    args = args_for(CONFIGS["ep2_distopt"][1])
    state = training.setup(args, log=lambda s: None)
    training.train(state, train_iters=3, log=lambda s: None)
    checkpointing.save_checkpoint(ckpt_dir, state)
    out["resume_reference"] = [m["lm_loss"] for m in training.train(state, log=lambda s: None)]
    out["resumed"] = {}
    for name in RESUMES:
        args = args_for(CONFIGS[name][1] + ["--load", ckpt_dir])
        state = training.setup(args, log=lambda s: None)
        out["resumed"][name] = dict(iteration=state.iteration, losses=[
            m["lm_loss"] for m in training.train(state, log=lambda s: None)])


@launcher.entrypoint
def main():
    t_start = time.perf_counter()
    initialize.init()
    out = {"rank": dist.get_rank(), "runs": {},
           "references": {name: ref for name, (ref, _) in CONFIGS.items()},
           "flags": {name: [str(f) for f in BASE + flags] for name, (_, flags) in CONFIGS.items()},
           "seconds": {"init": round(time.perf_counter() - t_start, 2)}}
    try:
        training_runs(out)
        t0 = time.perf_counter()
        resume_at_other_ep(out, sys.argv[1])
        out["seconds"]["resume"] = round(time.perf_counter() - t0, 2)
    finally:
        launcher.report(out)
    initialize.shutdown()


if __name__ == "__main__":
    main()
