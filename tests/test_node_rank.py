"""Workers split open jobs by rank (`node.worker.rank`): for every job, the workers that
know each other agree on one order, so exactly one of them takes it at once."""
from collections import Counter

from chain.devnet import dev_accounts
from node.worker import rank


def test_every_job_has_exactly_one_first_worker_and_a_full_order():
    workers = [a.address for a in dev_accounts(5)]
    firsts = Counter()
    for job_id in range(2000):
        ranks = [rank(job_id, w, workers) for w in workers]
        assert sorted(ranks) == list(range(len(workers)))  # a permutation: no ties, no gaps
        firsts[ranks.index(0)] += 1
    # keccak spreads the first places over all workers (each expects 400 of 2000)
    assert set(firsts) == set(range(len(workers))) and min(firsts.values()) > 300


def test_rank_ignores_the_worker_itself_and_duplicates_among_peers():
    a, b = (x.address for x in dev_accounts(2))
    for job_id in range(50):
        assert rank(job_id, a, []) == rank(job_id, a, [a]) == 0
        assert rank(job_id, a, [b, b, a]) == rank(job_id, a, [b])
        assert rank(job_id, a, [b]) + rank(job_id, b, [a]) == 1
