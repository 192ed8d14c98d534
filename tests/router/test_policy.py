"""The router's policies and prefix index, without processes."""

from __future__ import annotations

from kvserve.router.policy import Policy
from kvserve.router.prefix_index import CHUNK_CHARS, PrefixIndex, chunk_hashes
from kvserve.router.replicas import Replica

A = "a system prompt about astronomy, long enough for several chunks. " * 4
B = "another system prompt, about translating into French, as long. " * 4


def _replicas(n=2):
    return [Replica(f"http://r{i}", i) for i in range(n)]


def test_chunk_hashes_chain_so_only_a_common_prefix_matches():
    index = PrefixIndex()
    index.insert(chunk_hashes(A + "question one"))
    assert index.match(chunk_hashes(A + "question two")) == len(A) // CHUNK_CHARS
    assert index.match(chunk_hashes("x" + A)) == 0  # the same text shifted: nothing in common at the start
    small = PrefixIndex(max_chunks=3)
    small.insert(chunk_hashes(A))
    assert len(small) == 3  # an LRU: the replica evicts too


def test_prefix_policy_keeps_a_prefix_on_its_replica_and_spreads_new_ones():
    reps, policy = _replicas(), Policy("prefix")
    first = [policy.choose(reps, A + f"q{i}").replica.index for i in range(4)]
    second = [policy.choose(reps, B + f"q{i}").replica.index for i in range(4)]
    assert len(set(first)) == 1 and len(set(second)) == 1 and first[0] != second[0]


def test_prefix_policy_spills_to_the_least_loaded_past_the_bound():
    reps, policy = _replicas(), Policy("prefix", balance_abs=2, balance_rel=1.5)
    home = policy.choose(reps, A + "q").replica
    home.in_flight = 2  # within the bound: the cache wins
    assert policy.choose(reps, A + "q2").replica is home
    home.in_flight = 5  # busy: 5 against 0 is past both bounds
    other = policy.choose(reps, A + "q3").replica
    assert other is not home
    assert other.prefixes.match(chunk_hashes(A)) > 0  # which now has it too


def test_a_down_replica_or_one_that_failed_this_request_is_skipped():
    reps = _replicas(3)
    policy = Policy("round-robin")
    reps[1].mark_down("test")
    assert {policy.choose(reps, "x").replica.index for _ in range(6)} == {0, 2}
    assert policy.choose(reps, "x", exclude={"http://r0", "http://r2"}) is None
    reps[1].mark_up()
    assert policy.choose(reps, "x", exclude={"http://r0", "http://r2"}).replica.index == 1


def test_least_loaded_counts_in_flight_and_published_waiting():
    reps, policy = _replicas(), Policy("least-loaded")
    reps[0].in_flight, reps[1].waiting = 1, 3
    assert policy.choose(reps, "x").replica.index == 0
