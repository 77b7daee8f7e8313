"""Train a small GPT with tensor, sequence, context, pipeline, expert and data parallelism
(Megatron-style flags).

    torchrun --standalone --nproc-per-node 4 launch/train_gpt.py \
        --tensor-model-parallel-size 2 --sequence-parallel \
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
        --micro-batch-size 8 --global-batch-size 16 --train-iters 300 \
        --metrics-file runs/metrics.jsonl --save checkpoints/gpt

    # TP x PP x DP = 2 x 2 x 2 on 8 ranks, 1F1B over 4 micro-batches per replica:
    torchrun --standalone --nproc-per-node 8 launch/train_gpt.py \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
        --pipeline-schedule 1f1b --num-layers 4 --micro-batch-size 4 --global-batch-size 32

    # context parallelism: the sequence split over 2 ranks (ring attention), x TP=2 x DP=2:
    torchrun --standalone --nproc-per-node 8 launch/train_gpt.py \
        --context-parallel-size 2 --cp-comm-type p2p --tensor-model-parallel-size 2 \
        --seq-length 128 --micro-batch-size 4 --global-batch-size 8

    # mixture of experts: 8 experts, top-2, spread over 4 ranks (EP=4; the dense parts DP=4):
    torchrun --standalone --nproc-per-node 4 launch/train_gpt.py \
        --num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 4 \
        --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01

    # interleaved 1F1B, 2 model chunks of 1 layer per stage, with each rank's timeline:
    torchrun --standalone --nproc-per-node 2 launch/train_gpt.py \
        --pipeline-model-parallel-size 2 --num-layers 4 \
        --num-layers-per-virtual-pipeline-stage 1 --micro-batch-size 4 \
        --global-batch-size 16 --record-timeline

With the defaults (mock data, 2 layers, hidden 64, 300 iterations) it trains on a laptop CPU
in under a minute and the loss falls from ~6.2 (log 512) to about 1.7 (the mock
data's own entropy is 1.2 nats). From a notebook::

    mpu_lab.launcher.run("train_gpt.py", ["--tensor-model-parallel-size", "2"], nproc=2)

returns every rank's logged metrics (every rank reports the same losses; at PP > 1 the last
stage computes them and sends them to the others). With ``--record-timeline`` each rank also
reports its last iteration's forward/backward records under ``"timeline"``::

    from mpu_lab.perf.pipeline_timeline import measured_bubble, pipeline_records
    from mpu_lab.labkit.pipeline_parallel.viz import plot_gantt
    tl = pipeline_records(job.results)
    plot_gantt(tl["records"], time_unit="ms")
    measured_bubble(tl["records"], tl["num_microbatches"], tl["num_model_chunks"])

(:class:`mpu_lab.perf.pipeline_timeline.ScheduleRecorder` hooks the model chunks from outside;
the schedule itself records nothing.)

With ``--breakdown`` each rank reports where its steps' time went (compute vs each kind of
collective) under ``"breakdown"``: :class:`mpu_lab.perf.breakdown.StepTimer`, a callback of
the training loop, times its steps; ``mpu_lab.perf.breakdown.format_breakdown`` tabulates it::

    from mpu_lab.perf import breakdown
    print(breakdown.format_breakdown(breakdown.breakdowns(job.results)))

``--breakdown-barrier`` books the wait for the slowest peer apart from each collective;
``--breakdown-profile DIR`` also runs the timed steps under ``torch.profiler`` and writes a
Chrome trace per rank to DIR.

Debugging (lab 17): ``--inject-fault KIND[:RANK[:ITERATION]]`` makes one rank misbehave on
purpose (hang, skip-collective, mismatched-shape, wrong-group, crash, pp-deadlock, divergence,
fp16-overflow; ``mpu_lab.training.faults.FAULT_KINDS`` says what each does). The flag and the
injection come from ``mpu_lab.training.faults`` (``add_fault_args``; ``inject``, callbacks the
training loop calls at its hook points); ``MPU_LAB_FAULT_IN_SAVE=RANK:ITERATION`` kills a rank in
the middle of a checkpoint save (``faults.kill_in_save``, the checkpoint writer the loop is
given). ``--dense-twin`` has rank 0 train the dense TP=1 twin
from the run's initial weights too and report its losses, for
``mpu_lab.labkit.debugging.twin_check.compare_with_dense_twin``::

    job = mpu_lab.launcher.run("train_gpt.py", ["--inject-fault", "divergence:1:3",
                               "--dense-twin", "--train-iters", "6", "--log-interval", "1"], nproc=2)
    print(twin_check.compare_with_dense_twin(job))   # "Drifts from the dense twin at iteration 3: ..."

The flags are checked before anything starts (``PRECHECK`` below, which runs
``mpu_lab.training.validate_args`` and checks the fault);
``launch/train_gpt.sh`` shows the lecture's ``GPT_ARGS``. ``--pipeline-schedule`` is this
project's flag (Megatron picks 1F1B, or interleaved when
``--num-layers-per-virtual-pipeline-stage`` is given, and has no GPipe); the default follows
Megatron's rule.
"""
import faulthandler
import os
import pathlib
import sys

from mpu_lab.training import initialize
from mpu_lab import launcher, training
from mpu_lab.training import faults
from mpu_lab.perf import breakdown, pipeline_timeline
from mpu_lab.training.pipeline_timeline_file import PipelineTimelineFile

# Checked by the launcher before torchrun starts (read from this source, not imported).
PRECHECK = "mpu_lab.training.faults:check_launch_args"


def _dump_stacks_on_abort():
    """gloo aborts a rank (SIGABRT, from its C++ thread) when a message has another size than
    the receiver expects: write where every thread of this rank stood next to the launcher's
    SIGTERM dump, so the failure report can say where the aborted rank was."""
    directory = os.environ.get(launcher.RESULT_DIR_ENV)
    if directory:
        path = pathlib.Path(directory) / f"stack_rank{os.environ.get('RANK', '0')}.txt"
        faulthandler.enable(file=open(path, "a"), all_threads=True)


@launcher.entrypoint
def main(argv=None):
    _dump_stacks_on_abort()
    # Check the flags first (pure), for the world torchrun launched: a configuration that
    # cannot work is refused here, before any process group starts (one message, rank 0).
    args = training.arguments.parse_and_validate_args(
        argv, extra_args_provider=faults.add_fault_args, extra_checks=[faults.fault_of])
    fault = faults.fault_of(args)
    initialize.init()
    state = training.setup(args)
    callbacks = faults.inject(fault)             # --inject-fault: [] without it
    timer = breakdown.step_timer_for(args)       # --breakdown[-barrier|-profile], else None
    if timer is not None:
        callbacks.append(timer)
    if args.timeline_file:                       # --timeline-file: the last iteration's actions
        callbacks.append(PipelineTimelineFile(args.timeline_file))
    weights = training.dense_twin_weights(state) if args.dense_twin else None
    recorder = pipeline_timeline.ScheduleRecorder(   # --record-timeline: hooks on the chunks
        state.model_chunks, args.num_micro_batches, args.pipeline_schedule) \
        if args.record_timeline else None
    metrics = training.train(state, callbacks=callbacks,   # MPU_LAB_FAULT_IN_SAVE: its writer
                             storage_writer=faults.kill_in_save_from_env())
    result = {"metrics": metrics, "iteration": state.iteration}
    if weights is not None:   # rank 0, --dense-twin
        result["dense_losses"] = training.dense_twin_losses(args, weights)
    if recorder is not None:
        result["timeline"] = recorder.report()
    if timer is not None:
        result["breakdown"] = timer.report()
    launcher.report(result)
    initialize.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
