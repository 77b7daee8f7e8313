"""``--pipeline-schedule`` with torch's names (mpu_lab.training.parallel_args): any case is
accepted and torch's name is stored; the zero-bubble schedules' impossible configurations are
refused in flag names before any process starts, and every value a refusal suggests works."""
import pytest

from mpu_lab import training
from mpu_lab.training.flag_errors import NPROC, FlagError

P, S = "--pipeline-model-parallel-size", "--pipeline-schedule"


def validate(flags, world_size):
    return training.validate_args(training.parse_args([str(f) for f in flags]), world_size)


@pytest.mark.parametrize("given,stored", [
    ("gpipe", "GPipe"), ("AFAB", "GPipe"), ("1f1b", "1F1B"), ("1F1B", "1F1B"),
    ("zbh1", "ZBH1"), ("ZB-H1", "ZBH1"), ("zbvzerobubble", "ZBVZeroBubble"),
    ("ZBVZeroBubble", "ZBVZeroBubble"), ("dualpipev", "DualPipeV"), (None, "1F1B")])
def test_names_in_any_case_are_stored_as_torch_names(given, stored):
    flags = [P, 2, "--num-layers", 8, "--micro-batch-size", 1, "--global-batch-size", 8] + \
        ([S, given] if given else [])
    assert validate(flags, 2).pipeline_schedule == stored


def test_interleaved_by_either_name_is_stored_as_interleaved1f1b():
    for given in ("interleaved", "Interleaved1F1B"):
        args = validate([P, 2, "--num-layers", 8, "--num-layers-per-virtual-pipeline-stage", 2,
                         "--global-batch-size", 32, S, given], 2)
        assert (args.pipeline_schedule, args.virtual_pipeline_model_parallel_size) == \
            ("Interleaved1F1B", 2)


REFUSED = [
    ([P, 2, "--num-layers", 6, S, "ZBVZeroBubble"], 2,
     "ZBVZeroBubble cuts the model into 2 x --pipeline-model-parallel-size 2 = 4 chunks.*"
     "--num-layers 6 is not divisible by 4"),
    ([P, 2, "--num-layers", 8, S, "DualPipeV", "--micro-batch-size", 1, "--global-batch-size", 2],
     2, "DualPipeV needs at least 2 x --pipeline-model-parallel-size 2 = 4 micro-batches per "
        "step .* = 2"),
    ([P, 2, "--num-layers", 4, S, "zigzag"], 2,
     "--pipeline-schedule zigzag is not a pipeline schedule; choose one of GPipe, 1F1B, "
     "Interleaved1F1B, ZBH1, ZBVZeroBubble, DualPipeV"),
    ([P, 2, "--num-layers", 4, S, "ZBH1", "--overlap-grad-reduce"], 2,
     "ZBH1 with --overlap-grad-reduce"),
    ([P, 2, "--num-layers", 8, S, "zbh1", "--num-layers-per-virtual-pipeline-stage", 2], 2,
     "runs one model chunk per stage"),
    ([P, 2, "--num-layers", 4, S, "ZBVZeroBubble", "--record-timeline"], 2,
     "ZBVZeroBubble with --record-timeline: .*--timeline-file PATH"),
]


@pytest.mark.parametrize("flags,world,message", REFUSED, ids=[r[2][:30] for r in REFUSED])
def test_refused_in_flag_names_and_every_suggestion_works(flags, world, message):
    with pytest.raises(FlagError, match=message) as err:
        validate(flags, world)
    assert err.value.fixes
    for flag, values in err.value.fixes.items():
        for value in values:
            if flag == NPROC:
                validate(flags, value)
                continue
            edited = [f for i, f in enumerate(flags)
                      if f != flag and (i == 0 or flags[i - 1] != flag or
                                        str(f).startswith("--"))]
            if value is True:
                edited.append(flag)
            elif value not in (None, False):
                edited += [flag, value]
            validate(edited, world)


def test_timeline_file_needs_a_pipeline():
    with pytest.raises(ValueError, match="--timeline-file needs --pipeline-model-parallel-size > 1"):
        validate(["--timeline-file", "t.json"], 1)
