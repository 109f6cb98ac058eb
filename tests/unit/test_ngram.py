"""Prompt lookup: which continuation the n-gram proposer finds, and its edge cases."""

import numpy as np
import pytest

from tandem.spec_decode.ngram import NgramProposer, find_continuation


def continuation(tokens: list[int], min_n: int = 1, max_n: int = 3, k: int = 3) -> list[int]:
    return find_continuation(np.asarray(tokens), min_n, max_n, k)


def test_continues_after_the_earlier_occurrence_of_the_suffix():
    assert continuation([1, 2, 3, 4, 5, 9, 2, 3]) == [4, 5, 9]


def test_no_earlier_occurrence_proposes_nothing():
    assert continuation([1, 2, 3, 4]) == []
    assert continuation([7]) == []
    assert continuation([]) == []


def test_the_longest_match_wins_over_a_later_shorter_one():
    # Suffix [1, 2, 3]: matched whole at position 0..2 (-> 40), only [3] at position 5 (-> 50).
    assert continuation([1, 2, 3, 40, 9, 3, 50, 8, 1, 2, 3], k=1) == [40]


def test_among_equally_long_matches_the_latest_wins():
    assert continuation([5, 6, 10, 5, 6, 20, 5, 6], min_n=2, max_n=2, k=1) == [20]


def test_min_n_rejects_shorter_matches():
    tokens = [1, 2, 3, 9, 8, 3]  # only the one-token suffix [3] occurred before
    assert continuation(tokens, min_n=1) == [9, 8, 3]
    assert continuation(tokens, min_n=2) == []


def test_match_length_stops_at_max_n():
    # With max_n = 2 both [x, 7, 8] occurrences match only [7, 8]: the latest wins.
    tokens = [1, 7, 8, 100, 2, 7, 8, 200, 1, 7, 8]
    assert continuation(tokens, max_n=2, k=1) == [200]
    assert continuation(tokens, max_n=3, k=1) == [100]


def test_continuation_is_cut_at_max_tokens_and_at_the_end():
    assert continuation([1, 2, 3, 4, 5, 6, 1, 2], k=2) == [3, 4]
    # The only match ends right before the suffix: what follows it is the suffix itself.
    assert continuation([4, 4], min_n=1, k=5) == [4]


def test_a_repeating_pattern_matches_overlapping_itself():
    assert continuation([1, 2, 1, 2, 1, 2], min_n=2, max_n=4, k=4) == [1, 2]


def test_match_near_the_start_does_not_read_before_it():
    assert continuation([3, 9, 3], min_n=1, max_n=5, k=2) == [9, 3]


def test_proposer_mirrors_growing_token_lists():
    proposer = NgramProposer(min_n=2, max_n=3)
    tokens = [10, 11, 12, 13, 10, 11]
    assert proposer.propose_one("a", tokens, 2) == [12, 13]
    tokens += [12, 99, 10]
    assert proposer.propose_one("a", tokens, 2) == []  # [99, 10] never occurred before
    tokens += [11]
    assert proposer.propose_one("a", tokens, 3) == [12, 99, 10]
    tokens += list(range(200, 400))  # grows past its buffer
    tokens += [200, 201]
    assert proposer.propose_one("a", tokens, 2) == [202, 203]
    assert proposer.propose_one("a", tokens, 0) == []
    proposer.forget("a")
    assert proposer.propose_one("a", [1, 2, 1, 2], 1) == [1]


def test_proposer_keeps_requests_apart():
    proposer = NgramProposer(min_n=1, max_n=2)
    assert proposer.propose_one("a", [1, 2, 1], 1) == [2]
    assert proposer.propose_one("b", [1, 3, 1], 1) == [3]
    assert proposer.propose_one("a", [1, 2, 1, 2], 1) == [1]


def test_proposer_validates_its_window():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="1 <= min_n"):
        NgramProposer(min_n=0, max_n=2)
