"""The training loop's seams (mpu_lab.training.training): the callbacks it calls at their
three points, the checkpoint writer it hands to every save, and the metrics file whose folder
it makes (issue 37: ``--metrics-file runs/m.jsonl`` on a fresh clone).

One process (the module's one-rank gloo world), a tiny GPT. References: the model's own
parameters and gradients at each hook point (before the optimizer step the gradients exist
and no parameter has moved; after it they have), the loop's returned metrics, and the files
DCP wrote, against a save with DCP's own writer."""
import json

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from mpu_lab import training
from mpu_lab.training import checkpointing
from tiny_gpt import tiny_state



class Recorder(training.Callback):
    """Notes each hook point with the step count and what the model looks like there."""

    def __init__(self, model):
        self.model, self.events, self.start = model, [], None

    def weights(self):
        return [p.detach().clone() for p in self.model.parameters()]

    def on_step_begin(self, state):
        self.start = self.weights()
        self.events.append(("begin", state.iteration))

    def on_before_optimizer_step(self, state):
        grads = [p.grad for p in self.model.parameters()]
        self.events.append(("before_optimizer_step", state.iteration,
                            all(g is not None for g in grads),
                            sum(float(g.abs().sum()) for g in grads if g is not None) > 0,
                            all(torch.equal(a, b) for a, b in zip(self.start, self.weights()))))

    def on_step_end(self, state, step):
        moved = any(not torch.equal(a, b) for a, b in zip(self.start, self.weights()))
        self.events.append(("end", state.iteration, moved, step["lm_loss"]))


@pytest.mark.parametrize("step", ["train_step", "train_step_pipelined"])
def test_callbacks_are_called_at_their_points_in_order(world, step):
    """Both train steps (the pipelined one here on its one-stage schedule): before the
    forward, after the backward with the parameters not yet moved, after the loss average."""
    state = tiny_state()
    first, second = Recorder(state.model), Recorder(state.model)
    losses = [getattr(training, step)(state, [first, second])["lm_loss"] for _ in range(2)]
    assert [e[0] for e in first.events] == ["begin", "before_optimizer_step", "end"] * 2
    assert first.events == second.events
    for k in range(2):
        begin, before, end = first.events[3 * k: 3 * k + 3]
        assert begin == ("begin", k)
        assert before == ("before_optimizer_step", k, True, True, True)
        assert end == ("end", k + 1, True, losses[k])


def test_train_passes_its_callbacks_to_every_step(world):
    state = tiny_state()
    recorder = Recorder(state.model)
    metrics = training.train(state, log=lambda s: None, callbacks=[recorder])
    ends = [e for e in recorder.events if e[0] == "end"]
    assert [e[1] for e in ends] == [1, 2, 3]
    assert [e[3] for e in ends] == [m["lm_loss"] for m in metrics]    # log interval 1


def test_the_metrics_file_folder_is_made_when_missing(world, tmp_path):
    path = tmp_path / "runs" / "nested" / "m.jsonl"
    state = tiny_state("--metrics-file", path)
    metrics = training.train(state, log=lambda s: None)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [1, 2, 3]
    assert [r["lm_loss"] for r in lines] == [m["lm_loss"] for m in metrics]


class CountingWriter(FileSystemWriter):
    """DCP's file writer, noting the folder of each save it writes."""

    def __init__(self):
        super().__init__(".")
        self.folders = []

    def write_data(self, plan, planner):
        self.folders.append(self.path.name)
        return super().write_data(plan, planner)


def test_train_hands_its_storage_writer_to_every_save(world, tmp_path):
    writer = CountingWriter()
    state = tiny_state("--save", tmp_path / "ours", "--save-interval", 2)
    training.train(state, log=lambda s: None, storage_writer=writer)
    assert writer.folders == ["iter_0000002", "iter_0000003"]    # the interval, then the end
    reference = checkpointing.save_checkpoint(tmp_path / "dcp", state)   # DCP's own writer
    ours = checkpointing.verify_checkpoint(tmp_path / "ours" / "iter_0000003")
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in reference.iterdir())
    assert checkpointing.read_checkpoint_info(ours)["iteration"] == 3
