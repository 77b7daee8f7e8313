# Lab 01, section 6: one answer to my_groups. Load it on purpose, in a new cell:
#     %load solutions/01_rank_groups.py
# run that cell, then grade it:
#     grader.grade(solution_groups, exercises.RANK_GROUPS, world)


def solution_groups(world_size, tp, pp, family):
    dp = world_size // (tp * pp)
    groups = {}                     # the coordinates a group shares -> its ranks
    for r in range(world_size):
        t, d, p = r % tp, (r // tp) % dp, r // (tp * dp)
        shared = {"tp": (d, p), "dp": (t, p), "pp": (t, d)}[family]
        groups.setdefault(shared, []).append(r)   # ascending: r runs upwards
    return list(groups.values())
