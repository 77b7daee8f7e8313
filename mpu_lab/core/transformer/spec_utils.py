"""Module specs: which class builds each part of a layer, after Megatron-core's
``core/transformer/spec_utils.py`` (``ModuleSpec``, ``import_module``, ``get_module``,
``build_module``).

A model in Megatron-core does not name the classes of its parts in its code: each part is built
from a *spec*, a small record of the class to build, the keyword arguments to add, and the specs
of its own parts (``submodules``). ``get_gpt_layer_local_spec()``
(:mod:`mpu_lab.core.models.gpt.gpt_layer_specs`) is the spec of the GPT layer with
Megatron-core's own modules; a spec with other linear layers in its ``linear_qkv`` /
``linear_proj`` / ``linear_fc1`` / ``linear_fc2`` fields builds the same model with those
layers instead (TransformerEngine's ``TELayerNormColumnParallelLinear`` is how Megatron uses it;
a learner's own ``ColumnParallelLinear`` is how the capstone lab uses it).

    spec = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=MyColumn, linear_fc2=MyRow))
    mlp = build_module(spec, config)     # MLP(config, submodules=MLPSubmodules(...))
"""
from __future__ import annotations

import dataclasses
import importlib
import types
from typing import Any, Tuple, Union


@dataclasses.dataclass
class ModuleSpec:
    """What to build: ``module`` (a class, a function, or ``(module_path, name)`` to import),
    ``params`` (keyword arguments added at build time) and ``submodules`` (the specs of its
    parts, passed to the class as ``submodules=``)."""

    module: Union[Tuple[str, str], type, types.FunctionType]
    params: dict = dataclasses.field(default_factory=dict)
    submodules: object = None
    metainfo: dict = dataclasses.field(default_factory=dict)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return build_module(self, *args, **kwargs)


def import_module(module_path: Tuple[str, str]):
    """``(module_path, name)`` -> the object ``name`` of that module (Megatron's importer)."""
    base_path, name = module_path
    return getattr(importlib.import_module(base_path), name)


def get_module(spec_or_module: Union[ModuleSpec, type], **additional_kwargs):
    """The class (or function) a spec names, imported if the spec gives its path."""
    if isinstance(spec_or_module, (type, types.FunctionType)):
        return spec_or_module
    if isinstance(spec_or_module.module, (type, types.FunctionType)):
        return spec_or_module.module
    return import_module(spec_or_module.module)


def build_module(spec_or_module: Union[ModuleSpec, type], *args, **kwargs):
    """Build what ``spec_or_module`` names with ``args`` and ``kwargs`` (Megatron's rules).

    A function (or a spec of one) is returned as it is, not called. A class, or a spec of one,
    is instantiated with ``args``, the spec's ``params``, ``kwargs`` and, when the spec has
    them, ``submodules=spec.submodules``. An error while building names the class built.
    """
    if isinstance(spec_or_module, types.FunctionType):
        return spec_or_module
    if isinstance(spec_or_module, ModuleSpec) and \
            isinstance(spec_or_module.module, types.FunctionType):
        return spec_or_module.module
    module = get_module(spec_or_module)
    if isinstance(module, types.FunctionType):
        return module
    params = getattr(spec_or_module, "params", None) or {}
    submodules = getattr(spec_or_module, "submodules", None)
    if submodules is not None:
        kwargs["submodules"] = submodules
    try:
        return module(*args, **params, **kwargs)
    except Exception as e:   # the message says which class failed to build, as Megatron's
        raise type(e)(f"{e} when instantiating {module.__name__}").with_traceback(
            e.__traceback__) from None
