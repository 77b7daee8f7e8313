"""torchrun worker: GPT training with pipeline parallelism against the TP=1/PP=1 run, and
checkpoints resharded across pipeline sizes, in one 8-rank job.

    torchrun --standalone --nproc-per-node 8 tests/mp/gpt_pipeline_checks.py CHECKPOINT_DIR METRICS

Every configuration re-initialises the groups in the same processes (one launch instead of
many): PP=4 x DP=2 and TP=2 x PP=2 x DP=2 with GPipe, 1F1B and interleaved (v=2), 6 iterations
each at the same global batch, against the TP=1/PP=1 reference — the one-process twin
(PlainGPT) trained by rank 0 on the weights GPTModel gets at TP=1/PP=1 (the DP and TP runs of
tests/models/test_gpt_mp.py equal that twin; one process is much cheaper here than 8 ranks of DDP on
two cores). Then a TP=2 x PP=2 checkpoint loaded at PP=1 (TP=1, DP=8, torch DDP) and at PP=4.
Every rank reports a dict; tests/models/test_gpt_pipeline_mp.py asserts.
"""
import sys
import time

import torch
import torch.distributed as dist

from mpu_lab.training import checkpointing, initialize
from mpu_lab import launcher, training
from mpu_lab.core import parallel_state
from mpu_lab.training.plain_gpt import PlainGPT
from mpu_lab.core.models.gpt import build_model_chunks
from mpu_lab.perf.pipeline_timeline import ScheduleRecorder
from mpu_lab.core.tensor_parallel import model_parallel_manual_seed

ITERS = 6
BASE = ["--num-layers", 8, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 16,
        "--micro-batch-size", 2, "--global-batch-size", 16, "--vocab-size", 128,
        "--make-vocab-size-divisible-by", 32, "--lr", 3e-3, "--min-lr", 3e-4,
        "--lr-warmup-iters", 2, "--train-iters", ITERS, "--log-interval", 1, "--quiet"]
# name -> (TP, PP, extra flags). DP = 8 / (TP x PP); micro-batches per replica = 16 / (2 x DP).
CONFIGS = {
    "pp4_gpipe": (1, 4, ["--pipeline-schedule", "gpipe"]),
    "pp4_1f1b": (1, 4, ["--pipeline-schedule", "1f1b"]),
    "pp4_interleaved": (1, 4, ["--num-layers-per-virtual-pipeline-stage", 1]),
    "tp2pp2_gpipe": (2, 2, ["--pipeline-schedule", "gpipe"]),
    "tp2pp2_1f1b_sp": (2, 2, ["--pipeline-schedule", "1f1b", "--sequence-parallel"]),
    "tp2pp2_interleaved": (2, 2, ["--pipeline-schedule", "interleaved",
                                  "--num-layers-per-virtual-pipeline-stage", 2]),
}
SAVE_AT = 3


def args_for(tp, pp, extra=(), *more):
    argv = BASE + ["--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp]
    args = training.parse_args(argv + list(extra) + list(more))
    return training.validate_args(args, dist.get_world_size())


def same(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def where(state):
    return dict(pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                dp_rank=parallel_state.get_data_parallel_rank(),
                chunks=len(state.model_chunks),
                layers=[[layer.layer_number for layer in c.decoder.layers] for c in state.model_chunks],
                pre_post=[[c.pre_process, c.post_process] for c in state.model_chunks])


def reference(out):
    """TP=1/PP=1: GPTModel's initial weights (same seed as training.setup), and on rank 0 the
    one-process twin's losses and gradient norms over the same batches."""
    args = args_for(1, 1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(args.seed)
    (model,) = build_model_chunks(training.model_config(args), args.padded_vocab_size,
                                  args.max_position_embeddings)
    weights = checkpointing.gather_model_state_dict(model)
    if dist.get_rank() == 0:
        twin = PlainGPT.from_config(training.model_config(args), args.padded_vocab_size,
                                    args.max_position_embeddings)
        twin.load_state_dict(weights)
        norms = []
        out["losses"]["ref"] = training.train_dense_twin(args, twin, ITERS, grad_norms=norms)
        out["grad_norms"]["ref"] = norms
    dist.barrier()
    return weights


def training_equality(out, metrics_file):
    reference_weights = reference(out)
    for name, (tp, pp, extra) in CONFIGS.items():
        more = ["--metrics-file", metrics_file] if name == "tp2pp2_1f1b_sp" else []
        args = args_for(tp, pp, extra, *more)
        t0 = time.perf_counter()
        state = training.setup(args, log=lambda s: None)
        weights = checkpointing.gather_model_state_dict(state.model, pipeline=True)
        out["seconds"][name + "_setup"] = round(time.perf_counter() - t0, 2)
        out["same_initial_weights"][name] = same(weights, reference_weights)
        out["embedding_copies_equal"][name] = _embedding_copies_equal(state)
        # The timeline of the last iteration, watched from outside with hooks on the chunks.
        recorder = ScheduleRecorder(state.model_chunks, args.num_micro_batches,
                                    args.pipeline_schedule)
        metrics = training.train(state, log=lambda s: None)
        recorder.remove()
        out["losses"][name] = [m["lm_loss"] for m in metrics]
        out["grad_norms"][name] = [m["grad_norm"] for m in metrics]
        out["setup"][name] = dict(where(state), dp=args.data_parallel_size,
                                  m=args.num_micro_batches, schedule=args.pipeline_schedule,
                                  vpp=args.virtual_pipeline_model_parallel_size)
        out["timeline"][name] = recorder.report()
        out["seconds"][name] = round(time.perf_counter() - t0, 2)
        out["metric_keys"] = sorted(metrics[0])


def _embedding_copies_equal(state):
    """The last stage's copy of the tied embedding equals the first stage's."""
    from mpu_lab.core.pipeline_parallel import shared_embedding_or_output_weight
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return True
    if not parallel_state.is_rank_in_embedding_group():
        return True
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    chunk = state.model_chunks[0] if first else state.model_chunks[-1]
    w = shared_embedding_or_output_weight(chunk).detach()
    group = parallel_state.get_embedding_group()
    parts = [torch.empty_like(w) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, w.contiguous(), group=group)
    return all(torch.equal(parts[0], t) for t in parts)


def resharding(out, ckpt_dir):
    # Uninterrupted TP=2 x PP=2 (1F1B) run: SAVE_AT iterations, save, the rest.
    args = args_for(2, 2, ["--pipeline-schedule", "1f1b"])
    state = training.setup(args, log=lambda s: None)
    training.train(state, train_iters=SAVE_AT, log=lambda s: None)
    saved = checkpointing.gather_model_state_dict(state.model, pipeline=True)
    path = checkpointing.save_checkpoint(ckpt_dir, state)
    out["saved_path"] = str(path)
    out["resume_reference"] = [m["lm_loss"] for m in training.train(state, log=lambda s: None)]
    for name, (tp, pp, extra) in {"tp1pp1": (1, 1, []),
                                  "pp4_interleaved": (1, 4, ["--num-layers-per-virtual-pipeline-stage", 1])}.items():
        args = args_for(tp, pp, extra, "--load", ckpt_dir)
        state = training.setup(args, log=lambda s: None)
        loaded = checkpointing.gather_model_state_dict(state.model, pipeline=True)
        out["loaded_iteration"][name] = state.iteration
        out["loaded_identical"][name] = same(loaded, saved)
        out["loaded_embedding_copies_equal"][name] = _embedding_copies_equal(state)
        out["resumed"][name] = [m["lm_loss"] for m in training.train(state, log=lambda s: None)]


def checks(ckpt_dir, metrics_file, out=None):
    """Every check above, in a world of 8 ranks already initialised; returns this rank's dict
    (also run by tests/mp/eight_rank_checks.py, next to the other 8-rank checks)."""
    out = {"rank": dist.get_rank(), "seconds": {}} if out is None else out
    for key in ("same_initial_weights", "embedding_copies_equal", "losses", "grad_norms", "setup",
                "timeline", "loaded_iteration", "loaded_identical", "loaded_embedding_copies_equal",
                "resumed"):
        out[key] = {}
    for name, phase in [("training_equality", lambda o: training_equality(o, metrics_file)),
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
    launcher.report(checks(sys.argv[1], sys.argv[2], out))
    initialize.shutdown()


if __name__ == "__main__":
    main()
