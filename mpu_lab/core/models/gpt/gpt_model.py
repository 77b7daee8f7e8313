"""GPT: vocab-parallel embedding + position embedding, parallel transformer layers, and an
output layer tied to the embedding whose logits stay split along the vocabulary —
:class:`GPTModel` (Megatron-core's ``core/models/gpt/gpt_model.py``), its embedding
(``core/models/common/embeddings/language_model_embedding.py``), :func:`build_model_chunks`
(one pipeline rank's chunks, the model part of Megatron's ``get_model``). Its dense twin,
``PlainGPT``, is the lab's reference and lives in ``mpu_lab/training/plain_gpt.py``.

Megatron-LM §3, "Input and output embedding": the embedding table ``E`` (``V x D``) is split
along the vocabulary (rank ``i`` holds rows ``[i V/t, (i+1) V/t)``); the output layer reuses
``E`` (weight tying), so rank ``i`` computes the logits of its own ``V/t`` ids, and
:func:`~mpu_lab.core.tensor_parallel.vocab_parallel_cross_entropy` finishes the loss with
all-reduces of ``b x s`` scalars instead of all-gathering ``b x s x V`` logits.

Vocabulary padding (Megatron's ``_vocab_size_with_padding``): the vocabulary is padded with
dummy ids up to a multiple of ``make_vocab_size_divisible_by x t`` (128 x t by default) so
every rank gets an equal, GEMM-friendly slice. The padding depends on ``t``: a checkpoint loaded
at another TP size may have more or fewer dummy rows, which the loader trims or fills with zeros
(:mod:`mpu_lab.training.checkpointing`).
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Union

import torch
import torch.nn.functional as F

from mpu_lab.core import context_parallel, parallel_state
from mpu_lab.core.utils import get_device
from mpu_lab.core.transformer import TransformerBlock
from mpu_lab.core.transformer.transformer_layer import TransformerLayer
from mpu_lab.core.transformer.transformer_config import TransformerConfig
from mpu_lab.core.transformer.spec_utils import ModuleSpec, build_module
from mpu_lab.core.pipeline_parallel.partition import stage_layers
from mpu_lab.core.tensor_parallel import (
    VocabParallelEmbedding, copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region, gather_from_tensor_model_parallel_region,
    get_rng_tracker, scatter_to_sequence_parallel_region, vocab_parallel_cross_entropy)


def pad_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128,
                   tensor_model_parallel_size: int = 1) -> int:
    """The vocabulary size rounded up to a multiple of ``divisible_by x t`` (Megatron)."""
    if vocab_size < 1 or make_vocab_size_divisible_by < 1 or tensor_model_parallel_size < 1:
        raise ValueError(f"vocab_size {vocab_size}, make_vocab_size_divisible_by "
                         f"{make_vocab_size_divisible_by} and tensor_model_parallel_size "
                         f"{tensor_model_parallel_size} must all be >= 1")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


class LanguageModelEmbedding(torch.nn.Module):
    """Word (vocab-parallel) plus learned position embeddings, then dropout.

    ``forward(input_ids [b, s], position_ids [b, s] or [s])`` -> ``[s, b, D]`` (sequence-first), or
    this rank's ``[s/t, b, D]`` with sequence parallelism.
    """

    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int):
        super().__init__()
        self.config = config
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size, config.hidden_size, init_method=config.init_method(),
            params_dtype=config.params_dtype)
        # Built on the CPU from the default generator, like the master weights, so the numbers
        # do not depend on the device or on the tensor-parallel size.
        weight = torch.empty(max_sequence_length, config.hidden_size,
                             dtype=torch.float32)   # cpu: a master weight, moved just below
        config.init_method()(weight)
        self.position_embeddings = torch.nn.Embedding(
            max_sequence_length, config.hidden_size,
            _weight=weight.to(device=get_device(), dtype=config.params_dtype))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        words = self.word_embeddings(input_ids)                      # [b, s, D], all-reduced
        positions = self.position_embeddings(position_ids)           # [b, s, D] or [s, D]
        embeddings = (words + positions).transpose(0, 1).contiguous()  # [s, b, D]
        if self.config.sequence_parallel:
            # Keep this rank's block of tokens; each block needs its own dropout mask.
            embeddings = scatter_to_sequence_parallel_region(embeddings)  # [s/t, b, D]
            rng = get_rng_tracker().fork() if (self.training and self.config.hidden_dropout > 0) \
                else contextlib.nullcontext()
        else:
            rng = contextlib.nullcontext()
        if self.training and self.config.hidden_dropout > 0:
            with rng:
                embeddings = F.dropout(embeddings, p=self.config.hidden_dropout, training=True)
        return embeddings


class GPTModel(torch.nn.Module):
    """Megatron-core's ``GPTModel`` for one pipeline stage.

    ``forward(input_ids [b, s], position_ids=None, labels=None, decoder_input=None)``:

    * with ``labels`` ([b, s]): the per-token loss ``[b, s]`` (fp32), like Megatron;
    * without: the logits, ``[b, s, V/t]`` (``parallel_output=True``) or gathered ``[b, s, V]``.

    With context parallelism (``config.context_parallel_size`` = cp > 1) ``input_ids`` are this
    CP rank's ``[b, s/cp]`` tokens laid out by
    :func:`~mpu_lab.core.context_parallel.get_batch_on_this_cp_rank`, ``position_ids`` their
    positions in the whole sequence (the same function lays them out; by default they are
    computed from the layout), and the outputs are this rank's ``[b, s/cp, ...]``: the loss
    over the CP group is the trainer's to average (Megatron's ``loss_func``).

    ``pre_process`` / ``post_process`` say whether this stage holds the embedding / the final
    LayerNorm and output layer; a stage without ``pre_process`` takes ``decoder_input``
    (``[s, b, D]``, or what :meth:`set_input_tensor` was given) and one without
    ``post_process`` returns the hidden states. ``num_layers`` / ``layer_offset``: this
    stage's layers are the global layers ``[layer_offset, layer_offset + num_layers)`` (all of
    them by default). ``vocab_size`` is the padded size (see :func:`pad_vocab_size`).
    ``transformer_layer_spec``: the layer's spec (Megatron-core's second argument, a keyword
    here; default :func:`~mpu_lab.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec`'s
    modules).
    To build a pipeline rank's chunks with the weights of the one-stage model, use
    :func:`build_model_chunks`.
    """

    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int,
                 pre_process: bool = True, post_process: bool = True,
                 parallel_output: bool = True, share_embeddings_and_output_weights: bool = True,
                 num_layers: Optional[int] = None, layer_offset: int = 0,
                 transformer_layer_spec: Optional[Union[ModuleSpec, type]] = None):
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        config.check(tp)
        if vocab_size % tp:
            raise ValueError(f"vocab_size {vocab_size} is not divisible by the tensor-parallel "
                             f"size {tp}: pad it with pad_vocab_size({vocab_size}, 128, {tp}) "
                             f"= {pad_vocab_size(vocab_size, 128, tp)}")
        self.config = config
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process, self.post_process = pre_process, post_process
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        # Construction order = the order the default generator is consumed: identical for
        # every tensor-parallel size, so TP=k shards are slices of the TP=1 weights.
        if pre_process:
            self.embedding = LanguageModelEmbedding(config, vocab_size, max_sequence_length)
        self.decoder = TransformerBlock(config, post_process=post_process,
                                        num_layers=num_layers, layer_offset=layer_offset,
                                        spec=transformer_layer_spec)
        self.output_layer_weight = None
        if post_process and not (pre_process and share_embeddings_and_output_weights):
            # A last pipeline stage without the embedding keeps its own copy of the output
            # weight; sync_embedding_weights() makes it equal to the first stage's and
            # allreduce_embedding_grads() keeps it so. ``shared`` (Megatron's attribute) tells
            # gradient clipping and checkpointing that it is a copy, counted and saved once.
            own = VocabParallelEmbedding(vocab_size, config.hidden_size,
                                         init_method=config.init_method(),
                                         params_dtype=config.params_dtype)
            self.output_layer_weight = own.weight
            self.output_layer_weight.shared = share_embeddings_and_output_weights
        self.input_tensor: Optional[torch.Tensor] = None

    def set_input_tensor(self, input_tensor) -> None:
        """Megatron's pipeline hook: the schedule hands this stage the activation received
        from the previous stage (``[tensor]``, ``[s, b, D]``) before calling forward; a stage
        without ``pre_process`` uses it as its decoder input."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def output_weight(self) -> torch.Tensor:
        """``[V/t, D]``: the tied embedding table, or this stage's own output weight."""
        if self.output_layer_weight is not None:
            return self.output_layer_weight
        return self.embedding.word_embeddings.weight

    def _default_position_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[s]``: 0..s-1, or with context parallelism the positions in the whole sequence
        of this CP rank's ``s/cp`` tokens (chunks r and 2cp-1-r, Megatron's layout)."""
        cp = self.config.context_parallel_size
        if cp == 1:
            return torch.arange(input_ids.size(1), device=input_ids.device)
        return context_parallel.sequence_positions(input_ids.size(1) * cp, device=input_ids.device)

    def forward(self, input_ids: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None,
                decoder_input: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.pre_process:
            if position_ids is None:   # [s], broadcast over the batch
                position_ids = self._default_position_ids(input_ids)
            hidden = self.embedding(input_ids, position_ids)      # [s, b, D] (or [s/t, b, D])
        else:
            hidden = decoder_input if decoder_input is not None else self.input_tensor
            if hidden is None:
                raise ValueError("this GPTModel stage has no embedding (pre_process=False): give "
                                 "it decoder_input [s, b, D] or call set_input_tensor([tensor])")
        hidden = self.decoder(hidden)
        if not self.post_process:
            return hidden
        return self._logits_and_loss(hidden, labels)

    def _logits_and_loss(self, hidden: torch.Tensor, labels: Optional[torch.Tensor]):
        if self.config.sequence_parallel:
            total = gather_from_sequence_parallel_region(hidden)  # [s, b, D]
        else:
            total = copy_to_tensor_model_parallel_region(hidden)  # f
        logits = F.linear(total, self.output_weight())            # [s, b, V/t]
        if labels is None:
            if not self.parallel_output:
                logits = gather_from_tensor_model_parallel_region(logits)  # [s, b, V]
            return logits.transpose(0, 1).contiguous()            # [b, s, V/t]
        target = labels.transpose(0, 1)                           # [s, b]
        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            # One rank holds the whole vocabulary: vocab_parallel_cross_entropy reduces to
            # F.cross_entropy, which is fused and faster.
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                   target.reshape(-1), reduction="none").view_as(target)
        else:
            loss = vocab_parallel_cross_entropy(logits.float(), target)  # [s, b]
        return loss.transpose(0, 1).contiguous()                  # [b, s]


# --------------------------------------------------------------------------- pipeline stages
def build_model_chunks(config: TransformerConfig, vocab_size: int, max_sequence_length: int,
                       pipeline_model_parallel_size: Optional[int] = None,
                       pipeline_model_parallel_rank: Optional[int] = None,
                       virtual_pipeline_model_parallel_size: Optional[int] = None,
                       **gpt_kwargs) -> List["GPTModel"]:
    """This pipeline rank's model chunks (one, or ``v`` with virtual stages), holding exactly
    the weights that the one-stage model built from the same ``torch.manual_seed`` holds.

    Master weights are drawn on the CPU from the default generator, in construction order:
    word embedding, position embedding, layer 0, layer 1, ... (see
    :mod:`mpu_lab.core.tensor_parallel.layers`). A chunk holding global layers ``[a, b)`` must
    therefore start drawing where the one-stage model reaches layer ``a``: the draws of what
    comes before (the embedding, layers ``0..a-1``) are *replayed* — built and thrown away —
    so every stage draws the whole model's numbers up to its last layer. That costs CPU time
    once at start and makes PP=k start from exactly the PP=1 weights (Megatron instead seeds
    each stage differently, ``seed + 100 * pp_rank``, and gives up that equality).

    Chunk ``k`` is virtual stage ``k * p + r`` (:func:`~mpu_lab.core.pipeline_parallel.partition_table`);
    ``pre_process`` on virtual stage 0, ``post_process`` on the last. The sizes default to
    :mod:`mpu_lab.core.parallel_state`'s. The last stage's copy of the tied embedding is built from
    its own draws: call :func:`~mpu_lab.core.pipeline_parallel.sync_embedding_weights` afterwards.
    A ``transformer_layer_spec`` in ``gpt_kwargs`` builds the replayed layers too.
    """
    p = pipeline_model_parallel_size or parallel_state.get_pipeline_model_parallel_world_size()
    r = pipeline_model_parallel_rank if pipeline_model_parallel_rank is not None \
        else parallel_state.get_pipeline_model_parallel_rank()
    v = virtual_pipeline_model_parallel_size
    if v is None and pipeline_model_parallel_size is None:
        v = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    v = v or 1
    chunks: List[GPTModel] = []
    drawn = 0          # global layers whose draws the default generator has gone past
    embedding_drawn = False
    layer_spec = gpt_kwargs.get("transformer_layer_spec") or ModuleSpec(module=TransformerLayer)
    for k in range(v):
        layers = stage_layers(config.num_layers, p, r, v, k)
        stage = k * p + r
        if v > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(k)
        with torch.no_grad():
            if stage > 0 and not embedding_drawn:
                LanguageModelEmbedding(config, vocab_size, max_sequence_length)   # replay, discard
            for n in range(drawn, layers.start):
                build_module(layer_spec, config, n)                              # replay, discard
        chunks.append(GPTModel(config, vocab_size, max_sequence_length, pre_process=stage == 0,
                               post_process=stage == p * v - 1, num_layers=len(layers),
                               layer_offset=layers.start, **gpt_kwargs))
        embedding_drawn, drawn = True, layers.stop
    if v > 1:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return chunks
