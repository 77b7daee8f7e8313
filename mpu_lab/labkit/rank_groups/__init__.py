"""Lab 01, rank groups: the learner's own rank-group generator and its checks (``exercises``), the
GPUs in their boxes coloured by group (``viz``), and the groups next to Megatron-core's
``RankGenerator`` (``megatron_core``).
"""
