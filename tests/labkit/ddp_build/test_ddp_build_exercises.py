"""Lab 04's builds, graded on the shared 4-rank grading world (tp = 2: the data-parallel groups
are [0, 2] and [1, 3], d = 2, not the world's 4): the learner's whole
``DistributedDataParallel`` class and the distributed optimizer (ZeRO-1), each a class typed in a
notebook cell (its text in linecache, as IPython keeps it), sent to the ranks as its source.

* The right classes (the learner's own and the lab's solution from labs/solutions/) pass and
  are saved into the learner's package under the capstone's names, a module Python imports.
* Each typical DDP mistake fails with the verdict that names it: the sum, not the average; the
  world's group; one all-reduce per parameter; a synchronous all-reduce; buckets in forward
  order; a bucket never sent; a bucket started before its micro-batches are in; every
  all-reduce started after backward (no overlap). The references: a dense twin's gradient on
  the whole global batch, and the bucket sizes worked by hand below.
* The optimizer: a plain all-reduce and Adam on everything has right values but the wrong
  collectives; a missed average fails on the values; Adam's state kept for every parameter
  fails on the state it holds. The stubs have no answer yet.
"""

import pytest

from mpu_lab.labkit.data_parallel import build
from mpu_lab.labkit.grader import grade
from mpu_lab.labkit.notebooks.solutions import solution_source
from learner_cells import edited, import_file, run_cell

DDP = '''
class MyDistributedDataParallel:
    def __init__(self, module, data_parallel_group=None, bucket_size=40_000,
                 num_micro_batches=1):
        self.group, self.m = data_parallel_group, num_micro_batches
        self.d = dist.get_world_size(group=data_parallel_group)
        self.buckets, current, filled = [], [], 0
        for p in reversed(list(module.parameters())):
            current.append(p)
            filled += p.numel()
            if filled >= bucket_size:
                self.buckets.append(current)
                current, filled = [], 0
        if current:
            self.buckets.append(current)
        self.where = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self.ready)
        self.zero_grad_buffer()

    def zero_grad_buffer(self):
        for b in self.buckets:
            for p in b:
                p.grad = None
        self.seen = {id(p): 0 for b in self.buckets for p in b}
        self.work = {}

    def ready(self, param):
        self.seen[id(param)] += 1
        i = self.where[id(param)]
        if all(self.seen[id(p)] == self.m for p in self.buckets[i]):
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])
            self.work[i] = (dist.all_reduce(flat, group=self.group, async_op=True), flat)

    def finish_grad_sync(self):
        for i, (handle, flat) in self.work.items():
            handle.wait()
            flat /= self.d
            offset = 0
            for p in self.buckets[i]:
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
'''
DDP_STUB = '''
class MyDistributedDataParallel:
    def __init__(self, module, data_parallel_group=None, bucket_size=40_000,
                 num_micro_batches=1):
        raise NotImplementedError("build the buckets and hook the gradients")

    def zero_grad_buffer(self):
        raise NotImplementedError

    def finish_grad_sync(self):
        raise NotImplementedError
'''
# a few of them break a line the others need to keep: each replacement must match once
MISTAKES = {
    "sum": (("            flat /= self.d\n", ""),),
    "world group": (("dist.all_reduce(flat, group=self.group, async_op=True)",
                     "dist.all_reduce(flat, async_op=True)"),),
    "per parameter": (("            if filled >= bucket_size:", "            if True:"),),
    "synchronous": (("dist.all_reduce(flat, group=self.group, async_op=True)",
                     "dist.all_reduce(flat, group=self.group)"),
                    ("            handle.wait()\n", "")),
    "forward order": (("reversed(list(module.parameters()))", "list(module.parameters())"),),
    "never sent": (("        if current:\n            self.buckets.append(current)\n", ""),
                   ("        for p in module.parameters():\n",
                    "        for p in [p for b in self.buckets for p in b]:\n")),
    "too early": (("== self.m for p", ">= 1 for p"),
                  ("        if all(", "        if i not in self.work and all(")),
    "no overlap": (("        if all(self.seen", "        if False and all(self.seen"),
                   ("        for i, (handle, flat)",
                    "        for i, b in enumerate(self.buckets):\n"
                    "            flat = torch.cat([p.grad.reshape(-1) for p in b])\n"
                    "            self.work[i] = (dist.all_reduce(flat, group=self.group, "
                    "async_op=True), flat)\n"
                    "        for i, (handle, flat)")),
}
VERDICTS = {
    "sum": "got the sum over the group: divide by its size d = 2",
    "world group": "got summed over the whole world: use the data-parallel group you were given",
    "per parameter": "got 4 all-reduces of [4, 32, 8, 48]: one per parameter, not one per "
                     "bucket",
    "synchronous": "got bucket 0's all-reduce with async_op=False: backward stood still",
    "forward order": "got [4, 40, 72, 48]: buckets of the parameters in forward order "
                     "[48, 72, 40, 4]",
    "never sent": "got no all-reduce at all: no bucket was ever sent",
    "too early": "got bucket 0 all-reduced when one of its parameters had 1 of its 2 gradient(s)",
    "no overlap": "got every all-reduce started after the last gradient arrived: nothing "
                  "overlapped",
}
INPUTS = {"too early": "buckets of about 40 elements, 2 micro-batches, 2 iterations"}


def _mistake(name):
    return edited(DDP, *MISTAKES[name])


def _cell(source, name, key):
    """``source`` as the learner's cell: the class ``name``."""
    return run_cell(source, key)[name]


def test_bucket_sizes_worked_by_hand():
    # the MLP 6-8-8-4: W1 48, b1 8, W2 64, b2 8, W3 32, b3 4; reversed: 4+32+8 = 44 >= 40 closes
    assert build.bucket_sizes([4, 32, 8, 64, 8, 48], 40) == [44, 64, 56]
    assert build.bucket_sizes([48, 8, 64, 8, 32, 4], 40) == [48, 72, 40, 4]
    assert build.bucket_sizes([3, 21, 7, 35], 20) == [24, 42]
    assert build.bucket_sizes([5, 5], 10_000) == [10]


def test_the_learners_class_passes_and_is_saved(grading_world, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MPU_LAB_MY_MEGATRON", str(tmp_path / "my_megatron"))
    assert grade(_cell(DDP, "MyDistributedDataParallel", "ddp"), build.DDP_BUILD,
                 grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Right: MyDistributedDataParallel agrees with the reference on all 4 "
                          "ranks for 4 inputs: one bucket, 1 micro-batch;"), out
    assert "saved: my_megatron/distributed_data_parallel.py (DistributedDataParallel)" in out
    module = import_file(tmp_path / "my_megatron" / "distributed_data_parallel.py")
    assert isinstance(module.DistributedDataParallel, type)
    assert "def finish_grad_sync(self):" in (tmp_path / "my_megatron" /
                                             "distributed_data_parallel.py").read_text()


def test_the_labs_solutions_pass_under_their_own_names(grading_world, capsys, monkeypatch,
                                                       tmp_path):
    monkeypatch.setenv("MPU_LAB_MY_MEGATRON", str(tmp_path / "my_megatron"))
    source = solution_source("04")
    ddp = _cell(source, "SolutionDistributedDataParallel", "sol-ddp")
    assert grade(ddp, build.DDP_BUILD, grading_world)
    assert capsys.readouterr().out.startswith("Right: SolutionDistributedDataParallel agrees")
    optimizer = _cell(source, "SolutionDistributedOptimizer", "sol-opt")
    assert grade(optimizer, build.OPTIMIZER_BUILD, grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Right: SolutionDistributedOptimizer agrees with the reference on all "
                          "4 ranks for 2 inputs"), out
    assert "saved: my_megatron/distrib_optimizer.py (DistributedOptimizer)" in out
    module = import_file(tmp_path / "my_megatron" / "distrib_optimizer.py")
    assert isinstance(module.DistributedOptimizer, type)


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_ddp_mistake_fails_naming_it(mistake, grading_world, capsys, monkeypatch,
                                          tmp_path):
    monkeypatch.setenv("MPU_LAB_MY_MEGATRON", str(tmp_path / "my_megatron"))
    learner = _cell(_mistake(mistake), "MyDistributedDataParallel", f"ddp-{mistake}")
    assert not grade(learner, build.DDP_BUILD, grading_world)
    out = capsys.readouterr().out
    first = INPUTS.get(mistake, "buckets of about 40 elements, 1 micro-batch"
                       if mistake in ("forward order", "no overlap")
                       else "one bucket, 1 micro-batch")
    assert out.startswith(f"Not yet: rank 0, input '{first}': data-parallel rank 0 of 2:"), \
        out
    assert VERDICTS[mistake] in out, out
    assert "Hint: walk the parameters in reverse" in out
    assert "saved:" not in out and not (tmp_path / "my_megatron").exists()


def test_the_ddp_stub_has_no_answer_yet(grading_world, capsys):
    assert not grade(_cell(DDP_STUB, "MyDistributedDataParallel", "ddp-stub"), build.DDP_BUILD,
                     grading_world)
    assert capsys.readouterr().out.startswith(
        "No answer yet: MyDistributedDataParallel still raises NotImplementedError")


# --------------------------------------------------------------------------- the optimizer
PLAIN = '''
class MyDistributedOptimizer:
    def __init__(self, params, data_parallel_group=None, lr=1e-3, betas=(0.9, 0.999),
                 eps=1e-8, weight_decay=0.0):
        self.params, self.group = list(params), data_parallel_group
        self.adam = torch.optim.Adam(self.params, lr=lr, betas=betas, eps=eps)

    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad, group=self.group)
            p.grad /= dist.get_world_size(group=self.group)
        self.adam.step()
'''
# the right collectives, but Adam's state for every parameter on every rank
FULL_STATE = '''
class MyDistributedOptimizer:
    def __init__(self, params, data_parallel_group=None, lr=1e-3, betas=(0.9, 0.999),
                 eps=1e-8, weight_decay=0.0):
        self.params, self.group = list(params), data_parallel_group
        self.d = dist.get_world_size(group=data_parallel_group)
        self.adam = torch.optim.Adam(self.params, lr=lr, betas=betas, eps=eps)

    def step(self):
        n = sum(p.numel() for p in self.params)
        size = -(-n // self.d)
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        flat = torch.nn.functional.pad(flat, (0, size * self.d - n))
        shard = flat.new_empty(size)
        dist.reduce_scatter_tensor(shard, flat, group=self.group)
        dist.all_gather_into_tensor(flat, shard / self.d, group=self.group)
        offset = 0
        for p in self.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.adam.step()
'''
OPTIMIZER_STUB = '''
class MyDistributedOptimizer:
    def __init__(self, params, data_parallel_group=None, lr=1e-3, betas=(0.9, 0.999),
                 eps=1e-8, weight_decay=0.0):
        raise NotImplementedError("which 1/d of the state is this rank's?")

    def step(self):
        raise NotImplementedError
'''


def _solution_optimizer(**replace):
    text = solution_source("04")
    text = text[text.index("class SolutionDistributedOptimizer"):]
    for old, new in replace.items():
        assert text.count(old) == 1
        text = text.replace(old, new)
    return text.replace("SolutionDistributedOptimizer", "MyDistributedOptimizer")


def test_a_plain_all_reduce_adam_has_the_right_values_but_the_wrong_collectives(
        grading_world, capsys):
    assert not grade(_cell(PLAIN, "MyDistributedOptimizer", "opt-plain"),
                     build.OPTIMIZER_BUILD, grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: rank 0, input 'an MLP of 74 parameters, 2 steps': "
                          "data-parallel rank 0 of 2: step 1: the collectives called (the "
                          "values were right) expected a reduce-scatter of the gradients and "
                          "an all-gather of the parameters, no all-reduce, got all-reduce"), out


def test_keeping_only_the_own_shard_fails_on_the_parameters(grading_world, capsys):
    # no all-gather: the other ranks' shards stay as they were (a missed average would not
    # show: Adam's step is blind to a gradient scaled by a constant)
    learner = _solution_optimizer(**{
        "dist.all_gather_into_tensor(full, self.shard.data, group=self.group)":
            "full = self._flat([p.detach() for p in self.params])\n"
            "        full[self.rank * self.shard_size:(self.rank + 1) * self.shard_size] = "
            "self.shard.data"})
    assert not grade(_cell(learner, "MyDistributedOptimizer", "opt-own"),
                     build.OPTIMIZER_BUILD, grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: rank 0, input 'an MLP of 74 parameters, 2 steps': "
                          "data-parallel rank 0 of 2: step 1: 0.weight after the step "
                          "expected shape (8, 6) ["), out      # its last 11 are rank 1's


def test_adam_state_for_every_parameter_fails_on_the_state(grading_world, capsys):
    assert not grade(_cell(FULL_STATE, "MyDistributedOptimizer", "opt-full"),
                     build.OPTIMIZER_BUILD, grading_world)
    out = capsys.readouterr().out
    # 74 parameters: Adam's m and v, 148 elements, and a step count per tensor (4); a shard
    # is 37, 3 x 37 = 111 at most
    assert out.startswith("Not yet: rank 0, input 'an MLP of 74 parameters, 2 steps': "
                          "data-parallel rank 0 of 2: the state your optimizer keeps (74 "
                          "parameters) expected Adam's m and v (and this rank's main copy) "
                          "for 1/d of them: at most 3 x 37 = 111 elements, got 152 "
                          "elements."), out


def test_the_optimizer_stub_has_no_answer_yet(grading_world, capsys):
    assert not grade(_cell(OPTIMIZER_STUB, "MyDistributedOptimizer", "opt-stub"),
                     build.OPTIMIZER_BUILD, grading_world)
    assert capsys.readouterr().out.startswith(
        "No answer yet: MyDistributedOptimizer still raises NotImplementedError")


def test_a_module_subclass_calling_super_travels_to_the_ranks(grading_world, capsys,
                                                              monkeypatch, tmp_path):
    """ipyparallel cannot ship a notebook class whose method calls super() (its __class__ cell
    refers back to the class): the grader sends the source, and each rank defines it again."""
    monkeypatch.setenv("MPU_LAB_MY_MEGATRON", str(tmp_path / "my_megatron"))
    source = "import torch\n" + DDP.replace(
        "class MyDistributedDataParallel:", "class MyDistributedDataParallel(torch.nn.Module):"
    ).replace("        self.group, self.m =", "        super().__init__()\n"
                                               "        self.module = module\n"
                                               "        self.group, self.m =")
    assert grade(_cell(source, "MyDistributedDataParallel", "ddp-module"), build.DDP_BUILD,
                 grading_world)
    assert capsys.readouterr().out.startswith("Right: MyDistributedDataParallel agrees")
