"""Synthetic workloads: exact or ranged lengths, ids inside the vocabulary and off special tokens."""

from __future__ import annotations

from kvserve.bench.workload import Workload, build_workload


def test_fixed_lengths_are_exact():
    w = build_workload(5, input_len=12, output_len=7, vocab_size=100, seed=0)
    assert [len(p) for p in w.prompts] == [12] * 5 and w.output_lens == [7] * 5
    assert w.num_prompt_tokens == 60 and w.num_output_tokens == 35


def test_ranged_lengths_stay_in_range_and_vary():
    w = build_workload(200, input_len=100, output_len=10, vocab_size=100, seed=0, range_ratio=0.5)
    in_lens = [len(p) for p in w.prompts]
    assert 50 <= min(in_lens) and max(in_lens) <= 150 and len(set(in_lens)) > 10
    assert 5 <= min(w.output_lens) and max(w.output_lens) <= 15


def test_ids_avoid_excluded_tokens_and_stay_in_vocab():
    w = build_workload(20, input_len=50, output_len=1, vocab_size=10, seed=0, exclude_ids=[0, 1, 2])
    ids = {t for p in w.prompts for t in p}
    assert ids <= set(range(3, 10)) and len(ids) == 7


def test_seed_fixes_the_workload_and_round_trips():
    a = build_workload(3, 8, 4, vocab_size=1000, seed=5)
    assert a == build_workload(3, 8, 4, vocab_size=1000, seed=5)
    assert a != build_workload(3, 8, 4, vocab_size=1000, seed=6)
    assert Workload.from_dict(a.to_dict()) == a


def test_shared_prefixes_round_robin():
    w = build_workload(6, input_len=5, output_len=3, vocab_size=1000, seed=0, shared_prefix_len=16, num_prefixes=2)
    assert all(len(p) == 21 for p in w.prompts)
    assert w.prompts[0][:16] == w.prompts[2][:16] == w.prompts[4][:16]
    assert w.prompts[1][:16] == w.prompts[3][:16] != w.prompts[0][:16]
    assert w.prompts[0][16:] != w.prompts[2][16:]  # each request's own part differs
