"""Where a token's experts lie under megatron-core's node-limited routing, by exact counting.

megatron-core moe_utils.py `group_limited_topk` (`--moe-router-num-groups G
--moe-router-group-topk M`): the E experts form G groups of E/G consecutive experts; a token
picks M groups by score, then its top-k among their experts. Under balanced routing (the plan's
and `memory`'s assumption) the M groups are a uniform M-subset and the k experts a uniform
k-subset of theirs. A rank holds consecutive experts (E/ep, in ep-rank order) and a node its
ranks', so the chance that a token reaches a rank or a node is the chance it picks one of a block
of consecutive experts (`block_hit`); plan/flex.py prices the flex dispatcher's copies and
report/workload_layers.py its bytes from it.
"""

from __future__ import annotations

from math import comb


def block_hit(experts: int, topk: int, groups: int, group_topk: int, lo: int, hi: int) -> float:
    """Return the chance that a token's top-k picks one of experts lo..hi-1 under node-limited
    routing: groups of g = E/G consecutive experts, a uniform M-subset of groups, a uniform
    k-subset of its M g experts (G = M = 1: every expert open).

    The block overlaps F whole groups and at most two partial ones (counts c): the token misses
    it when its groups hold j of the whole ones and a subset Q of the partial ones
    (C(F, j) C(G - F - |P|, M - j - |Q|) / C(G, M)) and its k experts avoid the
    j g + sum(c in Q) of the block there: C(M g - j g - sum(Q), k) / C(M g, k).
    """
    size = experts // groups
    whole, partial = 0, []
    for group in range(lo // size, -(-hi // size)):
        overlap = min(hi, (group + 1) * size) - max(lo, group * size)
        if overlap == size:
            whole += 1
        elif overlap > 0:
            partial.append(overlap)
    rest, pool, choices = groups - whole - len(partial), group_topk * size, comb(groups, group_topk)
    miss = 0.0
    for mask in range(1 << len(partial)):
        taken = [c for i, c in enumerate(partial) if mask >> i & 1]
        for j in range(min(whole, group_topk - len(taken)) + 1):
            ways = comb(whole, j) * comb(rest, group_topk - j - len(taken))
            if ways:
                left = pool - j * size - sum(taken)
                miss += ways / choices * comb(left, topk) / comb(pool, topk)
    return 1 - miss
