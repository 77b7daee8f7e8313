"""Lab 01 side by side with Megatron-core: mpu_lab's rank groups next to Megatron-core's
``parallel_state.RankGenerator`` for every family both have, the dense ones
(:func:`rank_groups_side_by_side`) and the expert ones (:func:`expert_groups_side_by_side`,
:func:`groups_summary`). Pure Python, no processes: Megatron-core is imported in the
notebook's own process (:mod:`mpu_lab.megatron_reference.runtime`); where it is missing the
summary says how to install it.
"""
from __future__ import annotations

import textwrap
import warnings
from typing import Dict, Optional

from mpu_lab.core import parallel_state as ps
from mpu_lab.megatron_reference import runtime as mc
from mpu_lab.megatron_reference.runtime import import_megatron, megatron_order

# mpu_lab's generate_rank_groups key -> the token string Megatron-core's RankGenerator.get_ranks
# takes (its initialize_model_parallel asks for exactly these). The names are the same by
# design; the two embedding families are not RankGenerator tokens: Megatron-core derives them
# from each "pp" group with default_embedding_ranks (first and last stage) and
# default_position_embedding_ranks (first stage).
TOKENS = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "dp-cp": "dp-cp", "tp-pp": "tp-pp",
          "tp-dp": "tp-dp", "tp-cp": "tp-cp", "tp-dp-cp": "tp-dp-cp",
          "embedding": "pp: first+last", "position-embedding": "pp: first"}


def rank_groups_side_by_side(world_size: int, tp: int, pp: int, cp: int = 1,
                             order: str = ps.DEFAULT_ORDER) -> Dict[str, object]:
    """mpu_lab's rank groups next to Megatron-core's ``RankGenerator`` for the same world.

    Pure Python (no ``torch.distributed``). Returns ``{"order", "dp", "families": {key:
    {"token", "mpu_lab", "megatron_core", "equal"}}, "all_equal"}``; ``key`` is mpu_lab's
    name and ``token`` what Megatron-core's ``RankGenerator.get_ranks`` is asked (see
    :data:`TOKENS`).
    """
    mps = import_megatron()[0]
    ours = ps.generate_rank_groups(world_size, tp, pp, cp, order)
    dp = ps.check_sizes(world_size, tp, pp, cp)
    mc_order = megatron_order(order, {"tp": tp, "cp": cp, "dp": dp, "pp": pp})
    gen = mps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=mc_order)
    theirs = {key: gen.get_ranks(token) for key, token in TOKENS.items() if ":" not in token}
    theirs["embedding"] = [mps.default_embedding_ranks(g) for g in theirs["pp"]]
    theirs["position-embedding"] = [mps.default_position_embedding_ranks(g) for g in theirs["pp"]]
    families = {key: {"token": TOKENS[key], "mpu_lab": ours[key], "megatron_core": theirs[key],
                      "equal": ours[key] == theirs[key]} for key in TOKENS}
    return {"order": mc_order, "dp": dp, "families": families,
            "all_equal": all(f["equal"] for f in families.values())}


def format_rank_groups(table: Dict[str, object], width: int = 60) -> str:
    """One line per family: mpu_lab key, RankGenerator token, equal?, the groups (shortened)."""
    lines = [f"order {table['order']} (dp={table['dp']}): mpu_lab key | Megatron-core token | "
             f"same groups | groups"]
    for key, fam in table["families"].items():
        groups = str(fam["mpu_lab"])
        groups = groups if len(groups) <= width else groups[:width - 4] + " ..."
        lines.append(f"  {key:<19}| {fam['token']:<15}| {'yes' if fam['equal'] else 'NO':<4}| "
                     f"{groups}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- pure: the groups
# mpu_lab's expert key -> the token Megatron-core's expert RankGenerator is asked for it
EXPERT_TOKENS = {"ep": "ep", "expert-tp": "tp", "expert-tp-ep": "tp-ep",
                 "expert-tp-ep-pp": "tp-ep-pp", "expert-dp": "dp"}


def expert_groups_side_by_side(world_size: int, tp: int = 1, pp: int = 1, ep: int = 1,
                               etp: Optional[int] = None) -> Dict[str, object]:
    """mpu_lab's expert groups next to those of Megatron-core's expert ``RankGenerator`` (built
    as its ``initialize_model_parallel`` builds it: ``tp=etp, ep, dp=world/(etp*ep*pp), pp,
    cp=1``, order ``tp-cp-ep-dp-pp``). Pure Python, one process. Returns ``{"edp",
    "families": {key: {"token", "equal"}}, "all_equal"}``."""
    reason = mc.missing()
    if reason is not None:
        raise ImportError(reason)
    with mc.without_cuda_runtime_notice(), warnings.catch_warnings():
        warnings.simplefilter("ignore")      # its import-time notices about absent extras
        # megatron-core is optional (and slow to import): imported only where it is used.
        from megatron.core import parallel_state as mps
    ours = ps.generate_rank_groups(world_size, tp, pp, 1, ps.DEFAULT_ORDER, ep, etp)
    etp = tp if etp is None else etp
    edp = world_size // (etp * ep * pp)
    gen = mps.RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=ps.DEFAULT_ORDER)
    families = {key: {"token": token, "equal": ours[key] == gen.get_ranks(token)}
                for key, token in EXPERT_TOKENS.items()}
    return {"edp": edp, "families": families,
            "all_equal": all(f["equal"] for f in families.values())}


def groups_summary(world_size: int, tp: int, pp: int, ep: int = 1) -> str:
    """One line: how many of mpu_lab's dense families (and, with ``ep`` > 1, expert families)
    equal Megatron-core's ``RankGenerator``'s for this layout; the install hint where
    megatron-core cannot be imported."""
    reason = mc.missing()
    if reason is not None:
        return reason
    dense = rank_groups_side_by_side(world_size, tp, pp)["families"]
    same = [k for k, f in dense.items() if f["equal"]]
    line = "\n  ".join(textwrap.wrap(     # lines of <= 100 characters
        f"n={world_size}, t={tp}, p={pp}: {len(same)} of {len(dense)} dense families equal "
        f"Megatron-core's ({', '.join(same)})", 98, break_on_hyphens=False))
    if ep > 1:
        experts = expert_groups_side_by_side(world_size, tp, pp, ep)["families"]
        same = [k for k, f in experts.items() if f["equal"]]
        line += f";\n  ep={ep}: {len(same)} of {len(experts)} expert families ({', '.join(same)})"
    return line
