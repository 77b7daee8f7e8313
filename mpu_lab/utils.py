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
