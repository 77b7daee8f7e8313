"""torchrun worker: GPTModel at TP=1/2/4 (+-sequence parallel, DP) against its dense twin,
the collective count, the shape table, and checkpoint resharding, in one 4-rank job.

    torchrun --standalone --nproc-per-node 4 tests/mp/gpt_checks.py CHECKPOINT_DIR

Each configuration re-initialises the groups in the same processes (one launch instead of
many). Every rank reports a dict; tests/models/test_gpt_mp.py asserts on them.
"""
import hashlib
import sys
import time

import torch
import torch.distributed as dist

from mpu_lab.training import checkpointing, initialize
from mpu_lab import launcher, training
from mpu_lab.core import parallel_state
from mpu_lab.training.plain_gpt import PlainGPT
from mpu_lab.perf.layer_shapes import shape_table
from mpu_lab.perf.comm_counts import count_collectives, per_layer_counts

BASE = ["--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4, "--seq-length", 32,
        "--micro-batch-size", 2, "--global-batch-size", 8, "--vocab-size", 256,
        "--make-vocab-size-divisible-by", 64, "--lr", 3e-3, "--min-lr", 3e-4,
        "--lr-warmup-iters", 2, "--train-iters", 12, "--log-interval", 1, "--quiet"]
# (TP, sequence parallel, micro batch size): the global batch is 8 everywhere; at 4 ranks
# DP = 4 / TP. TP=2 without SP accumulates 2 micro-batches per step, the dense twin 4; the
# others take one micro-batch per step (collectives are what costs time on 2 shared cores).
CONFIGS = [(1, False, 2), (2, False, 2), (2, True, 4), (4, False, 8), (4, True, 8)]


def args_for(tp, sp, *extra):
    argv = BASE + ["--tensor-model-parallel-size", tp] + (["--sequence-parallel"] if sp else [])
    args = training.parse_args(argv + list(extra))
    return training.validate_args(args, dist.get_world_size())


def digest(sd):
    return {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest() for k, v in sd.items()}


def same(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def training_equality(out):
    reference_weights = None
    for tp, sp, mbs in CONFIGS:
        args = args_for(tp, sp, "--micro-batch-size", mbs)
        state = training.setup(args, log=lambda s: None)
        weights = checkpointing.gather_model_state_dict(state.model)
        if reference_weights is None:
            reference_weights = weights
            twin = PlainGPT.from_config(training.model_config(args), args.padded_vocab_size,
                                        args.max_position_embeddings)
            twin.load_state_dict(weights)
            t0 = time.perf_counter()
            out["dense_losses"] = training.train_dense_twin(args, twin, args.train_iters)
            out["seconds"]["dense"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        key = f"tp{tp}{'_sp' if sp else ''}"
        out.setdefault("same_initial_weights", {})[key] = same(weights, reference_weights)
        metrics = training.train(state, log=lambda s: None)
        out.setdefault("losses", {})[key] = [m["lm_loss"] for m in metrics]
        out.setdefault("dp", {})[key] = args.data_parallel_size
        out.setdefault("micro_batches", {})[key] = args.num_micro_batches
        out["seconds"][key] = round(time.perf_counter() - t0, 2)
        out.setdefault("metric_keys", sorted(metrics[0]))


def collective_counts(out):
    for sp in (False, True):
        args = args_for(2, sp)
        state = training.setup(args, log=lambda s: None)
        batch = training.get_batch(state, 0, 0)
        events = count_collectives(state.model, batch["tokens"], batch["labels"], steps=2)
        key = "sp" if sp else "no_sp"
        out.setdefault("counts", {})[key] = [per_layer_counts(events, 0), per_layer_counts(events, 1)]
        out.setdefault("layer_events", {})[key] = [e for e in events if e["tag"] == "layer0.forward"
                                                   and e["step"] == 0]
    parallel_state.initialize_model_parallel(2)
    out["shape_table_tp2"] = shape_table(2, 8, 16, 4, tensor_model_parallel_size=2)
    parallel_state.initialize_model_parallel(4)
    out["shape_table_tp4"] = shape_table(2, 8, 16, 4, tensor_model_parallel_size=4)


def resharding(out, ckpt_dir):
    # Uninterrupted TP=2 run: 6 iterations, save, 3 more.
    args = args_for(2, True, "--train-iters", 9)
    state = training.setup(args, log=lambda s: None)
    training.train(state, train_iters=6, log=lambda s: None)
    saved = checkpointing.gather_model_state_dict(state.model)
    path = checkpointing.save_checkpoint(ckpt_dir, state)
    out["saved_path"] = str(path)
    out["saved_digest"] = digest(saved)
    out["resume_reference"] = [m["lm_loss"] for m in training.train(state, log=lambda s: None)]
    for tp, sp in [(4, False), (1, False), (2, False)]:
        args = args_for(tp, sp, "--train-iters", 9, "--load", ckpt_dir)
        state = training.setup(args, log=lambda s: None)
        loaded = checkpointing.gather_model_state_dict(state.model)
        key = f"tp{tp}"
        out.setdefault("loaded_iteration", {})[key] = state.iteration
        out.setdefault("loaded_identical", {})[key] = same(loaded, saved)
        out.setdefault("resumed", {})[key] = [m["lm_loss"] for m in
                                              training.train(state, log=lambda s: None)]


def checks(ckpt_dir, out=None):
    """Every check above, in a world of 4 ranks already initialised; returns this rank's dict
    (also run by tests/mp/four_rank_checks.py, next to the other 4-rank checks)."""
    out = {"rank": dist.get_rank(), "seconds": {}} if out is None else out
    for name, phase in [("training_equality", training_equality),
                        ("collective_counts", collective_counts),
                        ("resharding", lambda o: resharding(o, ckpt_dir))]:
        start = time.perf_counter()
        phase(out)
        out["seconds"][name] = round(time.perf_counter() - start, 2)
    return out


@launcher.entrypoint
def main():
    t_start = time.perf_counter()
    initialize.init()
    out = {"rank": dist.get_rank(), "seconds": {"init": round(time.perf_counter() - t_start, 2)}}
    launcher.report(checks(sys.argv[1], out))
    t0 = time.perf_counter()
    initialize.shutdown()
    out["seconds"]["shutdown"] = round(time.perf_counter() - t0, 2)
    launcher.report(out)


if __name__ == "__main__":
    main()
