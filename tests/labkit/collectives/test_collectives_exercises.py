"""Lab 02's write-the-code exercise and its prediction, on the shared 4-rank grading world
(tp = 2: the tensor-parallel groups are [0, 1] and [2, 3]).

* ``RING_ALL_REDUCE`` (an all-reduce from send/recv around a ring): the lab's solution passes
  on the world and on the tensor-parallel group, padding sizes n does not divide; a ring that
  forgets to pad fails on the [3, 5] input; one that passes the whole array round the ring
  has the right values but fails on the bytes it sent, naming them; one that calls
  ``dist.all_reduce`` fails naming the collective; one that skips the all-gather fails on the
  values; the stub has no answer yet.
* The prediction: the bytes a rank sends, against values worked by hand.
"""
from mpu_lab.labkit.collectives.exercises import check_ring_send_bytes
from mpu_lab.labkit.collectives import exercises as collectives
from mpu_lab.labkit.grader import grade
from mpu_lab.labkit.notebooks.solutions import solution_source

OWN_SOLUTION = solution_source("02")

STUB = '''
def my_ring_all_reduce(x, group):
    raise NotImplementedError("a reduce-scatter, then an all-gather, around the ring")
'''

# Every rank passes its whole array round the ring and adds what it receives: n - 1 messages
# of the whole array, so (n - 1) x S bytes instead of 2 (n - 1)/n x S.
WHOLE_ARRAY = '''
def my_ring_all_reduce(x, group):
    n, me = dist.get_world_size(group), dist.get_rank(group)
    total, passing = x.clone(), x.clone()
    for _ in range(n - 1):
        passing = comm.exchange.send_recv(passing, (me + 1) % n, (me - 1) % n, group)
        total = total + passing
    return total
'''

ALL_REDUCE = '''
def my_ring_all_reduce(x, group):
    y = x.clone()
    dist.all_reduce(y, group=group)
    return y
'''

NO_PADDING = OWN_SOLUTION.replace("solution_ring_all_reduce", "my_ring_all_reduce").replace(
    "size = -(-flat.numel() // n)", "size = flat.numel() // n")
NO_ALL_GATHER = OWN_SOLUTION.replace("solution_ring_all_reduce", "my_ring_all_reduce").replace(
    "for step in range(n - 1):       # all-gather", "for step in range(0):       # all-gather")


def _grade(source, world, as_notebook):
    return grade(as_notebook(source)["my_ring_all_reduce"], collectives.RING_ALL_REDUCE, world)


def test_the_solution_passes_on_every_rank(grading_world, as_notebook, capsys):
    assert grade(as_notebook(OWN_SOLUTION)["solution_ring_all_reduce"],
                 collectives.RING_ALL_REDUCE, grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Right: solution_ring_all_reduce agrees with the reference on all 4 "
                          "ranks for 4 inputs: 4 numbers per rank, over the world; a [3, 5] "
                          "matrix"), out


def test_passing_the_whole_array_is_right_but_sends_too_much(grading_world, as_notebook, capsys):
    assert not _grade(WHOLE_ARRAY, grading_world, as_notebook)
    out = capsys.readouterr().out
    # 16 float32 numbers on 4 ranks: the ring sends 2 x 3 chunks of 4 numbers = 96 bytes;
    # the whole array three times round is 3 x 64 = 192
    assert out.startswith("Not yet: rank 0, input '4 numbers per rank, over the world': group "
                          "rank 0 of 4: the bytes this rank sent (the values were right) "
                          "expected 96 = 2 x (4 - 1) chunks of 4 numbers of 4 bytes, through "
                          "comm.exchange.send_recv, got 192."), out
    assert "Hint: n = dist.get_world_size(group)" in out


def test_calling_all_reduce_fails_naming_it(grading_world, as_notebook, capsys):
    assert not _grade(ALL_REDUCE, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: rank 0, input '4 numbers per rank, over the world': group "
                          "rank 0 of 4: the collectives called (the values were right) expected "
                          "none: only comm.exchange.send_recv between ring neighbours, got "
                          "all-reduce."), out


def test_without_padding_the_uneven_input_fails(grading_world, as_notebook, capsys):
    assert not _grade(NO_PADDING, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: ") and "input 'a [3, 5] matrix" in out, out


def test_a_ring_without_its_all_gather_fails_on_the_values(grading_world, as_notebook, capsys):
    assert not _grade(NO_ALL_GATHER, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: rank 0, input '4 numbers per rank, over the world': group "
                          "rank 0 of 4: the sum expected shape (16,) ["), out


def test_the_stub_has_no_answer_yet(grading_world, as_notebook, capsys):
    assert not _grade(STUB, grading_world, as_notebook)
    assert capsys.readouterr().out.startswith("No answer yet: my_ring_all_reduce still raises")


def test_ring_send_bytes_worked_by_hand(capsys):
    # 4 ranks, 8 MiB: 3 chunks of 2 MiB out in each half, 12 MiB in all
    assert check_ring_send_bytes(12, n=4, size_mib=8)
    assert capsys.readouterr().out.startswith("Right: 12 MiB: 3 chunks of 8/4 MiB")
    # 8 ranks, 16 MiB: 2 x 7/8 x 16 = 28; sending the array n - 1 times (112) is wrong
    assert check_ring_send_bytes(28.0, n=8, size_mib=16)
    assert not check_ring_send_bytes(112, n=8, size_mib=16)
    assert "Hint: cut the array into n = 8 chunks" in capsys.readouterr().out
    assert not check_ring_send_bytes(None, n=4, size_mib=8)
    assert capsys.readouterr().out.startswith("No answer yet:")
