"""LoongServe §5.3: the batching dynamic program (Eq. 5), with the split-point bounds of Eq. 6.

Requests sorted by input length (descending) are cut into consecutive batches, the allocated instances (sorted
by location, then unused KV slots ascending) into consecutive groups, batch b running on group b:

    f[i][k] = min over j < i, l < k with D[j,i] <= V[l,k] of f[j][l] + T(R[j,i], E[l,k])

f[i][k]: the least summed input latency of the first i requests on exactly the first k instances; D and V
prefix sums of tokens needed and unused slots; T(R, E) = |R| x Eq. 7 at DoP |E| (every request of a batch waits
for its iteration). The answer is min over k of f[n][k]; backtracking the recorded split points gives the plan.

Naively O(n^2 m^2). Eq. 6 says the best splits are monotone: split_req[i][k-1] <= split_req[i][k] and
split_ins[i-1][k] <= split_ins[i][k], so the search for (i, k) starts at those (the one-sided Knuth-Yao bounds
that the row-by-row order allows). The memory constraint (D <= V) breaks the quadrangle inequality now and then:
on random long/short mixes the bounded search misses the optimum in about 7 % of cases, by up to 13 %
(tests/test_loongserve.py measures it). So `exact=None` (the default) searches everything while n^2 m^2 stays
under EXACT_BUDGET cell pairs and uses the bounds beyond, where the exhaustive search would take too long.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Coeffs = Mapping[int, tuple[float, float, float]]  # DoP -> Eq. 7's (alpha, beta, gamma)
EXACT_BUDGET = 40_000  # n^2 m^2 up to which the default search is exhaustive (~20 ms in Python)
TIPPING_GAIN = 0.01  # doubling a prefill batch that gains less than this in time per token: past the tipping point
TIPPING_PROMPT = 512  # the prompts of the profiled batches


@dataclass(frozen=True)
class BatchCut:
    """Requests [req_start, req_end) of the sorted list on instances [ins_start, ins_end) of the sorted list."""

    req_start: int
    req_end: int
    ins_start: int
    ins_end: int

    @property
    def dop(self) -> int:
        return self.ins_end - self.ins_start


def eq7(coeffs: Coeffs, dop: int, s1: float, s2: float) -> float:
    """Eq. 7 at `dop` for a batch with sum(len) = s1 and sum(len^2) = s2 (inf where no fit exists)."""
    c = coeffs.get(dop)
    if c is None:
        return math.inf
    return max(0.0, c[0] + c[1] * s1 + c[2] * s2)


def tipping_time(coeffs: Coeffs) -> float:
    """§5.1's tipping point as the paper profiles it: the iteration time past which a prefill batch gains next to
    nothing by growing. Batches of `TIPPING_PROMPT`-token prompts on one instance (Eq. 7 at its lowest DoP) double
    until doubling cuts the time per token by less than `TIPPING_GAIN`; the time of that batch."""
    dop = min(coeffs)
    tokens = float(TIPPING_PROMPT)
    t = eq7(coeffs, dop, tokens, tokens * TIPPING_PROMPT)
    for _ in range(40):
        t2 = eq7(coeffs, dop, 2 * tokens, 2 * tokens * TIPPING_PROMPT)
        if t / tokens - t2 / (2 * tokens) < TIPPING_GAIN * t / tokens:
            break
        tokens, t = 2 * tokens, t2
    return t


def plan_batches(
    lengths: Sequence[int], needs: Sequence[int], slots: Sequence[int], coeffs: Coeffs, exact: bool | None = None
) -> tuple[float, list[BatchCut]]:
    """Batches of requests (`lengths` descending, `needs` their KV slots) on instances (`slots` unused each):
    (least summed input latency, the cuts). (inf, []) when no plan fits. `exact`: search every split (None:
    while the problem is small, see EXACT_BUDGET)."""
    n, m = len(lengths), len(slots)
    if exact is None:
        exact = (n * m) ** 2 <= EXACT_BUDGET
    assert n == len(needs) and all(a >= b for a, b in itertools.pairwise(lengths)), "requests sorted descending"
    s1 = [0.0, *itertools.accumulate(float(x) for x in lengths)]
    s2 = [0.0, *itertools.accumulate(float(x) * x for x in lengths)]
    d = [0, *itertools.accumulate(needs)]
    v = [0, *itertools.accumulate(slots)]
    inf = math.inf
    f = [[inf] * (m + 1) for _ in range(n + 1)]
    split_req = [[0] * (m + 1) for _ in range(n + 1)]
    split_ins = [[0] * (m + 1) for _ in range(n + 1)]
    f[0][0] = 0.0
    for i in range(1, n + 1):
        for k in range(1, m + 1):
            j_lo = 0 if exact or k == 1 else split_req[i][k - 1]
            l_lo = 0 if exact or i == 1 else split_ins[i - 1][k]
            best, bj, bl = inf, 0, 0
            for j in range(j_lo, i):
                need = d[i] - d[j]
                for lo in range(l_lo, k):
                    prev = f[j][lo]
                    if prev == inf or v[k] - v[lo] < need:
                        continue
                    cost = prev + (i - j) * eq7(coeffs, k - lo, s1[i] - s1[j], s2[i] - s2[j])
                    if cost < best:
                        best, bj, bl = cost, j, lo
            f[i][k], split_req[i][k], split_ins[i][k] = best, bj, bl
    k_best = min(range(m + 1), key=lambda k: f[n][k])
    if f[n][k_best] == inf:
        return inf, []
    cuts: list[BatchCut] = []
    i, k = n, k_best
    while i > 0:
        j, lo = split_req[i][k], split_ins[i][k]
        cuts.append(BatchCut(j, i, lo, k))
        i, k = j, lo
    return f[n][k_best], cuts[::-1]
