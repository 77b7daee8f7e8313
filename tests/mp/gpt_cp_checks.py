"""torchrun worker: train_gpt.py's training under context parallelism against the TP=1, CP=1
run and its dense twin, and a checkpoint saved at CP=2 resumed at CP=1, in one 4-rank job.

    torchrun --standalone --nproc-per-node 4 tests/mp/gpt_cp_checks.py CHECKPOINT_DIR

Each configuration re-initialises the groups in the same processes (one launch instead of
many) and trains through the functions launch/train_gpt.py calls (parse_args, validate_args,
setup, train). Every rank reports a dict; tests/models/test_gpt_context_parallel_mp.py asserts
on it.
"""
import sys
import time
import traceback

import torch
import torch.distributed as dist

from mpu_lab.training import checkpointing, initialize
from mpu_lab import launcher, training
from mpu_lab.core import parallel_state
from mpu_lab.training.plain_gpt import PlainGPT

ITERS = 8
BASE = ["--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4, "--seq-length", 32,
        "--global-batch-size", 8, "--vocab-size", 256, "--make-vocab-size-divisible-by", 64,
        "--lr", 3e-3, "--min-lr", 3e-4, "--lr-warmup-iters", 2, "--train-iters", ITERS,
        "--log-interval", 1, "--quiet"]
# name -> flags; the global batch is 8 everywhere, DP = 4 / (TP x CP x PP). The reference is
# the first: TP = 1, CP = 1 (DP = 4).
CONFIGS = {
    "tp1_cp1": ["--micro-batch-size", 2],
    "cp2": ["--context-parallel-size", 2, "--micro-batch-size", 2],           # DP 2, 2 micro-batches
    "cp4": ["--context-parallel-size", 4, "--micro-batch-size", 8],
    "tp2_cp2": ["--tensor-model-parallel-size", 2, "--context-parallel-size", 2,
                "--micro-batch-size", 4],
    "cp2_pp2": ["--context-parallel-size", 2, "--pipeline-model-parallel-size", 2,
                "--micro-batch-size", 4],                                      # 1F1B, 2 micro-batches
    "cp2_allgather_distopt": ["--context-parallel-size", 2, "--cp-comm-type", "allgather",
                              "--micro-batch-size", 4, "--use-distributed-optimizer"],
    "cp4_a2a": ["--context-parallel-size", 4, "--cp-comm-type", "a2a", "--micro-batch-size", 8],
    "tp2_cp2_sp_a2a": ["--tensor-model-parallel-size", 2, "--context-parallel-size", 2,
                       "--sequence-parallel", "--cp-comm-type", "a2a", "--micro-batch-size", 8],
}


def args_for(flags, *extra):
    args = training.parse_args(BASE + list(flags) + list(extra))
    return training.validate_args(args, dist.get_world_size())


def gathered_weights(state):
    pipeline = state.args.pipeline_model_parallel_size > 1
    return checkpointing.gather_model_state_dict(state.model_chunks if pipeline else state.model,
                                                 pipeline=pipeline)


def same(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def training_equality(out):
    reference = None
    for name, flags in CONFIGS.items():
        t0 = time.perf_counter()
        try:
            args = args_for(flags)
            state = training.setup(args, log=lambda s: None)
            weights = gathered_weights(state)
            if reference is None:
                reference = weights
                twin = PlainGPT.from_config(training.model_config(args), args.padded_vocab_size,
                                            args.max_position_embeddings)
                twin.load_state_dict(weights)
                out["dense_losses"] = training.train_dense_twin(args, twin, args.train_iters)
            metrics = training.train(state, log=lambda s: None)
            out["runs"][name] = dict(
                ok=True, losses=[m["lm_loss"] for m in metrics],
                same_initial_weights=same(weights, reference) if dist.get_rank() == 0 else None,
                sizes=dict(tp=parallel_state.get_tensor_model_parallel_world_size(),
                           cp=parallel_state.get_context_parallel_world_size(),
                           pp=parallel_state.get_pipeline_model_parallel_world_size(),
                           dp=parallel_state.get_data_parallel_world_size(),
                           dp_cp=parallel_state.get_data_parallel_world_size(
                               with_context_parallel=True)),
                micro_batches=args.num_micro_batches)
        except Exception as exc:   # report and stop: a peer may be stuck in a collective
            out["runs"][name] = dict(ok=False, error=repr(exc), traceback=traceback.format_exc())
            raise
        out["seconds"][name] = round(time.perf_counter() - t0, 2)


def resume_at_cp1(out, ckpt_dir):
    """CP=2 (DP=2) with the distributed optimizer (Adam states sharded over DP x CP = 4):
    5 iterations, save, 3 more (the reference); then CP=1 (DP=4, plain AdamW) from the
    checkpoint for the same 3."""
    args = args_for(CONFIGS["cp2"], "--use-distributed-optimizer")
    state = training.setup(args, log=lambda s: None)
    training.train(state, train_iters=5, log=lambda s: None)
    batch = training.get_batch(state, 0, 0)
    out["cp_positions"] = batch["position_ids"][0].tolist()
    with torch.no_grad():   # the model's default positions follow the layout too
        given = state.model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
        default = state.model(batch["tokens"], labels=batch["labels"])
    out["default_positions_equal"] = torch.equal(given, default)
    saved = gathered_weights(state)
    checkpointing.save_checkpoint(ckpt_dir, state)
    out["resume_reference"] = [m["lm_loss"] for m in training.train(state, log=lambda s: None)]
    args = args_for(CONFIGS["tp1_cp1"], "--load", ckpt_dir)
    state = training.setup(args, log=lambda s: None)
    out["loaded_iteration"] = state.iteration
    loaded = gathered_weights(state)
    out["loaded_identical"] = same(loaded, saved) if dist.get_rank() == 0 else None
    out["resumed"] = [m["lm_loss"] for m in training.train(state, log=lambda s: None)]


@launcher.entrypoint
def main():
    t_start = time.perf_counter()
    initialize.init()
    out = {"rank": dist.get_rank(), "runs": {},
           "seconds": {"init": round(time.perf_counter() - t_start, 2)}}
    try:
        training_equality(out)
        t0 = time.perf_counter()
        resume_at_cp1(out, sys.argv[1])
        out["seconds"]["resume"] = round(time.perf_counter() - t0, 2)
    finally:
        launcher.report(out)
    initialize.shutdown()


if __name__ == "__main__":
    main()
