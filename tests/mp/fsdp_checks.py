"""torchrun worker: Megatron-FSDP's four sharding strategies (mpu_lab.core.distributed.fsdp,
``--use-megatron-fsdp --data-parallel-sharding-strategy S``) against plain data parallelism
(torch DDP and AdamW, itself held to the dense twin in tests/models/test_gpt_mp.py).

    torchrun --standalone --nproc-per-node 4 tests/mp/fsdp_checks.py four CHECKPOINT_DIR
    torchrun --standalone --nproc-per-node 2 tests/mp/fsdp_checks.py two CHECKPOINT_DIR

``four``: each strategy at DP = 4 (a model whose MLP width, 129, leaves each layer's flat
buffer 3 elements short of a multiple of 4: padding) and at TP = 2 x DP = 2: the losses of 3
steps (and ZeRO-3 with full recomputation at DP = 4), the whole parameters after them, rank
0's resident bytes (the metrics file's fields),
and the collectives of the third step seen by ``CommDebugMode`` (kind, group, input bytes);
then a checkpoint saved under ``optim_grads_params`` at DP = 4 after 3 steps, and the 4th
and 5th steps' losses of the same run (the 5th depends on the Adam states restored). ``two``: the same equality at DP = 2, and that checkpoint resumed
under ``no_shard`` and under ``optim_grads_params`` at DP = 2.
Every rank reports; tests/distributed/fsdp/test_megatron_fsdp.py asserts on rank 0's report.
"""
import sys

import torch.distributed as dist

from mpu_lab import launcher, training
from mpu_lab.core import parallel_state
from mpu_lab.core.distributed.fsdp import unsharded_parameters
from mpu_lab.perf.comm_counts import CollectiveLog
from mpu_lab.training import initialize
from mpu_lab.training.checkpointing.consolidate import gather_model_state_dict

BASE = ["--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 16,
        "--micro-batch-size", 2, "--global-batch-size", 8, "--vocab-size", 128,
        "--make-vocab-size-divisible-by", 32, "--lr", 3e-3, "--min-lr", 3e-4,
        "--lr-warmup-iters", 1, "--lr-decay-iters", 10, "--train-iters", 3, "--log-interval", 1,
        "--quiet"]
ODD_MLP = ["--ffn-hidden-size", 129]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", 1]
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def fsdp(strategy):
    return ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]


def _args(*extra):
    args = training.parse_args([str(a) for a in BASE + list(extra)])
    return training.validate_args(args, dist.get_world_size())


def _full_params(state):
    """The whole TP=1 parameters (on every rank), gathered from the shards."""
    with unsharded_parameters(state.ddp_chunks):
        return gather_model_state_dict(state.model)


def _collectives(log):
    """``[kind, group ranks, input bytes]`` of every collective the log saw."""
    return [[e["kind"], e["group"], e["bytes"]] for e in log.events]


def _run(*flags):
    """3 steps, the third inside CommDebugMode; the run's report and its state."""
    state = training.setup(_args(*flags), log=lambda s: None)
    metrics = training.train(state, train_iters=2, log=lambda s: None)
    with CollectiveLog() as log:
        metrics += training.train(state, log=lambda s: None)
    return state, dict(losses=[m["lm_loss"] for m in metrics],
                       resident={k: metrics[-1][k] for k in
                                 ("param_bytes", "grad_bytes", "optimizer_state_bytes")},
                       collectives=_collectives(log),
                       data_parallel_group=dist.get_process_group_ranks(
                           parallel_state.get_data_parallel_group()))


def equality(layouts):
    out = {}
    for layout, flags in layouts.items():
        state, plain = _run(*flags)
        reference = _full_params(state)
        rows = {"plain": plain}
        for strategy in STRATEGIES:
            state, row = _run(*flags, *fsdp(strategy))
            params = _full_params(state)
            row["max_param_diff"] = max(float((params[k] - reference[k]).abs().max())
                                        for k in reference)
            row["param_names_equal"] = sorted(params) == sorted(reference)
            rows[strategy] = row
        if layout == "dp4":        # ZeRO-3 with whole layers recomputed in backward
            state, row = _run(*flags, *fsdp("optim_grads_params"), *RECOMPUTE)
            params = _full_params(state)
            row["max_param_diff"] = max(float((params[k] - reference[k]).abs().max())
                                        for k in reference)
            rows["optim_grads_params_recompute"] = row
        out[layout] = rows
    return out


def save_under_zero3(root):
    """3 steps under optim_grads_params at DP = 4, saved; then the same run's steps 4 and 5."""
    args = _args(*ODD_MLP, *fsdp("optim_grads_params"), "--save", root)
    state = training.setup(args, log=lambda s: None)
    training.train(state, log=lambda s: None)        # saves at iteration 3
    state.args.save = None
    following = training.train(state, train_iters=5, log=lambda s: None)
    return dict(iterations=[m["iteration"] for m in following],
                losses=[m["lm_loss"] for m in following])


def resume(root):
    out = {}
    for strategy in ("no_shard", "optim_grads_params"):
        state = training.setup(_args(*ODD_MLP, *fsdp(strategy), "--load", root,
                                     "--train-iters", 5), log=lambda s: None)
        metrics = training.train(state, log=lambda s: None)
        out[strategy] = dict(iterations=[m["iteration"] for m in metrics],
                             losses=[m["lm_loss"] for m in metrics])
    return out


def checks(part, root):
    if part == "four":
        out = equality({"dp4": ODD_MLP, "tp2_dp2": ["--tensor-model-parallel-size", 2]})
        out["zero3_saved"] = save_under_zero3(root)
    else:
        out = equality({"dp2": ODD_MLP})
        out["resumed"] = resume(root)
    return out


@launcher.entrypoint
def main():
    initialize.init()
    launcher.report(checks(sys.argv[1], sys.argv[2]))
    initialize.shutdown()


if __name__ == "__main__":
    main()
