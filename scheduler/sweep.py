"""All swaps of one position at once: the ``dtfm`` cost of swapping slot ``p`` with every other position.

The memetic search's local step moves one device at a time to its best partner. Evaluating the N - 1 swaps of
a slot one by one costs N - 1 rounds of Python overhead; here they are a few dozen numpy operations on
(D x K) and (S x K) arrays for K candidates (all N - 1, or a random sample on large scenarios), about ten
times cheaper per swap, with exactly the values of
:meth:`search.DtfmObjective.trial` (tested):

* the group of ``p`` (stage s, pipeline r) swaps its device a for the candidate's device b: every member's row
  sum changes by ``dp[i, b] - dp[i, a]`` and the newcomer's row is its sum to the rest;
* a candidate in another group s' (pipeline r') receives a the same way, one row of D per candidate;
* every hop's new max is the max of its unchanged entries (top three kept, since at most two rows of a hop
  change) and its changed entries; the soft cost follows from the 4th-power sums.
"""

from __future__ import annotations

import numpy as np

from .search import SOFT_POWER, DtfmObjective


def _max_excluding(vals: np.ndarray, idx: np.ndarray, ex1: np.ndarray, ex2: np.ndarray) -> np.ndarray:
    """Row-wise: the largest of ``vals[h]`` (a row's top entries, at indices ``idx[h]``) not at ex1 or ex2.

    ``vals`` and ``idx`` are (H, k); ``ex1`` / ``ex2`` broadcast to (H, n); the result is (H, n).
    """
    out = np.full(np.broadcast_shapes(ex1.shape, ex2.shape), -np.inf)
    for k in range(vals.shape[1] - 1, -1, -1):  # the first allowed entry in descending order wins
        ok = (idx[:, k, None] != ex1) & (idx[:, k, None] != ex2)
        out = np.where(ok, vals[:, k, None], out)
    return out


def trial_all(obj: DtfmObjective, p: int) -> tuple[np.ndarray, np.ndarray]:
    """(total, soft) of swapping slot ``p`` with each position 0..N-1 (``p`` itself: +inf)."""
    n = len(obj.x)
    cand = np.delete(np.arange(n), p)
    t, sft = trial_some(obj, p, cand)
    total, soft = np.full(n, np.inf), np.full(n, np.inf)
    total[cand], soft[cand] = t, sft
    return total, soft


def trial_some(obj: DtfmObjective, p: int, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(total, soft) of swapping slot ``p`` with each position of ``cand`` (which must not hold ``p``)."""
    x, n_st, n_rep, ns = obj.x, obj.n_st, obj.n_rep, obj.n_slots
    k = len(cand)
    dp, pp = obj.pairs.dp, obj.pairs.pp
    s, r = p % n_st, p // n_st
    a = int(x[p])
    m = x[:ns].reshape(n_rep, n_st)
    qpos = np.asarray(cand, dtype=int)
    b = x[qpos]
    is_slot = qpos < ns
    qs = np.where(is_slot, qpos % n_st, -1)
    qr = np.where(is_slot, qpos // n_st, 0)
    qs0 = np.where(is_slot, qs, 0)
    same = qs == s
    other = is_slot & ~same
    p4 = 1.0 / SOFT_POWER

    # ---------------------------------------------------------------- DP term
    if n_rep > 1:
        g = m[:, s]
        new_s = (obj.dps[s] - dp[g, a])[:, None] + dp[np.ix_(g, b)]  # (D, K): p's group with b for a
        new_s[r, :] = dp[np.ix_(b, g)].sum(axis=1) - dp[b, a]
        max_s = new_s.max(axis=0)
        four_s = (new_s ** SOFT_POWER).sum(axis=0)
        # a candidate's own group t receives a for b: (K, D)
        gq = m.T[qs0]  # members of each candidate's group
        new_o = obj.dps[qs0] - dp[gq, b[:, None]] + dp[gq, a]
        new_o[np.arange(k), qr] = dp[a, gq].sum(axis=1) - dp[a, b]
        max_o = np.where(other, new_o.max(axis=1), -np.inf)
        four_o = np.where(other, (new_o ** SOFT_POWER).sum(axis=1) - obj.d4[qs0], 0.0)
        top = np.argsort(-obj.dmax)[:3]
        rest = _max_excluding(obj.dmax[top][None, :], top[None, :], np.array([[s]]),
                              np.where(other, qs, -1)[None, :])[0]
        dp_new = np.maximum(np.maximum(max_s, max_o), rest)
        d4_new = obj.d4.sum() - obj.d4[s] + four_s + four_o
        dp_new = np.where(same, obj.dmax.max(), dp_new)
        d4_new = np.where(same, obj.d4.sum(), d4_new)
        soft_dp = (np.maximum(d4_new, 0.0) / ns) ** p4
    else:
        dp_new, soft_dp = np.zeros(k), np.zeros(k)

    # ---------------------------------------------------------------- PP term
    pp_new, soft_pp = np.zeros(k), np.zeros(k)
    if n_st > 1:
        hops = np.arange(n_st - 1)[:, None]
        new_vals = np.full((n_st - 1, k), -np.inf)
        four = np.repeat(obj.h4[:, None], k, axis=1)
        # p side: row r, hops s-1 (left neighbour -> b) and s (b -> right neighbour); a neighbour that is q
        # itself becomes a.
        if s > 0:
            lft = np.where(qpos == r * n_st + s - 1, a, m[r, s - 1])
            v = pp[lft, b]
            new_vals[s - 1] = v
            four[s - 1] += v ** SOFT_POWER - obj.hop[s - 1, r] ** SOFT_POWER
        if s < n_st - 1:
            rgt = np.where(qpos == r * n_st + s + 1, a, m[r, s + 1])
            v = pp[b, rgt]
            new_vals[s] = v
            four[s] += v ** SOFT_POWER - obj.hop[s, r] ** SOFT_POWER
        ex1 = np.where((hops == s - 1) | (hops == s), r, -1)
        # q side (slots): row r', hops s'-1 and s', with a; an entry shared with p's (q next to p) is p's
        q_left_ok = is_slot & (qs0 > 0) & ~((qr == r) & (qs0 - 1 == s))
        q_right_ok = is_slot & (qs0 < n_st - 1) & ~((qr == r) & (qs0 + 1 == s))
        vq_left = pp[m[qr, np.clip(qs0 - 1, 0, n_st - 1)], a]
        vq_right = pp[a, m[qr, np.clip(qs0 + 1, 0, n_st - 1)]]
        qa = q_right_ok[None, :] & (qs0[None, :] == hops)
        qb = q_left_ok[None, :] & (qs0[None, :] - 1 == hops)
        hit = qa | qb
        ex2 = np.where(hit, qr[None, :], -1)
        vq = np.where(qa, vq_right[None, :], np.where(qb, vq_left[None, :], -np.inf))
        four += np.where(hit, vq ** SOFT_POWER - obj.hop[:, qr] ** SOFT_POWER, 0.0)
        order = np.argsort(-obj.hop, axis=1)[:, :3]
        vals = np.take_along_axis(obj.hop, order, axis=1)
        hmax = np.maximum(_max_excluding(vals, order, ex1, ex2), np.maximum(new_vals, vq))
        pp_new = hmax.sum(axis=0)
        soft_pp = ((np.maximum(four, 0.0) / n_rep) ** p4).sum(axis=0)

    # ------------------------------------------------------------- penalties
    pen = np.full(k, obj.pen)
    if obj.slot_cost is not None:
        sc = obj.slot_cost
        pen += sc[b, s] - sc[a, s]
        pen += np.where(is_slot, sc[a, qs0] - sc[b, qs0], 0.0)

    return dp_new + 2.0 * pp_new + pen, soft_dp + 2.0 * soft_pp
