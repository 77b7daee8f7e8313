"""A tiny language model to pipeline: what the tests and the pipeline lab run in seconds.

    tokens [s, b] -> E[tokens] -> L x tanh(Linear(h, h)) -> logits = x · Eᵀ -> cross entropy

It has what matters for pipelining a GPT — a word embedding ``E`` on the first stage that the
last stage reuses as its output layer (tied), a stack of equal layers to cut into stages, a
loss on the last stage — and nothing else, so a 4-stage pipeline with 8 micro-batches runs on a
laptop CPU in a blink. :class:`ToyModel` is the single-process twin; :func:`build_toy_model_chunks`
cuts it into the chunks of one pipeline rank with exactly its weights.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, Optional, Sequence

import torch
import torch.nn.functional as F

from mpu_lab.core.pipeline_parallel.partition import stage_layers
from mpu_lab.core.pipeline_parallel.utils import unwrap_model


@dataclasses.dataclass
class ToyConfig:
    num_layers: int = 8
    hidden_size: int = 16
    vocab_size: int = 32
    params_dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False    # read by get_tensor_shape, like a TransformerConfig


class ToyModel(torch.nn.Module):
    """The whole model in one process. ``forward(tokens [s, b], labels [s, b])`` -> mean loss."""

    def __init__(self, config: ToyConfig, seed: int = 1234):
        super().__init__()
        self.config = config
        g = torch.Generator().manual_seed(seed)
        h, V = config.hidden_size, config.vocab_size
        self.word_embeddings = torch.nn.Parameter(torch.randn(V, h, generator=g))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(h, h) for _ in range(config.num_layers))
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.copy_(torch.randn(h, h, generator=g) / h ** 0.5)
                layer.bias.copy_(0.1 * torch.randn(h, generator=g))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings[tokens]                           # [s, b, h]
        for layer in self.layers:
            x = torch.tanh(layer(x))                               # [s, b, h]
        logits = x @ self.word_embeddings.t()                      # [s, b, V] (tied)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


class ToyModelChunk(torch.nn.Module):
    """The layers ``layer_numbers`` of :class:`ToyModel`, plus the embedding lookup when
    ``pre_process`` (first stage) and the tied output layer and per-token loss when
    ``post_process`` (last stage) — Megatron's flags. A stage that is not first takes its input
    through :meth:`set_input_tensor`."""

    def __init__(self, config: ToyConfig, layer_numbers: Sequence[int], pre_process: bool,
                 post_process: bool):
        super().__init__()
        self.config = config
        self.layer_numbers = list(layer_numbers)
        self.pre_process, self.post_process = pre_process, post_process
        h, V = config.hidden_size, config.vocab_size
        self.layers = torch.nn.ModuleList(torch.nn.Linear(h, h) for _ in self.layer_numbers)
        self.word_embeddings = None
        if pre_process or post_process:
            # The last stage's copy starts at zero; sync_embedding_weights fills it in.
            self.word_embeddings = torch.nn.Parameter(torch.zeros(V, h))
        self.input_tensor: Optional[torch.Tensor] = None

    def set_input_tensor(self, input_tensor) -> None:
        """Megatron's hook: the schedule hands over the activation received from the previous
        stage (a list of one tensor) before calling forward."""
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, (list, tuple)) else input_tensor

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter:
        return self.word_embeddings

    def forward(self, tokens: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.word_embeddings[tokens] if self.pre_process else self.input_tensor  # [s, b, h]
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if not self.post_process:
            return x                                               # [s, b, h] to the next stage
        logits = x @ self.word_embeddings.t()                      # [s, b, V]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                               reduction="none").view_as(labels)  # [s, b] per-token loss


def build_toy_model_chunks(dense: ToyModel, pipeline_parallel_rank: int,
                           pipeline_parallel_size: int,
                           virtual_pipeline_parallel_size: Optional[int] = None,
                           device=None) -> List[ToyModelChunk]:
    """This rank's chunks (one, or ``v`` with interleaving) with ``dense``'s weights; the last
    stage's embedding copy is left at zero (see ``sync_embedding_weights``)."""
    p, v = pipeline_parallel_size, virtual_pipeline_parallel_size or 1
    chunks = []
    for k in range(v):
        stage = k * p + pipeline_parallel_rank
        layers = stage_layers(dense.config.num_layers, p, pipeline_parallel_rank, v, k)
        chunk = ToyModelChunk(dense.config, layers, pre_process=stage == 0,
                              post_process=stage == p * v - 1)
        with torch.no_grad():
            for mine, n in zip(chunk.layers, layers):
                mine.load_state_dict(dense.layers[n].state_dict())
            if chunk.pre_process:
                chunk.word_embeddings.copy_(dense.word_embeddings)
        chunks.append(chunk.to(device) if device is not None else chunk)
    return chunks




def toy_batches(config: ToyConfig, num_microbatches: int, seq_length: int, micro_batch_size: int,
                seed: int = 0, device=None) -> List[Dict[str, torch.Tensor]]:
    """``num_microbatches`` micro-batches ``{"tokens", "labels"}`` of shape ``[s, b]``; the labels
    are the tokens shifted by one, like language modelling."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_microbatches):
        ids = torch.randint(0, config.vocab_size, (seq_length + 1, micro_batch_size), generator=g)
        out.append({"tokens": ids[:-1].to(device), "labels": ids[1:].to(device)})
    return out


def toy_forward_step(data_iterator: Iterator[Dict[str, torch.Tensor]], model):
    """Megatron-style ``forward_step_func``: one micro-batch through one chunk; returns
    ``(output_tensor, loss_func)``. Every chunk draws its micro-batch from its own iterator
    (the first stage needs the tokens, the last the labels)."""
    batch = next(data_iterator)
    chunk = unwrap_model(model)
    output = model(tokens=batch["tokens"] if chunk.pre_process else None,
                   labels=batch["labels"] if chunk.post_process else None)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()                        # mean over this micro-batch
        return loss, {"lm loss": loss.detach()}

    return output, loss_func
