"""Lab 10, context parallelism: CP measured on a live world and the worked examples (``lessons``),
the log-sum-exp merge and the zig-zag layout to write (``exercises``), the ring step by step and
the causal work per rank (``viz``).
"""
