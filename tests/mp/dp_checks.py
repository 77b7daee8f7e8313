"""torchrun worker: Megatron's data parallelism (mpu_lab.core.distributed.DistributedDataParallel)
and distributed optimizer against the plain path (torch DDP / the explicit all-reduce, and
AdamW), at DP = 4 and at DP = 2 with TP = 2 (and sequence parallelism) or PP = 2; the
optimizer-state bytes per rank; a checkpoint saved with the distributed optimizer at DP = 4,
loaded at DP = 2 x TP = 2 and by the plain optimizer.

    torchrun --standalone --nproc-per-node 4 tests/mp/dp_checks.py CHECKPOINT_DIR

The bucket reductions of each run's last step are watched from outside the mirror
(:class:`BucketReductions`): which bucket each data-parallel collective reduced, of which kind,
and whether it started during backward.

Part of tests/mp/four_rank_checks.py (one 4-rank job for all 4-rank checks); every rank
reports a dict, tests/optimizer/test_distrib_optimizer.py asserts on it.
"""
import sys
from typing import List, Optional

import torch
import torch.distributed as dist

from mpu_lab.training import initialize
from mpu_lab import launcher, training
from mpu_lab.core import parallel_state
from mpu_lab.perf.comm_counts import CollectiveLog

BASE = ["--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 16,
        "--micro-batch-size", 2, "--global-batch-size", 8, "--vocab-size", 128,
        "--make-vocab-size-divisible-by", 32, "--lr", 3e-3, "--min-lr", 3e-4,
        "--lr-warmup-iters", 1, "--train-iters", 4, "--log-interval", 1, "--quiet"]
# name -> extra flags; at 4 ranks the data-parallel size is 4 / (TP x PP)
LAYOUTS = {"dp4": [],
           "tp2_sp_dp2": ["--tensor-model-parallel-size", 2, "--sequence-parallel"],
           "pp2_dp2": ["--pipeline-model-parallel-size", 2]}
MODES = {"plain": [],
         "overlap": ["--overlap-grad-reduce", "--ddp-bucket-size", 2000],
         "distributed": ["--use-distributed-optimizer", "--ddp-bucket-size", 3000],
         "distributed_overlap": ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                 "--ddp-bucket-size", 2000]}


def _args(*extra):
    args = training.parse_args([str(a) for a in BASE + list(extra)])
    return training.validate_args(args, dist.get_world_size())


def _state_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for st in optimizer.state.values()
               for t in st.values() if torch.is_tensor(t))


def _params_on_rank(state) -> int:
    return sum(p.numel() for chunk in state.model_chunks for p in chunk.parameters())


class BucketReductions(CollectiveLog):
    """While open: each data-parallel bucket reduction of ``ddp_chunks`` (Megatron-DDP
    wrappers), seen from outside them. torch's ``CommDebugMode`` (:class:`CollectiveLog`) sees
    every c10d all-reduce and reduce-scatter; one whose group is a wrapper's data-parallel
    group and whose input holds the values of one bucket's ``grad_data`` (``mpu_lab.core.comm``
    sends a copy) reduced that bucket. A hook on every parameter's gradient accumulation,
    registered after the wrapper's own (so it runs after it), marks how far backward got: a
    reduction started during backward when a gradient was accumulated after it was issued.
    :meth:`reductions`: ``[{"bucket", "kind", "started_in_backward"}]`` in the order issued."""

    KINDS = {"c10d.allreduce_": "all_reduce", "c10d._reduce_scatter_base_": "reduce_scatter"}

    def __init__(self, ddp_chunks):
        super().__init__()
        self.chunks = list(ddp_chunks)
        self.timeline: List[tuple] = []      # ("grad",) or ("reduction", bucket, kind)
        self._hooks = []

    def __enter__(self):
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for ddp in self.chunks for p in ddp.buffer.params]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)

    def _on_grad(self, param) -> None:
        self.timeline.append(("grad",))

    def _bucket(self, tensor: torch.Tensor, ranks: List[int]) -> Optional[int]:
        found = [b.index for ddp in self.chunks
                 if dist.get_process_group_ranks(ddp.data_parallel_group or dist.group.WORLD)
                 == ranks
                 for b in ddp.buffer.buckets
                 if b.numel == tensor.numel() and torch.equal(b.grad_data, tensor.to(b.grad_data))]
        return found[0] if len(found) == 1 else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = self.KINDS.get(str(getattr(func, "_overloadpacket", "")))
        if kind is not None:
            tensor = args[0][0] if kind == "all_reduce" else args[1]
            pg = next(a for a in args if isinstance(a, torch.ScriptObject))
            ranks = dist.get_process_group_ranks(dist.ProcessGroup.unbox(pg))
            bucket = self._bucket(tensor, ranks)     # before the op changes its input
            if bucket is not None:
                self.timeline.append(("reduction", bucket, kind))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def reductions(self) -> List[dict]:
        grads = [i for i, e in enumerate(self.timeline) if e[0] == "grad"]
        last_grad = grads[-1] if grads else -1
        return [dict(bucket=e[1], kind=e[2], started_in_backward=i < last_grad)
                for i, e in enumerate(self.timeline) if e[0] == "reduction"]


def _run(*extra, iters=None):
    state = training.setup(_args(*extra), log=lambda s: None)
    metrics = training.train(state, train_iters=iters, log=lambda s: None)
    return state, metrics


def _run_watching_the_last_step(*extra):
    """``_run`` to the end, the last step inside :class:`BucketReductions`: ``(state, metrics,
    that step's bucket reductions)``."""
    state = training.setup(_args(*extra), log=lambda s: None)
    metrics = training.train(state, train_iters=state.args.train_iters - 1, log=lambda s: None)
    with BucketReductions(state.ddp_chunks) as seen:
        metrics += training.train(state, log=lambda s: None)
    return state, metrics, seen.reductions()


def equality(out):
    # 3 steps each (the checkpoints below take BASE's 4): two optimizer updates are compared
    for layout, flags in LAYOUTS.items():
        for mode, more in MODES.items():
            state, metrics, reductions = _run_watching_the_last_step(*flags, *more,
                                                                     "--train-iters", 3)
            row = dict(losses=[m["lm_loss"] for m in metrics],
                       grad_norms=[m["grad_norm"] for m in metrics],
                       optimizer_state_bytes=_state_bytes(state.optimizer),
                       optimizer_state_entries=len(state.optimizer.state),
                       params=_params_on_rank(state),
                       data_parallel_size=parallel_state.get_data_parallel_world_size())
            if state.ddp_chunks:
                row["buckets"] = [b for ddp in state.ddp_chunks for b in ddp.buffer.table()]
                row["sync_log"] = reductions
            out.setdefault(layout, {})[mode] = row


def checkpoints(out, root):
    """Save at DP=4 with the distributed optimizer after 2 steps; the run goes on to 4.
    Loaded at DP=2 x TP=2 (distributed) and at DP=4 (plain), the next 2 steps must match."""
    save = f"{root}/dp4_distributed"
    dist_flags = ["--use-distributed-optimizer", "--ddp-bucket-size", 3000]
    state, first = _run(*dist_flags, iters=2)
    from_start = training.train(state, log=lambda s: None)   # steps 3-4 of the same run
    out["uninterrupted"] = [m["lm_loss"] for m in from_start]
    # the same two steps, saved and resumed
    _run(*dist_flags, "--save", save, iters=2)     # train() saves at its last iteration
    for name, flags in (("tp2_dp2_distributed", ["--tensor-model-parallel-size", 2, *dist_flags]),
                        ("dp4_plain", []),
                        ("dp4_distributed", dist_flags)):
        state = training.setup(_args(*flags, "--load", save), log=lambda s: None)
        resumed = training.train(state, log=lambda s: None)
        out[f"resumed_{name}"] = dict(iteration=resumed[0]["iteration"],
                                      losses=[m["lm_loss"] for m in resumed])


def checks(root):
    out = {}
    equality(out)
    checkpoints(out, root)
    return out


@launcher.entrypoint
def main():
    initialize.init()
    launcher.report(checks(sys.argv[1]))
    initialize.shutdown()


if __name__ == "__main__":
    main()
