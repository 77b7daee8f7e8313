"""Random-number streams for tensor parallelism, on CPU and on CUDA (Megatron-core's
``core/tensor_parallel/random.py``).

Why two streams (Shoeybi et al. 2019, appendix B.2, "Model Parallel Random Number
Generation"): dropout *outside* a tensor-parallel region acts on activations that every rank
of the group holds in full (the output of ``g``'s all-reduce, the residual stream), so all
ranks must draw the same mask, or their copies drift apart — they use the ordinary (default)
generator, seeded identically. Dropout *inside* a region acts on different slices (each rank's
attention heads, its columns of the MLP), which must get independent masks — those draws
happen inside ``get_rng_tracker().fork()``, a stream seeded differently on every
tensor-parallel rank (``seed + 2718 + tp_rank``, Megatron's offset) and the same on ranks with
the same tensor-parallel rank (the data-parallel replicas).

Weights: Megatron by default draws each rank's shard on its GPU inside this fork, so TP = 1
and TP = k start from different numbers; mpu_lab builds the master weight under the default
generator (Megatron's ``--use-cpu-initialization``, see :mod:`~.layers`); lab 06 shows both.

Simplified: Megatron's ``CudaRNGStatesTracker`` keeps CUDA states only, and also a data- and an
expert-parallel stream; this one keeps the CPU state (and the GPU's when this rank has one), so
the same code runs on a laptop, and has the tensor-parallel stream only.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional, Tuple

import torch

from mpu_lab.core import parallel_state, utils
from mpu_lab.core.tensor_parallel.utils import (gather_split_1d_tensor,
                                               split_tensor_into_1d_equal_chunks)

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
# Megatron's offset between the data-parallel seed and the tensor-parallel seeds.
_TENSOR_PARALLEL_SEED_OFFSET = 2718

# One RNG state: (CPU generator state, CUDA generator state of this rank's GPU or None).
RNGState = Tuple[torch.Tensor, Optional[torch.Tensor]]


def _cuda_device() -> Optional[torch.device]:
    """This rank's GPU when it computes on one, else None."""
    device = utils.get_device()
    return device if device.type == "cuda" else None


def _current_state() -> RNGState:
    cuda = _cuda_device()
    return torch.get_rng_state(), (torch.cuda.get_rng_state(cuda) if cuda is not None else None)


def _set_state(state: RNGState) -> None:
    cpu_state, cuda_state = state
    torch.set_rng_state(cpu_state)
    cuda = _cuda_device()
    if cuda is not None and cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state, cuda)


def _fresh_state(seed: int) -> RNGState:
    """The state a generator has right after ``manual_seed(seed)``, without touching the
    global generators (seeding them and restoring would also reseed the other GPUs)."""
    cpu_state = torch.Generator(device="cpu").manual_seed(seed).get_state()
    cuda = _cuda_device()
    cuda_state = torch.Generator(device=cuda).manual_seed(seed).get_state() if cuda is not None else None
    return cpu_state, cuda_state


class RNGStatesTracker:
    """Named RNG streams. ``fork(name)`` swaps the default generator(s) to the stream, and on
    exit saves the advanced stream and restores the default generator(s)."""

    def __init__(self):
        self.states_: Dict[str, RNGState] = {}
        self.seeds_ = set()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, RNGState]:
        """A copy of the streams (e.g. to replay them during activation recomputation)."""
        return dict(self.states_)

    def set_states(self, states: Dict[str, RNGState]):
        self.states_ = dict(states)

    def add(self, name: str, seed: int):
        """Create stream ``name`` seeded with ``seed``; both must be new."""
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} is already used by another RNG stream")
        if name in self.states_:
            raise ValueError(f"RNG stream {name!r} already exists")
        self.seeds_.add(seed)
        self.states_[name] = _fresh_state(seed)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Draw random numbers from stream ``name`` inside the block."""
        if name not in self.states_:
            raise KeyError(
                f"RNG stream {name!r} is not added: call "
                f"mpu_lab.core.tensor_parallel.model_parallel_manual_seed(seed) first"
            )
        outside = _current_state()
        _set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _current_state()
            _set_state(outside)


_RNG_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (Megatron: ``get_cuda_rng_tracker``)."""
    return _RNG_TRACKER


get_cuda_rng_tracker = get_rng_tracker


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default generator(s) with ``seed`` — the same on every rank, for dropout
    outside tensor-parallel regions and for building the master weights — and (re)create the
    tensor-parallel stream ``"model-parallel-rng"`` with ``seed + 2718 + tp_rank``."""
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "model_parallel_manual_seed needs the tensor-parallel rank: call "
            "mpu_lab.core.parallel_state.initialize_model_parallel(...) first"
        )
    tp_seed = seed + _TENSOR_PARALLEL_SEED_OFFSET + parallel_state.get_tensor_model_parallel_rank()
    torch.manual_seed(seed)  # CPU and every CUDA device
    _RNG_TRACKER.reset()
    _RNG_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, tp_seed)


# Megatron's name (there it seeds CUDA only).
model_parallel_cuda_manual_seed = model_parallel_manual_seed


# --------------------------------------------------------------------------- activation checkpointing
class CheckpointFunction(torch.autograd.Function):
    """Activation recomputation (Chen et al. 2016; Korthikanti et al. 2022 §5): forward runs
    ``run_function`` without keeping its activations and remembers the RNG states, the
    tracker's streams too (``torch.utils.checkpoint`` would not); backward reruns it under
    them, so the dropout masks are the same. ``distribute_saved_activations``: the saved
    ``args[0]`` keeps only this tensor-parallel rank's 1/t until backward all-gathers it."""

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, *args):
        ctx.run_function = run_function
        ctx.distribute_saved_activations = distribute_saved_activations
        ctx.rng_state = _current_state()
        ctx.tracker_states = _RNG_TRACKER.get_states()
        with torch.no_grad():
            outputs = run_function(*args)
        if distribute_saved_activations:
            # this rank's chunk of the input; the caller's tensor shrinks until backward
            ctx.input_0_shape = args[0].shape
            _set_viewless_tensor_data(args[0], split_tensor_into_1d_equal_chunks(
                args[0].data, new_buffer=True))
        ctx.save_for_backward(*args)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        saved = ctx.saved_tensors
        if ctx.distribute_saved_activations:
            _set_viewless_tensor_data(saved[0], gather_split_1d_tensor(saved[0].data)
                                      .view(ctx.input_0_shape))
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in saved]
        now_state, now_tracker = _current_state(), _RNG_TRACKER.get_states()
        _set_state(ctx.rng_state)
        _RNG_TRACKER.set_states(ctx.tracker_states)
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*inputs)
        finally:
            _set_state(now_state)
            _RNG_TRACKER.set_states(now_tracker)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(x.grad if x.requires_grad else None for x in inputs)


def _set_viewless_tensor_data(tensor: torch.Tensor, data: torch.Tensor) -> None:
    """Megatron's ``safely_set_viewless_tensor_data`` (a view's storage is its base's)."""
    if tensor._base is not None:
        raise ValueError("distribute_saved_activations needs a checkpoint input that is not a "
                         "view: pass mpu_lab.core.utils.make_viewless_tensor(x)")
    tensor.data = data


def checkpoint(function, distribute_saved_activations: bool, *args):
    """``function(*args)`` without storing its activations; they are recomputed in backward
    with the same random numbers. ``args`` must be tensors (Megatron's signature);
    ``distribute_saved_activations`` keeps 1/t of ``args[0]`` until backward."""
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)
