"""ZB-H1 against 1F1B, timed on this machine: one pipeline, each rank on a core of its own.

    torchrun --standalone --nproc-per-node 2 launch/zero_bubble_timing.py --microbatches 8

Every rank is one pipeline stage of a small GPT (the mirror's ``GPTModel``: its linear layers
can hold back their weight-gradient GEMMs). On a CPU each rank first pins itself to a core of
its own with one thread (:func:`mpu_lab.perf.pipeline_bubble.pin_this_rank`, as lab 11's
bubble measurement), so that a rank that waits leaves its core idle, as a GPU would. After a
warm-up iteration of each, it runs ``--iterations`` iterations of 1F1B (Megatron's loop) and of
ZBH1 (the action-list runtime) in turn, so a slow spell of the machine hits both alike. Each
rank reads its own clocks: the wall time of an iteration between two barriers, its main
thread's CPU time (a rank that waits for a message sleeps), and at every action the
schedule reports (``action_callback``) both clocks again, which gives each action's CPU time.
Every rank reports its numbers to the launcher; rank 0 prints one line per schedule.
"""
import os
import time

import torch

from mpu_lab import launcher
from mpu_lab.core import parallel_state as ps
from mpu_lab.core.models.gpt import build_model_chunks
from mpu_lab.core.pipeline_parallel import (
    get_forward_backward_func, sync_embedding_weights, unwrap_model)
from mpu_lab.core.transformer.transformer_config import TransformerConfig
from mpu_lab.perf import pipeline_bubble, rank_clock
from mpu_lab.training import flag_errors, initialize

SCHEDULES = ("1F1B", "ZBH1")


def make_batches(args, device):
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(args.microbatches):
        ids = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1),
                            # cpu: a CPU generator, moved below
                            generator=g)
        out.append({"tokens": ids[:, :-1].to(device), "labels": ids[:, 1:].to(device),
                    "position_ids": torch.arange(args.seq_length, device=device)})
    return out


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    chunk = unwrap_model(model)
    labels = batch["labels"] if chunk.post_process else None
    output = (model(batch["tokens"], batch["position_ids"], labels=labels) if chunk.pre_process
              else model(labels=labels))

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach()}
    return output, loss_func


def one_iteration(schedule, chunk, batches, args, group):
    """One iteration of ``schedule``: wall and CPU time, and each action's (kind, CPU seconds)."""
    marks = []

    def seen(kind, microbatch, model_chunk):
        marks.append((kind, time.thread_time()))
    chunk.zero_grad(set_to_none=True)
    torch.distributed.barrier(group=group)
    wall, cpu = time.perf_counter(), time.thread_time()
    get_forward_backward_func(schedule)(
        forward_step_func=forward_step, data_iterator=iter(batches), model=chunk,
        num_microbatches=args.microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, action_callback=seen)
    end_cpu = time.thread_time()
    torch.distributed.barrier(group=group)        # the iteration ends when the last stage does
    wall = time.perf_counter() - wall
    ends = [t for _, t in marks[1:]] + [end_cpu]
    return {"wall_s": wall, "cpu_s": end_cpu - cpu,
            "actions": [[kind, end - start] for (kind, start), end in zip(marks, ends)]}


@launcher.entrypoint
def main():
    parser = flag_errors.ArgumentParser(description="ZB-H1 against 1F1B, timed per rank")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--num-layers-per-stage", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=256)
    args = parser.parse_args()
    if args.microbatches < 1 or args.iterations < 1:
        parser.error(f"--microbatches ({args.microbatches}) and --iterations "
                     f"({args.iterations}) must be >= 1")
    cores_available = len(rank_clock.usable_cores())
    core = pipeline_bubble.pin_this_rank()     # before the process group: its threads inherit it
    initialize.init()
    device = initialize.get_device()
    p = int(os.environ["WORLD_SIZE"])
    ps.initialize_model_parallel(pipeline_model_parallel_size=p)
    config = TransformerConfig(num_layers=args.num_layers_per_stage * p,
                               hidden_size=args.hidden_size, num_attention_heads=4)
    torch.manual_seed(1234)
    (chunk,) = [c.to(device) for c in build_model_chunks(config, args.vocab_size,
                                                          args.seq_length)]
    sync_embedding_weights([chunk])
    batches = make_batches(args, device)
    group = ps.get_pipeline_model_parallel_group()
    runs = {s: [] for s in SCHEDULES}
    for i in range(1 + args.iterations):          # the first of each is a warm-up
        for schedule in SCHEDULES:
            result = one_iteration(schedule, chunk, batches, args, group)
            if i > 0:
                runs[schedule].append(result)
    launcher.report({"core": core, "cores_available": cores_available, "runs": runs,
                     "device": str(device)})
    for schedule in SCHEDULES:
        wall = sum(r["wall_s"] for r in runs[schedule])
        busy = sum(r["cpu_s"] for r in runs[schedule])
        lines = launcher.gather_lines(f"{schedule}, rank {ps.get_pipeline_model_parallel_rank()}: "
                                      f"busy {busy:.3f} s of {wall:.3f} s")
        if lines is not None:
            print("\n".join(lines))
    ps.destroy_model_parallel()
    initialize.shutdown()


if __name__ == "__main__":
    main()
