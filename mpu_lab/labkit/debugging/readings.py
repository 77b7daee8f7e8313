"""What lab 17 prints once the learner has answered: per fault, what the lab's job shows of it
beyond the fault's own description (``FAULT_KINDS[kind]["what"]``, which reveal prints first)
and its fix (:data:`READINGS`, printed by :func:`~mpu_lab.labkit.debugging.exercises.reveal`).
In the notebook's prose it would name a cause before the learner commits to one: the lab's leak
check reads everything below a question."""
from __future__ import annotations

READINGS = {
    "hang": (
        "The other ranks wait for rank 1 in the next collective.\nThe fix: nothing in the job's "
        "configuration, since a longer timeout only makes the wait longer. The stack of the rank "
        "that was elsewhere names the line to fix (here the injected sleep, `hang` in "
        "`mpu_lab/training/faults.py`). In a real job it is a lock, a slow file system, a data "
        "loader that ran dry on one rank, or an endless loop."),
    "skip-collective": (
        "After the step of iteration 2, rank 0 averages the loss over the data-parallel group "
        "once more (for a log line) and rank 1 does not: the call stands in a rank-dependent "
        "`if`. Rank 1 went on into its next collective while rank 0 still waited in that loss "
        "all-reduce: gloo paired two different calls, and a message of the wrong size made the "
        "receiving rank abort. Usually the launcher finds rank 1 inside the gradient all-reduce "
        "and names both calls; when torchrun stops rank 1 before it gets there, it can only say "
        "where rank 1 was stopped, and names no likely cause.\nThe fix: call the collective on "
        "every rank of its group and make the *values* rank-dependent, never the call: in "
        "Megatron, every data-parallel rank all-reduces the loss, even when only rank 0 prints "
        "it."),
    "mismatched-shape": (
        "The fix: pass every rank the same shape, here the 1-element loss on every rank."),
    "wrong-group": (
        "Megatron's `clip_grad_norm` reduces over the model-parallel group; so does the "
        "gradient norm this job measures on every rank before the optimizer step, except on "
        "rank 1, which sums it over the data-parallel group. Look where each rank stood: not "
        "all in the same collective, and not all in the same iteration. A rank that stands in "
        "the next iteration (in `broadcast_data`, say) got *through* a collective it should not "
        "have: its loss all-reduce paired with rank 1's misdirected one (the same ranks, the "
        "same size) and summed values that do not belong together, without any error. Only the "
        "ranks left waiting show that something went wrong.\nThe fix: pass the group the "
        "reduction is meant for (`parallel_state.get_model_parallel_group()` here); a group "
        "picked by a variable that differs between ranks is the usual culprit."),
    "pp-deadlock": (
        "On gloo each blocking send waits for its peer's receive, which never comes.\nThe "
        "fix: the order of section 2's exchange, or sends and receives posted together "
        "(`batch_isend_irecv`), as Megatron-core does."),
    "crash": "In iteration 2, rank 1 raises after its backward. The others are then waiting for "
             "a peer that has gone.\nThe fix: the first rank's own error (here the injected "
             "one). Reading the last traceback of a job's log is the classic mistake: it usually "
             "belongs to a rank that only lost its peer.",
    "divergence": "At the start of iteration 3, rank 1 re-draws its shard of one weight matrix "
                  "from another seed, as a shard initialised apart from the master weight "
                  "would be.\nThe fix: make every shard from one master weight and one seed per "
                  "purpose (lab 06's ColumnParallelLinear slices a master weight; Megatron's RNG "
                  "tracker gives the tensor-parallel ranks different dropout masks only where "
                  "they should differ). The tool is the check itself: run it in CI on a few "
                  "iterations, on gloo or NCCL alike, since no error message will ever report "
                  "this fault.",
    "fp16-overflow": (
        "It multiplies rank 1's loss scale by 2**64 for one backward, so its fp16 gradients "
        "overflow. The job itself runs in the tests; here each rank's scaler is printed side by "
        "side. fp16 keeps 5 exponent bits where bf16 keeps fp32's 8 (the cell below prints both "
        "ranges).\nThe fix: one skipped step is the scaler doing its job: it skips the step on "
        "every rank (the overflow check is an all-reduce over the model-parallel group), halves "
        "the scale from the second overflow since it last grew (`--hysteresis 2`) and goes "
        "on. A run that skips step after step needs a smaller "
        "`--initial-loss-scale`, or `--bf16` instead of `--fp16` (no loss scale at all) on a GPU "
        "that has bf16."),
}

__all__ = ["READINGS"]
