"""The dense twin of :class:`~mpu_lab.core.models.gpt.GPTModel`: the same GPT in plain
single-process PyTorch, with Megatron-core's parameter names, so a gathered TP=1 state dict
loads into it as it is. The lab's reference for every parallel run; Megatron has no
counterpart."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from mpu_lab.core.transformer.transformer_config import ACTIVATIONS, TransformerConfig


class _PlainAttention(torch.nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.linear_qkv = torch.nn.Linear(hidden_size, 3 * hidden_size)   # rows grouped by head
        self.linear_proj = torch.nn.Linear(hidden_size, hidden_size)

    def forward(self, x):                                            # [b, s, D]
        b, s, d = x.shape
        qkv = self.linear_qkv(x).view(b, s, self.num_heads, 3 * self.head_dim)  # [b, s, n, 3H]
        q, k, v = (t.transpose(1, 2) for t in qkv.split(self.head_dim, dim=-1))  # [b, n, s, H]
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, n, s, H]
        return self.linear_proj(z.transpose(1, 2).reshape(b, s, d))  # [b, s, D]


class _PlainMLP(torch.nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, activation):
        super().__init__()
        self.linear_fc1 = torch.nn.Linear(hidden_size, ffn_hidden_size)
        self.linear_fc2 = torch.nn.Linear(ffn_hidden_size, hidden_size)
        self.activation = ACTIVATIONS[activation]

    def forward(self, x):
        return self.linear_fc2(self.activation(self.linear_fc1(x)))


class _PlainLayer(torch.nn.Module):
    def __init__(self, hidden_size, num_heads, ffn_hidden_size, activation, eps):
        super().__init__()
        self.input_layernorm = torch.nn.LayerNorm(hidden_size, eps=eps)
        self.self_attention = _PlainAttention(hidden_size, num_heads)
        self.pre_mlp_layernorm = torch.nn.LayerNorm(hidden_size, eps=eps)
        self.mlp = _PlainMLP(hidden_size, ffn_hidden_size, activation)

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class PlainGPT(torch.nn.Module):
    """The same GPT in plain single-process PyTorch (no dropout), batch-first like nanoGPT:
    ``nn.Embedding``, ``nn.Linear`` and the same SDPA.

    ``forward(input_ids [b, s], labels=None)``: per-token loss ``[b, s]`` or logits
    ``[b, s, V]``. Build it with :meth:`from_config` and copy weights in with
    ``load_state_dict(gathered_tp1_state_dict)``.
    """

    def __init__(self, num_layers: int, hidden_size: int, num_attention_heads: int,
                 vocab_size: int, max_sequence_length: int, ffn_hidden_size: Optional[int] = None,
                 activation: str = "gelu", layernorm_epsilon: float = 1e-5):
        super().__init__()
        ffn_hidden_size = ffn_hidden_size or 4 * hidden_size
        self.embedding = torch.nn.Module()
        self.embedding.word_embeddings = torch.nn.Embedding(vocab_size, hidden_size)
        self.embedding.position_embeddings = torch.nn.Embedding(max_sequence_length, hidden_size)
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(
            [_PlainLayer(hidden_size, num_attention_heads, ffn_hidden_size, activation,
                         layernorm_epsilon) for _ in range(num_layers)])
        self.decoder.final_layernorm = torch.nn.LayerNorm(hidden_size, eps=layernorm_epsilon)

    @classmethod
    def from_config(cls, config: TransformerConfig, vocab_size: int, max_sequence_length: int):
        return cls(config.num_layers, config.hidden_size, config.num_attention_heads, vocab_size,
                   max_sequence_length, config.ffn_hidden_size, config.activation,
                   config.layernorm_epsilon)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None):
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device)
        x = self.embedding.word_embeddings(input_ids) + self.embedding.position_embeddings(positions)
        for layer in self.decoder.layers:
            x = layer(x)
        x = self.decoder.final_layernorm(x)                          # [b, s, D]
        logits = F.linear(x, self.embedding.word_embeddings.weight)  # tied: [b, s, V]
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().view(b * s, -1), labels.reshape(-1),
                               reduction="none").view(b, s)
