"""mpu_lab's tensor-parallel operators on 8 real ranks, checked against the expected values of
Megatron-LM's tensor-parallel unit tests (tests/unit_tests/tensor_parallel,
https://github.com/NVIDIA/Megatron-LM/tree/core_v0.19.2/tests/unit_tests/tensor_parallel).

    torchrun --standalone --nproc-per-node 8 launch/collectives.py --test all

Pick tests by name (``--test copy reduce`` ...) or with ``TEST_*`` environment switches (the
way a common walkthrough of those tests runs them)::

    TEST_BROAD=1 TEST_COPY=1 torchrun --standalone --nproc-per-node 8 launch/collectives.py

| name           | switch              | layout     | what Megatron expects                          |
|----------------|---------------------|------------|------------------------------------------------|
| broadcast      | TEST_BROAD          | tp=2, pp=4 | every rank gets the tp source rank's dict      |
| copy           | TEST_COPY           | tp=4, pp=2 | copy-to backward sums the tp group: 6 and 22   |
| reduce         | TEST_REDUCE         | tp=4, pp=2 | reduce-from forward sums the tp group: 6 and 22 |
| scatter        | TEST_SCATTER        | tp=4, pp=2 | rank keeps column ``rank % 4``                  |
| gather         | TEST_GATHER         | tp=4, pp=2 | all-gather concatenates the group's values     |
| gather_split   | TEST_GATHER_SPLIT   | tp=2, pp=4 | the group's flattened (2, 4) tensors, in order |
| sequence       | TEST_SEQUENCE       | tp=4, pp=2 | sequence-parallel scatter / gather / reduce-scatter |

With no test selected, all run. Each test asserts Megatron's values, then rank 0 prints one
line per rank, in rank order. From a notebook, ``mpu_lab.launcher.run("collectives.py",
["--test", "copy"], nproc=8).results`` returns each rank's values.
"""
import os
import types

import torch
import torch.distributed as dist

from mpu_lab.training import flag_errors, initialize
from mpu_lab import launcher
from mpu_lab.core import parallel_state as ps
from mpu_lab.core import tensor_parallel as tp
from mpu_lab.megatron_reference.collective_layouts import COLLECTIVE_LAYOUTS
from mpu_lab.core.tensor_parallel import mappings

WORLD = 8  # both layouts have tp * pp = 8


gather_lines = launcher.gather_lines  # rank-ordered output, shared with the other scripts


def fmt(t):
    return "[" + ", ".join(f"{v:g}" for v in t.flatten().tolist()) + "]"


def cpu(t):
    return t.detach().cpu()


def ones(*shape):
    return torch.ones(*shape, device=initialize.get_device())


def tp_group_ranks():
    return ps.get_group_ranks("tp")


def ctx(**saved):
    """A stand-in for what an autograd Function's forward keeps (the tensor-parallel group and
    ``saved``), to call its ``backward`` directly, as Megatron-core's unit tests do."""
    return types.SimpleNamespace(group=ps.get_tensor_model_parallel_group(), **saved)


def filled(values, n):
    """[v0]*n + [v1]*n + ... as one tensor."""
    return torch.cat([ones(n) * v for v in values])


# --------------------------------------------------------------------------- the tests
def test_broadcast():
    """Only the first rank of each tp group holds the batch; broadcast_data hands it to the group."""
    rank, src = dist.get_rank(), ps.get_tensor_model_parallel_src_rank()
    data = {k: ones(8, 8) * k for k in range(8)} if rank == src else None
    out = tp.broadcast_data([0, 1], data, torch.float32)
    assert torch.equal(out[0], ones(8, 8) * 0) and torch.equal(out[1], ones(8, 8) * 1)
    line = f"received keys [0, 1] from rank {src}: means {out[0].mean().item():g}, {out[1].mean().item():g}"
    return line, {"src": src, "means": [out[0].mean().item(), out[1].mean().item()]}


def test_copy():
    """f of Megatron-LM §3: identity forward, all-reduce backward."""
    rank, group = dist.get_rank(), tp_group_ranks()
    x = ones(1) * rank
    out, _ = mappings._CopyToModelParallelRegion.backward(ctx(), x)
    assert torch.equal(out, ones(1) * sum(group)), f"got {fmt(cpu(out))}"
    assert torch.equal(tp.copy_to_tensor_model_parallel_region(x), x)   # forward: identity
    return (f"input {fmt(cpu(x))} -> copy-to backward {fmt(cpu(out))} (sum over tp group {group})",
            {"tp_group": group, "value": out.item()})


def test_reduce():
    """g of Megatron-LM §3: all-reduce forward, identity backward."""
    rank, group = dist.get_rank(), tp_group_ranks()
    x = ones(1) * rank
    out = tp.reduce_from_tensor_model_parallel_region(x)
    assert torch.equal(out, ones(1) * sum(group)), f"got {fmt(cpu(out))}"
    assert torch.equal(mappings._ReduceFromModelParallelRegion.backward(ctx(), x)[0], x)
    return (f"input {fmt(cpu(x))} -> reduce-from forward {fmt(cpu(out))} (sum over tp group {group})",
            {"tp_group": group, "value": out.item()})


def test_scatter():
    """Split the last dimension; keep this rank's column. Backward all-gathers."""
    rank, group = dist.get_rank(), tp_group_ranks()
    t, r = len(group), ps.get_tensor_model_parallel_rank()
    x = torch.arange(8 * t, dtype=torch.float32, device=initialize.get_device()).view(8, t)  # x[i, j] = t*i + j
    out = tp.scatter_to_tensor_model_parallel_region(x)                  # [8, 1]
    assert torch.equal(out, x[:, r:r + 1]), f"kept {fmt(cpu(out))}"
    back = mappings._ScatterToModelParallelRegion.backward(ctx(), ones(8) * rank)[0]
    assert torch.equal(back, filled(group, 8))
    column = int(out[0, 0].item())
    return (f"keeps column {column} of the (8, {t}) input: {fmt(cpu(out))}",
            {"column": column, "shape": list(out.shape)})


def test_gather():
    """All-gather along the last dimension, in tp-rank order. Backward keeps this rank's slice."""
    rank, group = dist.get_rank(), tp_group_ranks()
    out = tp.gather_from_tensor_model_parallel_region(ones(8) * rank)   # [8 * t]
    assert torch.equal(out, filled(group, 8)), f"gathered {fmt(cpu(out[::8]))}"
    blocks = [int(v) for v in out[::8].tolist()]
    return f"gathers 8 copies each of {blocks} -> shape {tuple(out.shape)}", {"blocks": blocks}


def test_gather_split():
    """gather_split_1d_tensor: the tp group's flattened tensors, concatenated."""
    rank, group = dist.get_rank(), tp_group_ranks()
    x = ones(2, 4) * rank
    out = tp.gather_split_1d_tensor(x)                                  # [8 * t]
    assert torch.equal(out, filled(group, 8)), f"gathered {fmt(cpu(out))}"
    return f"input (2, 4) of {rank} -> {fmt(cpu(out))}", {"output": out.tolist()}


def test_sequence():
    """Sequence parallelism (Korthikanti et al. 2022): the same moves along dim 0."""
    rank, group = dist.get_rank(), tp_group_ranks()
    t, r = len(group), ps.get_tensor_model_parallel_rank()
    seq = torch.arange(2 * t * 4, dtype=torch.float32, device=initialize.get_device()).view(2 * t, 4)
    mine = tp.scatter_to_sequence_parallel_region(seq)                 # rows [2r, 2r + 2)
    assert torch.equal(mine, seq[2 * r:2 * r + 2])
    assert torch.equal(mappings._ScatterToSequenceParallelRegion.backward(ctx(), ones(4) * rank)[0],
                       filled(group, 4))
    gathered = tp.gather_from_sequence_parallel_region(ones(4) * rank)
    assert torch.equal(gathered, filled(group, 4))
    rows = torch.vstack([ones(4) * i for i in range(t)])               # row i holds i
    grad = mappings._GatherFromSequenceParallelRegion.backward(
        ctx(tensor_parallel_output_grad=True), rows)[0]
    assert torch.equal(grad, ones(1, 4) * t * r)
    reduced = tp.reduce_scatter_to_sequence_parallel_region(rows)      # sum, keep row r
    assert torch.equal(reduced, ones(1, 4) * t * r)
    assert torch.equal(mappings._ReduceScatterToSequenceParallelRegion.backward(ctx(), ones(4) * rank)[0],
                       filled(group, 4))
    line = (f"scatter keeps rows [{2 * r}, {2 * r + 2}); gather -> {[int(v) for v in gathered[::4].tolist()]}; "
            f"reduce-scatter keeps row {r} summed: {reduced[0, 0].item():g}")
    return line, {"rows": [2 * r, 2 * r + 2], "reduce_scatter": reduced[0, 0].item()}


# name: (environment switch, (tp, pp), function); the layouts are the package's one copy,
# which lab 08's pictures and checks read too.
TESTS = {
    "broadcast": ("TEST_BROAD", COLLECTIVE_LAYOUTS["broadcast"], test_broadcast),
    "copy": ("TEST_COPY", COLLECTIVE_LAYOUTS["copy"], test_copy),
    "reduce": ("TEST_REDUCE", COLLECTIVE_LAYOUTS["reduce"], test_reduce),
    "scatter": ("TEST_SCATTER", COLLECTIVE_LAYOUTS["scatter"], test_scatter),
    "gather": ("TEST_GATHER", COLLECTIVE_LAYOUTS["gather"], test_gather),
    "gather_split": ("TEST_GATHER_SPLIT", COLLECTIVE_LAYOUTS["gather_split"], test_gather_split),
    "sequence": ("TEST_SEQUENCE", COLLECTIVE_LAYOUTS["sequence"], test_sequence),
}


def selected_tests(argv=None):
    parser = flag_errors.ArgumentParser(description="mpu_lab's operators against the expected values of Megatron's tensor-parallel unit tests, on 8 ranks")
    parser.add_argument("--test", nargs="+", metavar="NAME", choices=[*TESTS, "all"],
                        help=f"tests to run: {', '.join(TESTS)} or all (default: the TEST_* "
                             f"switches that are set, else all)")
    args = parser.parse_args(argv)
    names = list(args.test or [])
    names += [n for n, (switch, _, _) in TESTS.items() if os.environ.get(switch, "0") not in ("", "0")]
    if not names or "all" in names:
        return list(TESTS)
    return [n for n in TESTS if n in names]          # table order, each once


@launcher.entrypoint
def main():
    names = selected_tests()
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world and world % WORLD:   # refused before any process group starts, on rank 0 only
        flag_errors.refuse("collectives.py", f"it runs Megatron's tests with tp * pp = {WORLD}: "
                                             f"start it with --nproc-per-node {WORLD} (got a "
                                             f"world of {world})")
    initialize.init()
    results = {}
    for name in names:
        _, (tp_size, pp_size), fn = TESTS[name]
        ps.initialize_model_parallel(tp_size, pp_size)
        line, values = fn()
        results[name] = values
        lines = gather_lines(f"rank {dist.get_rank()}: {line}")
        if lines is not None:
            print(f"== {name} (tp={tp_size}, pp={pp_size}) ==")
            print("\n".join(lines))
            print(f"{name}: passed on all {len(lines)} ranks")
        ps.destroy_model_parallel()
    launcher.report({"rank": dist.get_rank(), "tests": results})
    initialize.shutdown()


if __name__ == "__main__":
    main()
