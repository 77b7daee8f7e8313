"""Lab 13's write-the-code exercise, ``DISPATCH`` (the all-to-all dispatcher's permutation
and count exchange), on the shared 4-rank grading world, with real all-to-alls.

* The reference the grader uses (the mirror's dispatcher) is itself checked against an
  independent construction: every rank's rows all-gathered and picked by hand, expert by
  expert, source by source.
* The lab's solution passes under its own name; the stub has no answer yet.
* Wrong answers fail with a verdict that names the rank and what differs: rows left in the
  order they arrive (no second permutation), the counts not exchanged (each rank assumes its
  own counts), rows sent in token order instead of expert order.
* Mismatched split sizes raise the same error on every rank (no rank dies), naming the pair
  of ranks and the counts: :func:`split_mismatches` worked by hand.
* The lab's rank-side lessons on the same world at ep = 4: the all-to-all bytes that torch's
  CommDebugMode counts equal the formula from the dispatcher's split sizes (both dispatchers
  run), and training with the load-balancing loss ends with a smaller imbalance than without.
* The world keeps its own groups (tp = 2) afterwards.
"""
import pytest

from mpu_lab.labkit.mixture_of_experts import lessons as moe_lessons
from mpu_lab.labkit.grader import grade
from mpu_lab.labkit.mixture_of_experts import exercises as moe_ex
from mpu_lab.labkit.notebooks.solutions import solution_source

OWN_SOLUTION = solution_source("13")

STUB = '''
def my_dispatch(tokens, routing_map, group):
    raise NotImplementedError("send each row to the rank of its expert")
'''

RIGHT = OWN_SOLUTION.replace("def solution_dispatch", "def my_dispatch")

NO_SORT = RIGHT.replace(
    "rows = torch.cat([blocks[s * local + e] for e in range(local) for s in range(ep)])",
    "rows = received")

NO_COUNT_EXCHANGE = RIGHT.replace(
    "dist.all_to_all_single(received_counts, counts, group=group)",
    "received_counts.copy_(counts)")

TOKEN_ORDER = RIGHT.replace("permuted = tokens[token_ids[expert_major]]",
                            "permuted = tokens[token_ids.t()[routing_map]]")

# An independent reference: every rank's tokens and choices gathered, then, for each of my
# experts and each source rank, that source's rows that chose the expert, in token order.
BY_HAND = '''
def by_hand(tokens, routing_map, group):
    ep = dist.get_world_size(group)
    me = dist.get_rank(group)
    local = routing_map.size(1) // ep
    all_tokens = [torch.empty_like(tokens) for _ in range(ep)]
    all_maps = [torch.empty_like(routing_map.long()) for _ in range(ep)]
    dist.all_gather(all_tokens, tokens, group=group)
    dist.all_gather(all_maps, routing_map.long(), group=group)
    rows, counts = [], []
    for e in range(me * local, (me + 1) * local):
        chosen = [t[m[:, e].bool()] for t, m in zip(all_tokens, all_maps)]
        rows += chosen
        counts.append(sum(c.size(0) for c in chosen))
    return torch.cat(rows), counts
'''


def _grade(source, name, world, as_notebook):
    return grade(as_notebook(source)[name], moe_ex.DISPATCH, world)


def test_the_reference_equals_an_all_gather_worked_by_hand(grading_world, as_notebook, capsys):
    assert _grade(BY_HAND, "by_hand", grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Right: by_hand agrees with the reference on all 4 ranks for 4 inputs")


def test_the_labs_solution_passes_under_its_own_name(grading_world, as_notebook, capsys):
    assert _grade(OWN_SOLUTION, "solution_dispatch", grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Right: solution_dispatch agrees with the reference on all 4 ranks")
    assert "my_dispatch agrees" not in out
    # the grading regrouped the world at ep = 2 and 4; its own groups are back
    assert grading_world.run("(parallel_state.get_tensor_model_parallel_world_size(), "
                             "parallel_state.get_expert_model_parallel_world_size())") == [(2, 1)] * 4


def test_the_stub_has_no_answer_yet(grading_world, as_notebook, capsys):
    assert not _grade(STUB, "my_dispatch", grading_world, as_notebook)
    assert capsys.readouterr().out.startswith(
        "No answer yet: my_dispatch still raises NotImplementedError")


@pytest.mark.parametrize("wrong, says", [
    (NO_SORT, "rows received, by name"),
    (NO_COUNT_EXCHANGE, "split sizes disagree: group rank 0 sends group rank 1"),
    (TOKEN_ORDER, "rows received, by name"),
])
def test_a_wrong_dispatch_fails_naming_the_rank_and_what_differs(wrong, says, grading_world,
                                                                 as_notebook, capsys):
    assert not _grade(wrong, "my_dispatch", grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: ") and "rank 0" in out
    assert says in out and "Hint:" in out
    # the world survived the wrong answer: the solution still passes on it
    assert _grade(OWN_SOLUTION, "solution_dispatch", grading_world, as_notebook)


def test_split_mismatches_names_the_pair_and_the_counts():
    agree = [([2, 1], [2, 0], 3, 2), ([0, 4], [1, 4], 4, 5)]
    assert moe_ex.split_mismatches(agree) == []
    assert moe_ex.split_mismatches([([4, 4], None, 8, 8), ([4, 4], None, 8, 8)]) == []
    wrong = [([2, 1], [2, 1], 3, 3), ([0, 4], [1, 4], 4, 5)]
    assert moe_ex.split_mismatches(wrong) == [
        "group rank 1 sends group rank 0 0 rows, but group rank 0 expects 1"]
    assert moe_ex.split_mismatches([([2, 2], [1, 1], 3, 2)] * 2)[0] == (
        "group rank 0's input_split_sizes [2, 2] do not cut its 3 input rows into 2 blocks")


def test_rank_side_lessons_bytes_and_load_balancing(grading_world):
    world = grading_world
    world.run("parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=4) or 0")
    try:
        counted = world.run(moe_lessons.count_dispatch_bytes, tokens=12, hidden=8, num_experts=8,
                            topk=2)
        for rank in counted:
            assert rank["measured"] == rank["formula"]
            assert rank["rows"] == 12 * 2 and 0 < rank["rows_to_others"] <= 24
        gathered = world.run(moe_lessons.count_dispatch_bytes, dispatcher="allgather")
        assert set(gathered[0]["measured"]) >= {"all_gather forward", "reduce_scatter forward"}
        without = world.run(moe_lessons.train_load, 0.0, 25)
        with_aux = world.run(moe_lessons.train_load, 0.1, 25)
        assert all(r == without[0] for r in without) and len(without[0]) == 25
        assert moe_lessons.imbalance_summary(with_aux[0]) < moe_lessons.imbalance_summary(without[0])
    finally:
        world.run("parallel_state.initialize_model_parallel(2, 1) or 0")
