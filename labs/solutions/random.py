"""The learner's activation recomputation with the RNG save and restore (Chen et al. 2016;
Korthikanti et al. 2022, §5; Megatron-core's ``tensor_parallel/random.py``,
``CheckpointFunction``): forward runs ``function`` without keeping its activations and
remembers the random states (the default generator's and the tensor-parallel tracker's);
backward puts them back, runs ``function`` again so dropout draws the same masks, backpropagates
through it, and restores the states it found."""
import torch

from mpu_lab.core.tensor_parallel import get_rng_tracker
from mpu_lab.core.utils import get_device


def _get_states():
    """The default generators' states: the CPU's, and this rank's GPU's when it has one."""
    device = get_device()
    gpu = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), gpu, get_rng_tracker().get_states()


def _set_states(states):
    cpu, gpu, tracker = states
    torch.set_rng_state(cpu)
    if gpu is not None:
        torch.cuda.set_rng_state(gpu, get_device())
    get_rng_tracker().set_states(tracker)


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, distribute_saved_activations, *args):
        ctx.function = function
        ctx.states = _get_states()
        with torch.no_grad():
            outputs = function(*args)
        ctx.save_for_backward(*args)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        now = _get_states()
        _set_states(ctx.states)                 # the random numbers forward drew
        with torch.enable_grad():
            outputs = ctx.function(*inputs)
        _set_states(now)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        torch.autograd.backward(outputs, grads)
        return (None, None) + tuple(x.grad for x in inputs)


def checkpoint(function, distribute_saved_activations, *args):
    """``function(*args)``, its activations recomputed in backward (Megatron's signature;
    ``distribute_saved_activations`` is accepted and not used here)."""
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)
