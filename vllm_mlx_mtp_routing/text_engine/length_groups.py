"""Which rows of a batch share one attention call.

One batched attention call reads every row's keys up to the longest row's span: a 16K-token row
that joins four 300-token chats makes each of the five read 16K positions, where the chats alone
read a few hundred; where attention's arithmetic dominates (the CPU), that step costs a multiple
of the chats' own. Rows of similar length
gain nothing from being split, and every extra call has a fixed price (a gather, an attention
launch, their share of the output's reassembly), so the split is a small optimisation problem:
minimise sum over groups of (rows x span) + ``overhead`` per group beyond the first, spans and
overhead in key positions. Sorted by span, an optimal grouping is a partition into runs (a row
never gains from joining a group whose span is shorter than its own), found exactly by a
dynamic programme over the B sorted rows.
"""

from __future__ import annotations


def plan_groups(spans: list[int], overhead: int) -> list[list[int]]:
    """Rows (indices into ``spans``) per attention call, each group's rows in ascending span;
    one group holding every row when splitting does not pay."""
    order = sorted(range(len(spans)), key=lambda i: spans[i])
    s = [spans[i] for i in order]
    best = [0] + [0] * len(s)  # best[j]: the cost of the first j sorted rows
    cut = [0] * (len(s) + 1)  # cut[j]: where the last group of the first j rows starts
    for j in range(1, len(s) + 1):
        best[j], cut[j] = min((best[i] + (j - i) * s[j - 1] + (overhead if i else 0), i) for i in range(j))
    groups: list[list[int]] = []
    j = len(s)
    while j:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]
