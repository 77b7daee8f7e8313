"""The labs' exercises: each ``check_*`` function says whether an answer is right.

A check prints one verdict line and returns a :class:`Verdict`, true when the answer is right
and false when it is wrong or missing (the labs ship with ``answer = None``). The expected
value is never hard-coded: it is computed from :mod:`mpu_lab` itself (the pure rank-group
math, the shard arithmetic of :mod:`mpu_lab.labkit.viz`), so a check stays right for any
parameters an instructor picks. Write-the-code exercises (labs 01, 04, 05, 06, 07, 09) are :class:`Exercise` s graded by :func:`grade` on a
live playground world (:mod:`~mpu_lab.labkit.exercises.grader`). One module per lab (:mod:`~mpu_lab.labkit.exercises.rank_groups` ...
``performance``), the live-world checks of labs 04-06 in
:mod:`~mpu_lab.labkit.exercises.playground`, what they share in
:mod:`~mpu_lab.labkit.exercises.common`; every public name is importable from here.

    >>> check_group_of_rank([2, 6, 10, 14], rank=6, family="dp", world_size=32, tp=4, pp=2)
    Right: rank 6's dp group is [2, 6, 10, 14].
    Verdict(True)
"""
from mpu_lab.labkit.exercises.common import EMPTY, RIGHT, WRONG, Verdict, summarize
from mpu_lab.labkit.exercises.grader import Case, Exercise, Outcome, compare, grade
from mpu_lab.labkit.exercises.rank_groups import RANK_GROUPS, check_crossing_count, check_group_of_rank
from mpu_lab.labkit.exercises.collectives import RING_ALL_REDUCE, check_ring_send_bytes
from mpu_lab.labkit.exercises.column_parallel import (
    COLUMN_FORWARD,
    check_column_weight_shape,
    check_strided_rows,
)
from mpu_lab.labkit.exercises.row_parallel import (
    MLP_ALL_REDUCES,
    ROW_FORWARD,
    check_mlp_all_reduces,
    check_row_weight_shape,
    row_forward_exercise,
)
from mpu_lab.labkit.exercises.tp_mappings import (
    F_EXERCISE,
    G_EXERCISE,
    check_all_reduce_of_ranks,
    check_gather_split,
    check_megatron_expectations,
    gather_split_expected,
    group_sum_of_ranks,
)
from mpu_lab.labkit.exercises.parallel_transformer import (
    VOCAB_PARALLEL_CE,
    VOCAB_PARALLEL_CE_BACKWARD,
    check_activation_memory_mib,
    check_layer_collectives,
    check_layer_shape,
    check_tensor_parallel_sizes,
    lecture_shapes,
    valid_tensor_parallel_sizes,
)
from mpu_lab.labkit.exercises.context_parallel import LSE_MERGE, ZIGZAG_LAYOUT
from mpu_lab.labkit.exercises.pipeline_parallel import ONE_F_ONE_B, check_bubble_share, check_peak_in_flight
from mpu_lab.labkit.exercises.mixture_of_experts import DISPATCH
from mpu_lab.labkit.exercises.train_gpt import check_micro_batches, check_padded_vocab
from mpu_lab.labkit.exercises.performance import (
    check_best_config,
    check_dominant_communication,
    check_min_microbatches,
)
from mpu_lab.labkit.exercises.scaling import (
    check_best_ep,
    check_bounds,
    check_critical,
    check_smallest_cp,
    check_tp_share,
)
from mpu_lab.labkit.exercises.debugging import EXCHANGE, check_cause, check_culprit, print_suspects
from mpu_lab.labkit.exercises.data_parallel import (
    DISTRIBUTED_STEP,
    check_optimizer_state_gb,
)
from mpu_lab.labkit.exercises.playground import (
    check_copy_to_grad,
    check_reduce_from,
    check_reduce_scatter_to_sequence,
    copy_to_grad_expected,
    reduce_from_expected,
    reduce_scatter_sequence_expected,
)

__all__ = [
    "RIGHT", "WRONG", "EMPTY", "Verdict", "summarize",
    "grade", "Exercise", "Case", "Outcome", "compare",
    # write-the-code exercises, graded by grade(...) on a playground world
    "RANK_GROUPS", "COLUMN_FORWARD", "ROW_FORWARD", "row_forward_exercise", "F_EXERCISE",
    "G_EXERCISE", "VOCAB_PARALLEL_CE", "ONE_F_ONE_B", "DISPATCH",
    "check_group_of_rank", "check_crossing_count",
    "check_column_weight_shape", "check_strided_rows",
    "check_row_weight_shape", "MLP_ALL_REDUCES", "check_mlp_all_reduces",
    "group_sum_of_ranks", "gather_split_expected", "check_all_reduce_of_ranks",
    "check_gather_split", "check_megatron_expectations",
    "lecture_shapes", "check_layer_shape", "valid_tensor_parallel_sizes",
    "check_tensor_parallel_sizes", "check_layer_collectives", "check_activation_memory_mib",
    "check_bubble_share", "check_peak_in_flight",
    "check_micro_batches", "check_padded_vocab",
    "check_best_config", "check_min_microbatches", "check_dominant_communication",
    "check_bounds", "check_critical", "check_tp_share", "check_smallest_cp", "check_best_ep",
    "copy_to_grad_expected", "reduce_from_expected", "reduce_scatter_sequence_expected",
    "check_copy_to_grad", "check_reduce_from", "check_reduce_scatter_to_sequence",
    "DISTRIBUTED_STEP", "check_optimizer_state_gb",
    "RING_ALL_REDUCE", "check_ring_send_bytes",
    "LSE_MERGE", "ZIGZAG_LAYOUT",
]
