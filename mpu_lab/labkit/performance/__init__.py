"""Lab 15, performance: the checks on a fuller pipeline (``exercises``) and where the time goes:
utilisation, kernel timelines, step breakdowns, bandwidth, the cost model's pictures (``viz``).
"""
