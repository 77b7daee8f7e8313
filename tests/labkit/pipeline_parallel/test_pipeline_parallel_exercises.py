"""Lab 11's write-the-code exercise on the shared 4-rank grading world, regrouped as 4 pipeline
stages: one stage's 1F1B order, run with real sends and receives between the stages. The
solution passes; an order that cannot run, one that runs but is not 1F1B, one whose messages
cross and one that deadlocks fail, each naming what happened; the stub says there is no
answer yet. The world is left with its own groups (tp = 2, pp = 1)."""
import linecache
import os

from mpu_lab.labkit.grader import grade
from mpu_lab.training.code_folder import defining_files, piece_source
from mpu_lab.labkit.pipeline_parallel import exercises as pipeline_parallel
from mpu_lab.labkit.notebooks.solutions import solution_source

# The lab's solution, as labs/solutions/ holds it (the learner loads it with %load): it must pass
# under its own name, and the verdict must name it, not the learner's function.
OWN_SOLUTION = solution_source("11")

STUB = '''
def my_1f1b_order(stage, num_stages, num_microbatches):
    raise NotImplementedError("return the list of ('F', k) and ('B', k)")
'''

SOLUTION = '''
def my_1f1b_order(stage, num_stages, num_microbatches):
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [("F", k) for k in range(warmup)]
    for k in range(num_microbatches - warmup):
        order += [("F", warmup + k), ("B", k)]
    return order + [("B", k) for k in range(num_microbatches - warmup, num_microbatches)]
'''

GPIPE = '''
def my_1f1b_order(stage, num_stages, num_microbatches):
    return [("F", k) for k in range(num_microbatches)] + [("B", k) for k in range(num_microbatches)]
'''

NO_MIN = SOLUTION.replace("min(num_stages - stage - 1, num_microbatches)", "num_stages - stage - 1")
REVERSED_WARMUP = SOLUTION.replace("min(num_stages - stage - 1, num_microbatches)",
                                   "min(stage, num_microbatches)")
LAST_STAGE_STARTS_AT_ONE = SOLUTION.replace(
    "    return order +",
    "    if stage == num_stages - 1 and num_microbatches > 1:\n"
    "        order[:4] = [(\"F\", 1), (\"B\", 1), (\"F\", 0), (\"B\", 0)]\n"
    "    return order +")


def _grade(source, world, as_notebook):
    return grade(as_notebook(source)["my_1f1b_order"], pipeline_parallel.ONE_F_ONE_B, world)


def _groups(world):
    return world.run("(parallel_state.get_tensor_model_parallel_world_size(), "
                     "parallel_state.get_pipeline_model_parallel_world_size())")


def test_the_hand_worked_orders_and_the_form_check():
    """Without a world: Narayanan et al.'s Fig. 4 (top) pattern for 4 stages and 8 micro-batches
    (written out by hand), the case's m, and what order_problem says about broken orders."""
    ns = {}
    exec(OWN_SOLUTION, ns)
    assert pipeline_parallel.order_text(ns["solution_1f1b_order"](0, 4, 8)) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert pipeline_parallel.order_text(ns["solution_1f1b_order"](3, 4, 8)) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    assert pipeline_parallel.order_text(ns["solution_1f1b_order"](1, 4, 2)) == "F0 F1 B0 B1"
    assert [pipeline_parallel.num_microbatches_of(c.params, 4) for c in pipeline_parallel.ONE_F_ONE_B.cases] == [4, 9, 1, 2]
    assert pipeline_parallel.order_problem([("F", 0), ("B", 0)], 1) is None
    assert pipeline_parallel.order_problem([("B", 0), ("F", 0)], 1) == "('B', 0) comes before ('F', 0)"
    assert pipeline_parallel.order_problem([("F", 0), ("F", 0)], 1) == "('F', 0) appears twice"
    assert pipeline_parallel.order_problem([("F", 0)], 1) == "[('B', 0)] missing"
    assert pipeline_parallel.order_problem("F0 B0", 1).startswith("a str, not a list")
    assert pipeline_parallel.order_problem([("F", 1)], 1) == \
        "item 0 is ('F', 1): each item is ('F', k) or ('B', k) with 0 <= k < m = 1"
    assert pipeline_parallel.order_problem([("W", 0)], 1).startswith("item 0 is ('W', 0)")


def test_the_solution_passes_and_the_world_keeps_its_groups(grading_world, as_notebook, capsys):
    before = _groups(grading_world)
    assert grade(as_notebook(OWN_SOLUTION)["solution_1f1b_order"], pipeline_parallel.ONE_F_ONE_B,
                 grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Right: solution_1f1b_order agrees with the reference on all 4 ranks for "
                          "4 inputs: m = p"), out
    assert _groups(grading_world) == before == [(2, 1)] * 4


def test_the_stub_has_no_answer_yet(grading_world, as_notebook, capsys):
    assert not _grade(STUB, grading_world, as_notebook)
    assert capsys.readouterr().out.startswith("No answer yet: my_1f1b_order still raises")


def test_gpipe_runs_but_is_not_1f1b(grading_world, as_notebook, capsys):
    assert not _grade(GPIPE, grading_world, as_notebook)
    out = capsys.readouterr().out
    # stage 0's 1F1B order at m = p is GPipe's (p - 1 warm-ups, one pair, p - 1 cool-downs)
    assert out.startswith("Not yet: rank 1, input 'm = p (as many micro-batches as stages)': the "
                          "1F1B order of stage 1 of 4, m = 4: expected F0 F1 F2 B0 F3 B1 B2 B3, "
                          "got F0 F1 F2 F3 B0 B1 B2 B3 (it runs, but it is not 1F1B)."), out


def test_warmup_without_the_min_asks_for_micro_batches_that_do_not_exist(
        grading_world, as_notebook, capsys):
    assert not _grade(NO_MIN, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: rank 0, input 'm = 1': the order of stage 0 of 4, m = 1: "
                          "expected F0 B0, got F0 F1 F2 B-2 B-1 B0 (item 1 is ('F', 1)"), out


def test_crossed_messages_name_the_stage_and_the_message(grading_world, as_notebook, capsys):
    assert not _grade(LAST_STAGE_STARTS_AT_ONE, grading_world, as_notebook)
    out = capsys.readouterr().out
    # the last stage takes micro-batch 0's activation for 1, and sends back 1's gradient first:
    # stage 2, the first rank to notice, names it
    assert out.startswith("Not yet: rank 2, input 'm = p (as many micro-batches as stages)': "
                          "stage 2 of 4, m = 4: running your order F0 F1 B0 F2 B1 F3 B2 B3, the "
                          "message for B0 expected the gradient of micro-batch 0, got the "
                          "gradient of micro-batch 1."), out


def test_a_deadlocking_order_names_the_waiting_ranks_and_the_world_recovers(
        grading_world, as_notebook, capsys):
    before = _groups(grading_world)
    assert not _grade(REVERSED_WARMUP, grading_world, as_notebook)
    out = capsys.readouterr().out
    # stage 0 waits for micro-batch 0's gradient, stage 1 for micro-batch 1's activation: every
    # stage waits, none finishes
    assert out.startswith("Not yet: on input 'm = p (as many micro-batches as stages)' ranks "
                          "[0, 1, 2, 3]"), out
    assert "waited" in out and "(The world was restarted.)" in out and "Hint:" in out
    assert _groups(grading_world) == before
    assert grading_world.run("x = torch.ones(1); dist.all_reduce(x); x.item()") == [4.0] * 4


# --------------------------------------------------------------------------- the 1F1B loop
LOOP_STUB = '''
def my_1f1b_loop(stage, num_stages, num_microbatches, forward, backward, p2p):
    raise NotImplementedError("how many forwards can this stage run before its first gradient comes back?")
'''


def _loop(source, world, as_notebook, name="solution_1f1b_loop"):
    return grade(as_notebook(source)[name], pipeline_parallel.ONE_F_ONE_B_LOOP, world)


def test_the_loop_solution_passes_and_the_world_keeps_its_groups(grading_world, as_notebook,
                                                                capsys):
    before = _groups(grading_world)
    # IPython keeps a cell's text in linecache, which is where the grader reads what it saves
    linecache.cache["<learner cell>"] = (len(OWN_SOLUTION), None,
                                         OWN_SOLUTION.splitlines(keepends=True), "<learner cell>")
    assert _loop(OWN_SOLUTION, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Right: solution_1f1b_loop agrees with the reference on all 4 ranks "
                          "for 4 inputs: m = p"), out
    assert _groups(grading_world) == before == [(2, 1)] * 4
    # saved under the name the capstone takes for Megatron's 1F1B schedule (lab 18)
    assert "saved: my_megatron/schedules.py (my_1f1b_loop)" in out, out
    defined = defining_files(os.environ["MPU_LAB_MY_MEGATRON"])
    assert piece_source(defined, "schedules.py",
                        "forward_backward_pipelining_without_interleaving") == \
        ("schedules.py", "my_1f1b_loop")


def test_the_loop_stub_has_no_answer_yet(grading_world, as_notebook, capsys):
    assert not _loop(LOOP_STUB, grading_world, as_notebook, "my_1f1b_loop")
    assert capsys.readouterr().out.startswith("No answer yet: my_1f1b_loop still raises")


def test_a_loop_missing_its_last_send_ends_in_a_timeout_that_names_the_waiting_ranks(
        grading_world, as_notebook, capsys):
    # The steady state's last backward never sends its gradient back: stage r-1 waits in its
    # cool-down for a message that never comes. The timeout ends it; nothing hangs.
    wrong = OWN_SOLUTION.replace("        if i == remaining - 1:\n            p2p.send_backward(input_grad)\n",
                                 "        if i == remaining - 1:\n            pass\n")
    assert wrong != OWN_SOLUTION
    before = _groups(grading_world)
    assert not _loop(wrong, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: on input 'm = p (as many micro-batches as stages)' ranks "
                          "[0, 1, 2]"), out
    assert "never" in out and "(The world was restarted.)" in out and "Hint:" in out
    assert _groups(grading_world) == before


def test_a_loop_that_runs_the_newest_backward_first_is_named_by_its_ops(grading_world,
                                                                        as_notebook, capsys):
    # pop() instead of pop(0): the backward runs for the newest micro-batch in flight, whose
    # gradient has not come back; the ops differ from 1F1B's on the first stage with a warm-up
    wrong = OWN_SOLUTION.replace("backward(inputs.pop(0), outputs.pop(0), output_grad)",
                                 "backward(inputs.pop(), outputs.pop(), output_grad)")
    assert not _loop(wrong, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: rank 0, input 'm = p (as many micro-batches as stages)': "
                          "stage 0 of 4, m = 4: the forwards and backwards your loop ran "
                          "expected F0 F1 F2 F3 B0 B1 B2 B3, got F0 F1 F2 F3 B3 B2 B1 B0."), out


def test_a_loop_that_sends_the_wrong_tensor_fails_on_the_gradients(grading_world, as_notebook,
                                                                   capsys):
    # in the cool-down every stage sends back the gradient of its output instead of its
    # input's: same shapes, so nothing fails until the first stage's gradients are compared
    # (its parameters in named_parameters() order: the word embedding first)
    wrong = OWN_SOLUTION.replace(
        "        input_grad = backward(inputs.pop(0), outputs.pop(0), output_grad)\n"
        "        p2p.send_backward(input_grad)\n",
        "        input_grad = backward(inputs.pop(0), outputs.pop(0), output_grad)\n"
        "        p2p.send_backward(output_grad)\n")
    assert wrong != OWN_SOLUTION
    assert not _loop(wrong, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: rank 0, input 'm = p (as many micro-batches as stages)': "
                          "stage 0 of 4, m = 4: the gradient of word_embeddings expected shape (16, 8)"), out
