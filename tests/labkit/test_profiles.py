"""Machine profiles (mpu_lab.labkit.profiles, labs/profiles/*.yaml): detection from a faked GPU
count, in-notebook resolution (only None is filled, explicit values win), every profile name
exists in the labs' parameters cells, the cpu profile is the committed defaults."""
import io
import pathlib

import nbformat
import pytest

from mpu_lab.labkit import notebooks, profiles

REPO = pathlib.Path(__file__).resolve().parents[2]
LABS = sorted((REPO / "labs").glob("*.ipynb"))


def _parameters(path):
    """The parameters cell's names and values (the cell is literal Python: run it)."""
    nb = nbformat.read(path, 4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    namespace = {}
    exec(cell.source, {}, namespace)
    return nb, namespace


@pytest.mark.parametrize("count, expected", [(0, "cpu"), (1, "1gpu"), (4, "1gpu"), (7, "1gpu"),
                                             (8, "8gpu"), (16, "8gpu")])
def test_detect_from_the_gpu_count(count, expected, monkeypatch):
    monkeypatch.delenv("MPU_LAB_DEVICE", raising=False)
    found = profiles.detect(device_count=count)
    assert found == expected and found.gpus == count
    assert f"torch.cuda.device_count() = {count}" in found.seen


def test_detect_asks_torch_when_not_told(monkeypatch):
    import torch
    monkeypatch.delenv("MPU_LAB_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert profiles.detect() == "1gpu"


def test_mpu_lab_device_cpu_means_the_cpu_profile(monkeypatch):
    monkeypatch.setenv("MPU_LAB_DEVICE", "cpu")
    found = profiles.detect(device_count=8)
    assert found == "cpu" and "MPU_LAB_DEVICE=cpu" in found.seen


def test_resolve_fills_only_none_and_prints_one_line(monkeypatch):
    monkeypatch.delenv("MPU_LAB_DEVICE", raising=False)
    ns = dict(profile="auto", world_size=4, backend="auto", tp=2, tp_sizes=None, resume_tp=None,
              steps=None, layers=None, hidden=None, heads=None, seq_length=None,
              vocab_size=None, dtype=None)
    out = io.StringIO()
    got = profiles.resolve("auto", "14_train_gpt", ns, device_count=0, out=out)
    assert got["tp_sizes"] == [1, 2, 4] and got["steps"] == 60 and got["dtype"] == "fp32"
    assert "tp" not in got                       # not machine-dependent: never touched
    line = out.getvalue()
    assert line.startswith("profile cpu (auto, torch.cuda.device_count() = 0): ")
    assert all(len(row) <= 100 for row in line.splitlines())      # wrapped, as outputs must be
    assert all(row.startswith("  ") for row in line.splitlines()[1:])
    assert "tp_sizes=[1, 2, 4]" in line and "dtype='fp32'" in line


def test_explicit_values_win(monkeypatch):
    """A value papermill injected (or the learner typed) is not None: the profile leaves it;
    world_size/backend are replaced only while they hold the cpu profile's value."""
    monkeypatch.delenv("MPU_LAB_DEVICE", raising=False)
    ns = dict(world_size=3, backend="gloo", tp_sizes=[1], resume_tp=None, steps=7, layers=None,
              hidden=None, heads=None, seq_length=None, vocab_size=None, dtype="fp32")
    got = profiles.resolve("8gpu", "14", ns, device_count=8, out=io.StringIO())
    assert "world_size" not in got and "backend" not in got
    assert "tp_sizes" not in got and "steps" not in got and "dtype" not in got
    assert got["layers"] == 24 and got["resume_tp"] == 8
    got = profiles.resolve("8gpu", "14", dict(ns, world_size=4, backend="auto"), device_count=8,
                           out=io.StringIO())
    assert got["world_size"] == 8 and got["backend"] == "nccl"


def test_a_bad_profile_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown profile '4gpu'.*cpu, 1gpu, 8gpu"):
        profiles.resolve("4gpu", "14", {}, device_count=0, out=io.StringIO())
    with pytest.raises(ValueError, match="does not exist"):
        profiles.load("no/such/profile.yaml")


def test_a_yaml_path_is_a_profile_on_top_of_cpu(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("14_train_gpt:\n  steps: 5\n")
    values = profiles.values_for(profiles.load(str(path)), "14_train_gpt")
    assert values["steps"] == 5 and values["layers"] == 2


def _profile_names(name, stem):
    """Names a profile file itself (not the cpu base) sets for a lab."""
    data = notebooks.load_params(profiles.profile_path(name))
    values = dict(data.get("all") or {})
    for section, own in data.items():
        if section != "all" and notebooks.selection.matches(pathlib.Path(stem + ".ipynb"), section):
            values.update(own)
    return values


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_profiles_match_the_parameters_cells(path):
    """Every profile's names exist in the lab's parameters cell; the cell writes exactly the
    names the GPU profiles set as None (world_size/backend stay literal, the cpu profile's
    values); the cpu profile gives every such name the committed default."""
    nb, cell = _parameters(path)
    declared = set(notebooks.declared_parameters(nb))
    assert cell["profile"] == "auto"
    cpu = profiles.values_for(profiles.load("cpu"), path.stem)
    gpu_names = set()
    for name in profiles.NAMES:
        values = profiles.values_for(profiles.load(name), path.stem)
        assert set(values) <= declared, (name, sorted(set(values) - declared))
        assert set(values) == set(cpu), name              # cpu is the base of every profile
        if name != "cpu":
            gpu_names |= set(_profile_names(name, path.stem)) & declared
    literal = set(profiles.LITERAL_DEFAULTS)
    assert {k for k, v in cell.items() if v is None} == gpu_names - literal
    assert set(cpu) == gpu_names | (literal & declared)
    for key in literal & declared:
        assert cell[key] == cpu[key], key


def test_cpu_profile_is_the_committed_defaults():
    """The resolve cell's committed output (executed on a CPU) shows the cpu profile's values."""
    for path in LABS:
        nb, _ = _parameters(path)
        cell = next(c for c in nb.cells if "profiles.resolve(" in c.source)
        text = "".join(o.get("text", "") for o in cell.outputs)
        cpu = profiles.values_for(profiles.load("cpu"), path.stem)
        assert text.startswith("profile cpu (auto, torch.cuda.device_count() = 0): "), path.name
        for key, value in cpu.items():
            assert f"{key}={value!r}" in text, (path.name, key)


def test_profile_files_pass_the_parameters_checks():
    paths = notebooks.notebook_paths(REPO)
    for name in profiles.NAMES:
        notebooks.check_param_sections(paths, notebooks.load_params(profiles.profile_path(name)))


def test_params_8gpu_is_the_8gpu_profile():
    assert notebooks.load_params(REPO / "labs" / "params_8gpu.yaml") == \
        notebooks.load_params(REPO / "labs" / "profiles" / "8gpu.yaml")


def test_gpu_profiles_keep_lab_07_comparable():
    """Every TP size must divide the heads and build the same padded vocabulary, or the loss
    curves of lab 14 could not coincide."""
    from mpu_lab.core.models.gpt.gpt_model import pad_vocab_size
    for name in ("1gpu", "8gpu"):
        v = profiles.values_for(profiles.load(name), "14_train_gpt")
        sizes = v["tp_sizes"] + [v["resume_tp"], 2]
        assert all(v["heads"] % t == 0 and v["hidden"] % v["heads"] == 0 for t in sizes)
        assert len({pad_vocab_size(v["vocab_size"], 128, t) for t in sizes}) == 1, name
        assert max(sizes) <= v["world_size"]
    v8 = profiles.values_for(profiles.load("8gpu"), "15_performance")
    assert v8["layers"] % v8["world_size"] == 0 and v8["global_batch"] % v8["world_size"] == 0
