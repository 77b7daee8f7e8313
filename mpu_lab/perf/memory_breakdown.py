"""Where a training run's memory goes, per rank: measured from the run's own tensors, next to the
cost model's prediction (lab 04).

The names lab 04 calls (stable):

* :func:`measure_state_bytes` ``(state) -> dict`` — one rank of a
  :class:`~mpu_lab.training.TrainState` after at least one ``train_step`` (so Adam's states
  exist): bytes of parameters, gradients, optimizer states and activations;
* :func:`run_memory_breakdown` ``(configs, nproc, distributed_optimizer=(False, True),
  **model_kwargs) -> rows`` — runs ``launch/memory_breakdown.py`` (one torchrun job) for
  several ``(t, p, d)``; a row is a dict ``config, tp, pp, dp, optimizer, rank, term, measured,
  predicted, note``;
* :func:`format_memory_table` ``(rows) -> str``; the picture is
  ``mpu_lab.labkit.data_parallel.viz.plot_memory_breakdown(rows)``.

**Measured** (every storage counted once, ``untyped_storage().nbytes()``):

* *parameters*: on the mirror's :class:`~mpu_lab.core.distributed.DistributedDataParallel` path
  every ``.data`` is a view into one flat buffer per model chunk: the buffer's **padded** size
  (each bucket padded to a multiple of d); torch DDP and no DDP: one storage per parameter;
* *gradients*: the storages of ``.grad`` and ``.main_grad`` (the mirror's flat buffer, padded).
  torch DDP's reducer also keeps bucket copies of the gradients: not counted here;
* *optimizer*: every tensor in ``state.optimizer.state``'s values: AdamW's two moments (4 + 4
  bytes per parameter) and a 4-byte ``step`` counter per parameter tensor (per shard with the
  distributed optimizer, whose states cover this rank's shards only);
* *activations*: what autograd saves during one micro-batch's forward through the rank's model
  chunk (:class:`~mpu_lab.perf.saved_activations.SavedTensors`, parameters left out) times the
  micro-batches in flight: 1 at PP = 1, ``min(p - r, m)`` on stage r under 1F1B, ``m`` under
  GPipe (Narayanan et al. 2021 §2.2). On CUDA :class:`PhasePeaks` adds
  ``torch.cuda.max_memory_allocated`` by phase of the first step.

**Predicted**: :func:`mpu_lab.perf.cost_model.counts.memory_per_gpu` for the first stage, at
the fp32/fp32 row of Megatron-core's table (:func:`mpu_lab_bytes_per_parameter`: 4 + 4 + 8 =
16 bytes per parameter, 8 + 8/d with the distributed optimizer), not Megatron's bf16 one
(2 + 4 + 12 = 18): mpu_lab's mixed precision is ``torch.autocast`` over fp32 parameters, so
with or without ``--bf16`` its weights, gradient buffer and Adam moments are fp32, with no
fp32 main copy of either. Another stage is scaled by its parameter count
(``parameters_per_gpu(..., stage)``) and its micro-batches in flight. Where the model differs
from mpu_lab's GPT (Narayanan et al. 2021 §5.1, Korthikanti et al. 2022 Table 2):

* parameters: the row-parallel biases and LayerNorms, replicated over TP, are counted /t; the
  final LayerNorm (2h) is left out; no bucket padding (``V``: the padded vocabulary);
* activations: Table 2's 16-bit terms x 4/2, dropout masks included (dropout is 0 here),
  LayerNorm statistics and the causal mask left out; the ``5as/h`` scores are left out as
  ``flash_attention`` when the GPT's attention is SDPA (its default); the embedding, output
  layer, logits and loss are not counted at all
  (:func:`~mpu_lab.perf.saved_activations.mpu_lab_terms` matches a layer byte for byte).
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from mpu_lab.training import initialize
from mpu_lab import launcher
from mpu_lab.core import parallel_state
from mpu_lab.core.pipeline_parallel import canonical_schedule
from mpu_lab.perf.saved_activations import SavedTensors
from mpu_lab.perf.cost_model.counts import memory_per_gpu, parameters_per_gpu
from mpu_lab.perf.cost_model.inputs import ModelShape, ParallelConfig
from mpu_lab.perf.cost_model.optimizer_state import DTYPE_BYTES, bytes_per_parameter
from mpu_lab.training import (build_parser, get_batch, masked_mean_loss, model_config,
                              parse_args, validate_args)

__all__ = ["MPU_LAB_PARAMS_DTYPE", "MPU_LAB_GRADS_DTYPE", "mpu_lab_bytes_per_parameter",
           "TERMS", "OPTIMIZERS", "DEFAULT_MODEL", "measure_state_bytes",
           "measure_activation_bytes", "microbatches_in_flight", "predict_rank", "rank_rows",
           "PhasePeaks", "training_argv", "precheck", "run_memory_breakdown",
           "format_memory_table", "format_cuda_phases", "order_rows", "Rows"]

# What mpu_lab's trainer keeps, whatever --bf16/--fp16 autocasts to (module docstring).
MPU_LAB_PARAMS_DTYPE, MPU_LAB_GRADS_DTYPE = "fp32", "fp32"
TERMS = ("parameters", "gradients", "optimizer", "activations")
OPTIMIZERS = {False: "AdamW", True: "distributed"}      # --use-distributed-optimizer
PHASES = ("model build", "forward", "backward", "optimizer step")
# the tiny GPT of lab 04 (train_gpt.py flag names without the dashes)
DEFAULT_MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                     vocab_size=512, micro_batch_size=2)
_OWN_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
              "--num-layers-per-virtual-pipeline-stage", "--use-distributed-optimizer")


# --------------------------------------------------------------------------- measuring
def _storage_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> Tuple[int, int]:
    """``(bytes, storages)`` of the distinct storages behind ``tensors`` (None skipped)."""
    seen: Dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen.setdefault(s.data_ptr(), s.nbytes())
    return sum(seen.values()), len(seen)


def _params(state) -> List[torch.nn.Parameter]:
    return list({id(p): p for c in state.model_chunks for p in c.parameters()}.values())


def microbatches_in_flight(args, pipeline_rank: int) -> int:
    """Micro-batches whose activations pipeline stage ``pipeline_rank`` holds at its peak:
    1 without pipelining, ``min(p - r, m)`` under 1F1B, ``m`` under GPipe. The interleaved
    schedule is not modelled here (ValueError)."""
    p, m = args.pipeline_model_parallel_size, args.num_micro_batches
    schedule = canonical_schedule(args.pipeline_schedule) if args.pipeline_schedule else None
    if p == 1 or schedule in ("1f1b", "gpipe"):
        return 1 if p == 1 else min(p - pipeline_rank, m) if schedule == "1f1b" else m
    raise ValueError(f"memory accounting models the 1f1b and gpipe schedules, not "
                     f"{args.pipeline_schedule!r}")


def measure_activation_bytes(state) -> SavedTensors:
    """What autograd saves during one micro-batch's forward (micro-batch 0 of step 0) through
    this rank's model chunk, loss included on the last stage; a middle or last stage gets a
    ``[s(/t), b, h]`` input in place of the previous stage's message. The graph is dropped, no
    backward runs, no gradient changes. Collective over the tensor-parallel group."""
    args, chunk = state.args, state.model_chunks[0]
    batch = get_batch(state, 0, 0)
    t = parallel_state.get_tensor_model_parallel_world_size()
    rows = args.seq_length // t if args.sequence_parallel else args.seq_length
    labels = batch["labels"] if chunk.post_process else None
    with SavedTensors(exclude=_params(state)) as saved:
        if chunk.pre_process:
            out = chunk(batch["tokens"], batch["position_ids"], labels=labels)
        else:
            x = torch.zeros(rows, args.micro_batch_size, args.hidden_size,
                            device=initialize.get_device(), requires_grad=True)
            out = chunk(decoder_input=x, labels=labels)
        if chunk.post_process:
            out = masked_mean_loss(out, batch["loss_mask"])
    del out
    return saved


def measure_state_bytes(state, activations: bool = True) -> Dict[str, Any]:
    """This rank's bytes by term, from the run's own tensors (see the module docstring):
    ``parameters``, ``gradients``, ``optimizer``, ``activations`` (``per_micro_batch`` x
    ``in_flight``); also ``param_count`` (elements of the distinct parameters),
    ``flat_buffer`` (parameters are views of fewer storages than there are parameters),
    ``optimizer_states`` (tensors the optimizer keeps a state for) and ``step_bytes`` (its
    0-dim step counters, part of ``optimizer``). Call it on every rank after a
    ``train_step``; ``activations=False`` skips the forward (then it is not collective)."""
    params = _params(state)
    p_bytes, p_storages = _storage_bytes(params)
    g_bytes, _ = _storage_bytes([p.grad for p in params]
                                + [getattr(p, "main_grad", None) for p in params])
    o_tensors = [v for st in state.optimizer.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor)]
    if not o_tensors:
        raise ValueError("the optimizer has no state yet: run train_step(state) once first "
                         "(AdamW creates its moments at the first step)")
    out = dict(parameters=p_bytes, gradients=g_bytes, optimizer=_storage_bytes(o_tensors)[0],
               param_count=sum(p.numel() for p in params), flat_buffer=p_storages < len(params),
               optimizer_states=len(state.optimizer.state),
               step_bytes=_storage_bytes([v for v in o_tensors if v.dim() == 0])[0])
    if activations:
        per_mb = measure_activation_bytes(state).bytes
        n = microbatches_in_flight(state.args, parallel_state.get_pipeline_model_parallel_rank())
        out.update(activations=per_mb * n, per_micro_batch=per_mb, in_flight=n)
    return out


class PhasePeaks:
    """``torch.cuda.max_memory_allocated`` by phase, the peak reset between phases; does
    nothing on the CPU (``peaks`` stays empty). ``start()`` before building the model,
    ``mark("model build")`` after; ``instrument(state)`` marks the end of each forward of a
    model chunk ("forward"), the start of the optimizer step ("backward": the backward,
    gradient reductions and clipping) and its end ("optimizer step"); exact with one
    micro-batch per step (the lab's runs), with more the phases interleave."""

    def __init__(self, device: torch.device):
        self.enabled, self.device, self.peaks = device.type == "cuda", device, {}

    def start(self) -> None:
        if self.enabled:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def mark(self, phase: str) -> None:
        if self.enabled:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.peaks[phase] = max(self.peaks.get(phase, 0), peak)
            torch.cuda.reset_peak_memory_stats(self.device)

    def instrument(self, state):
        """Hooks for one step; returns a callable that removes them."""
        handles = [c.register_forward_hook(lambda *_: self.mark("forward"))
                   for c in state.model_chunks]
        optimizer, step = state.optimizer, state.optimizer.step

        def timed_step(*a, **k):
            self.mark("backward")
            out = step(*a, **k)
            self.mark("optimizer step")
            return out

        optimizer.step = timed_step

        def remove():
            [h.remove() for h in handles]
            del optimizer.step            # the class's own step again
        return remove


# --------------------------------------------------------------------------- predicting
def mpu_lab_bytes_per_parameter(distributed_optimizer: bool = False,
                                data_parallel_size: int = 1) -> float:
    """Bytes per parameter of mpu_lab's own training (fp32 weights, gradients, Adam m and v:
    16, or 8 + 8/d with the distributed optimizer), beside Megatron's figures."""
    return bytes_per_parameter(MPU_LAB_PARAMS_DTYPE, MPU_LAB_GRADS_DTYPE,
                               distributed_optimizer, data_parallel_size)


def predict_rank(args, pipeline_rank: int, distributed_optimizer: bool) -> Dict[str, float]:
    """The cost model's bytes for pipeline stage ``pipeline_rank`` of the run ``args``:
    :func:`memory_per_gpu` (``dtype_bytes=4``) for the first stage; another stage scales its
    weights, gradients and optimizer by ``parameters_per_gpu(stage) / parameters_per_gpu
    ("first")`` and its activations by its micro-batches in flight over the first stage's."""
    model = ModelShape(args.num_layers, args.hidden_size, args.num_attention_heads,
                       args.seq_length, args.padded_vocab_size, args.ffn_hidden_size)
    cfg = ParallelConfig(
        tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
        dp=args.data_parallel_size, micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size, sequence_parallel=args.sequence_parallel,
        schedule="gpipe" if args.pipeline_schedule and canonical_schedule(
            args.pipeline_schedule) == "gpipe" else "1f1b",
        flash_attention=model_config(args).attention_impl == "sdpa",
        distributed_optimizer=distributed_optimizer)
    first = memory_per_gpu(model, cfg, dtype_bytes=DTYPE_BYTES[MPU_LAB_PARAMS_DTYPE],
                           grad_bytes=DTYPE_BYTES[MPU_LAB_GRADS_DTYPE])
    stage = "first" if pipeline_rank == 0 else "last" if pipeline_rank == cfg.pp - 1 \
        else "middle"
    ratio = parameters_per_gpu(model, cfg, stage) / parameters_per_gpu(model, cfg, "first")
    flight = microbatches_in_flight(args, pipeline_rank) / microbatches_in_flight(args, 0)
    return dict(parameters=first["weights"] * ratio, gradients=first["gradients"] * ratio,
                optimizer=first["optimizer"] * ratio,
                activations=first["activations"] * flight)


def rank_rows(args, measured: Dict[str, Any], distributed_optimizer: bool, rank: int,
              peaks: Optional[Dict[str, int]] = None) -> List[Dict[str, Any]]:
    """One row per term (and per CUDA phase, term ``"peak: <phase>"``) for one rank."""
    t, p, d = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
               args.data_parallel_size)
    pred = predict_rank(args, parallel_state.get_pipeline_model_parallel_rank(),
                        distributed_optimizer)
    flat = "flat buffer (padded)" if measured["flat_buffer"] else "one storage per tensor"
    notes = dict(parameters=f"{measured['param_count']} parameters, {flat}", gradients=flat,
                 optimizer=f"2 moments + step of {measured['optimizer_states']} tensors",
                 activations=f"{measured.get('per_micro_batch')} B x "
                             f"{measured.get('in_flight')} micro-batch(es) in flight")
    base = dict(config=f"t={t} p={p} d={d}", tp=t, pp=p, dp=d,
                optimizer=OPTIMIZERS[distributed_optimizer], rank=rank,
                detail={k: v for k, v in measured.items() if k not in TERMS})
    rows = [dict(base, term=k, measured=int(measured[k]), predicted=float(pred[k]),
                 note=notes[k]) for k in TERMS if k in measured]
    alive = {"model build": ("parameters",), "forward": ("parameters", "activations"),
             "backward": ("parameters", "gradients", "activations"),
             "optimizer step": ("parameters", "gradients", "optimizer")}
    for phase, peak in (peaks or {}).items():
        rows.append(dict(base, term=f"peak: {phase}", measured=int(peak),
                         predicted=float(sum(pred[k] for k in alive[phase])),
                         note="max_memory_allocated; predicted: " + " + ".join(alive[phase])))
    return rows


# --------------------------------------------------------------------------- the job
def training_argv(rest: Sequence[str], config: Sequence[int], distributed_optimizer: bool
                  ) -> List[str]:
    """``train_gpt.py`` flags for one configuration: :data:`DEFAULT_MODEL` where ``rest``
    gives no value, then ``rest``, the sizes ``t``, ``p`` and the optimizer flag."""
    rest = [str(a) for a in rest]
    argv = []
    for key, value in DEFAULT_MODEL.items():
        flag = "--" + key.replace("_", "-")
        if flag not in rest:
            argv += [flag, str(value)]
    argv += ["--train-iters", "1", "--quiet"] + rest
    argv += ["--tensor-model-parallel-size", str(config[0]),
             "--pipeline-model-parallel-size", str(config[1])]
    return argv + (["--use-distributed-optimizer"] if distributed_optimizer else [])


def parse_configs(texts: Sequence[str], nproc: int) -> List[Tuple[int, int, int]]:
    """``["1,1,4", "2,1,2"]`` -> ``[(1, 1, 4), (2, 1, 2)]``, each with t x p x d = nproc."""
    out = []
    for text in texts:
        try:
            t, p, d = (int(x) for x in str(text).split(","))
        except ValueError:
            raise ValueError(f"a configuration is 't,p,d' (three integers), got {text!r}") from None
        if min(t, p, d) < 1 or t * p * d != nproc:
            raise ValueError(f"configuration (t, p, d) = ({t}, {p}, {d}): t x p x d must equal "
                             f"the {nproc} ranks of the job, got {t * p * d}")
        out.append((t, p, d))
    return out


def precheck(argv: Sequence[str], nproc: int, cwd=None):
    """``launch/memory_breakdown.py``'s pre-check (its ``PRECHECK``): parse its own flags and
    validate the training flags of every configuration for ``nproc`` ranks, before torchrun
    starts. Returns ``(own args, other flags, [(config, distributed optimizer?, train
    args), ...])``."""
    p = argparse.ArgumentParser(prog="memory_breakdown.py")
    p.add_argument("--configs", nargs="+", required=True, metavar="T,P,D")
    p.add_argument("--optimizers", nargs="+", choices=list(OPTIMIZERS.values()),
                   default=list(OPTIMIZERS.values()))
    own, rest = p.parse_known_args([str(a) for a in argv])
    clash = [f for f in rest if f.split("=")[0] in _OWN_FLAGS]
    if clash:
        raise ValueError(f"memory_breakdown.py sets {clash} itself (from --configs and "
                         f"--optimizers); leave them out")
    dist_opt = [name == OPTIMIZERS[True] for name in own.optimizers]
    if any(dist_opt) and "--use-distributed-optimizer" not in build_parser()._option_string_actions:
        raise ValueError("--optimizers distributed needs train_gpt.py's "
                         "--use-distributed-optimizer, which this checkout does not have yet")
    runs = []
    for config in parse_configs(own.configs, nproc):
        for use in dist_opt:
            args = validate_args(parse_args(training_argv(rest, config, use)), nproc)
            microbatches_in_flight(args, 0)           # a schedule this module models
            runs.append((config, use, args))
    return own, rest, runs


class Rows(list):
    elapsed_s: float = 0.0      # the rows of run_memory_breakdown, and its job's wall time


def order_rows(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``rows`` by configuration and optimizer (in order of first appearance), rank, term."""
    configs = list(dict.fromkeys(r["config"] for r in rows))
    optimizers = list(dict.fromkeys(r["optimizer"] for r in rows))

    def key(r):
        term = TERMS.index(r["term"]) if r["term"] in TERMS else \
            len(TERMS) + PHASES.index(r["term"][len("peak: "):])
        return configs.index(r["config"]), optimizers.index(r["optimizer"]), r["rank"], term
    return sorted(rows, key=key)


def run_memory_breakdown(configs: Sequence[Sequence[int]], nproc: int,
                         distributed_optimizer: Sequence[bool] = (False, True),
                         timeout_s: float = 300.0, **model_kwargs) -> Rows:
    """Measure and predict each rank's memory at every ``(t, p, d)`` of ``configs`` (each
    with t x p x d = ``nproc``) and each optimizer (``False``: AdamW, ``True``: the
    distributed optimizer), in one torchrun job of ``nproc`` ranks that re-initialises the
    groups per configuration (``launch/memory_breakdown.py``). ``model_kwargs``:
    ``train_gpt.py`` flags by their Python names (``hidden_size=128``,
    ``sequence_parallel=True``, ``global_batch_size=16``); :data:`DEFAULT_MODEL` otherwise.
    Returns rows (dicts: ``config, tp, pp, dp, optimizer, rank, term, measured, predicted,
    note``) ordered by configuration, optimizer, rank, term; on CUDA also the
    ``"peak: <phase>"`` rows of :class:`PhasePeaks`. Bad input raises ``ValueError`` before
    any process starts."""
    uses = [bool(u) for u in distributed_optimizer]
    if not uses or len(set(uses)) != len(uses):
        raise ValueError(f"distributed_optimizer must list False and/or True once each, got "
                         f"{tuple(distributed_optimizer)}")
    names = [",".join(str(x) for x in c) if not isinstance(c, str) else c for c in configs]
    if not names:
        raise ValueError("configs is empty: give (t, p, d) tuples, e.g. [(1, 1, 4), (2, 1, 2)]")
    argv = ["--configs", *names, "--optimizers", *[OPTIMIZERS[u] for u in uses]]
    for key, value in model_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    job = launcher.run("memory_breakdown.py", argv, nproc=nproc, show="none",
                       timeout_s=timeout_s)
    rows = Rows(order_rows([row for r in job.results for row in (r or [])]))
    rows.elapsed_s = job.elapsed_s
    return rows


def _table(rows: List[Dict[str, Any]], columns: Sequence[str], title: str,
           total: bool) -> str:
    """One line per (configuration, optimizer, rank): ``measured / predicted`` KiB per column."""
    cells: Dict[Tuple[str, str, int], Dict[str, Dict[str, Any]]] = {}
    for r in rows:
        name = r["term"][len("peak: "):] if r["term"].startswith("peak: ") else r["term"]
        if name in columns:
            cells.setdefault((r["config"], r["optimizer"], r["rank"]), {})[name] = r

    def kib(x) -> str:        # whole KiB from 10^4 on: a DGX run's rows stay within 100 characters
        return f"{x / 1024:.1f}" if x < 10_000 * 1024 else f"{x / 1024:.0f}"

    def text(measured, predicted) -> str:
        return f"{kib(measured)}/{kib(predicted)}"
    heads = list(columns) + (["total"] if total else [])
    body = []
    for (config, optimizer, rank), got in cells.items():
        row = [text(got[c]["measured"], got[c]["predicted"]) if c in got else "-"
               for c in columns]
        if total:
            row.append(text(sum(r["measured"] for r in got.values()),
                            sum(r["predicted"] for r in got.values())))
        body.append((f"{config:<13}{optimizer:<12}{rank:>4}", row))
    # each column as wide as its widest cell, two spaces apart; one where that passes 100
    # characters (a DGX run's sizes)
    for gap in (2, 1):
        width = [max([len(h)] + [len(row[i]) for _, row in body]) + gap
                 for i, h in enumerate(heads)]
        lines = [title, f"{'config':<13}{'optimizer':<12}{'rank':>4}"
                 + "".join(f"{h:>{w}}" for h, w in zip(heads, width))]
        lines += [lead + "".join(f"{c:>{w}}" for c, w in zip(row, width)) for lead, row in body]
        if max(map(len, lines[1:])) <= 100:
            break
    return "\n".join(lines)


def format_memory_table(rows: List[Dict[str, Any]]) -> str:
    """One line per configuration, optimizer and rank: each term's measured / predicted KiB
    and the total."""
    return _table(rows, TERMS, "KiB per rank, measured/predicted (cost model, fp32: "
                               "4 + 4 + 8 bytes per parameter)", total=True)


def format_cuda_phases(rows: List[Dict[str, Any]]) -> str:
    """The CUDA phase peaks (``"peak: <phase>"`` rows) per rank, measured / predicted KiB;
    a line saying there are none on a CPU run."""
    if not any(r["term"].startswith("peak: ") for r in rows):
        return ("no CUDA phase peaks: this run was on the CPU "
                "(torch.cuda.max_memory_allocated exists on a GPU only)")
    return _table(rows, PHASES, "torch.cuda.max_memory_allocated by phase of the first step, "
                                "KiB, measured / predicted (the terms alive in the phase; no "
                                "temporaries)", total=False)
