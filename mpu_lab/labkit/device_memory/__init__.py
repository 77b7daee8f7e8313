"""Lab 03, memory on one device: what a small GPT keeps for training counted from its tensors,
gradient accumulation, Megatron's recompute modes timed and their fields (``lessons``), the
predictions and the checkpoint function to write (``exercises``), and where the bytes go per
recompute mode (``viz``).
"""
