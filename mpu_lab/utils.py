"""Small arithmetic helpers shared by every layer (Megatron-core keeps its own in
``core/utils.py``). Standard library only."""
from __future__ import annotations

from typing import List


def divisors(n: int) -> List[int]:
    """Every positive divisor of ``n``, ascending: the sizes that split ``n`` evenly
    (``divisors(12) == [1, 2, 3, 4, 6, 12]``)."""
    if n < 1:
        raise ValueError(f"divisors needs a positive integer, got {n}")
    return [d for d in range(1, n + 1) if n % d == 0]


def nearest_multiples(n: int, step: int) -> str:
    """The multiples of ``step`` on either side of ``n``, as an error message suggests them
    (``nearest_multiples(10, 4) == "8 or 12"``; ``"4"`` when the one below is 0)."""
    below, above = n // step * step, (n // step + 1) * step
    return f"{below} or {above}" if below else f"{above}"
