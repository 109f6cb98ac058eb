"""A runner's block tables kept between steps (attention/block_tables.py) must give, every step,
exactly the table built from scratch from the requests' lists: through lists that grow, lists
replaced by new ones (freed blocks), requests that come and go, more requests than rows, and
tables wider than the array; steps of a few lists (gathered in plain Python) and of many."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tandem.attention import block_tables
from tandem.attention.block_tables import BlockTables


def from_scratch(block_lists: list[list[int]]) -> np.ndarray:
    width = max([len(ids) for ids in block_lists] + [1])
    table = np.zeros((len(block_lists), width), dtype=np.int64)
    for row, ids in enumerate(block_lists):
        table[row, : len(ids)] = ids
    return table


def check(tables: BlockTables, block_lists: list[list[int]]) -> None:
    table, held = tables.gather(block_lists)
    np.testing.assert_array_equal(table, from_scratch(block_lists))
    np.testing.assert_array_equal(held, [len(ids) for ids in block_lists])


@pytest.mark.parametrize("few_lists", [0, block_tables.FEW_LISTS, 1000])
@pytest.mark.parametrize("seed", range(6))
def test_every_step_equals_the_table_built_from_scratch(
    seed: int, few_lists: int, monkeypatch
) -> None:
    """`few_lists`: steps of up to this many lists take the plain-Python gather."""
    monkeypatch.setattr(block_tables, "FEW_LISTS", few_lists)
    rng = random.Random(seed)
    tables = BlockTables(num_rows=4, width=2)  # small: rows and columns must grow
    live: list[list[int]] = []
    next_block = 0
    for _ in range(300):
        action = rng.random()
        if action < 0.15 or not live:  # a request starts (sometimes holding nothing yet)
            count = rng.choice([0, 1, 3, 9])
            live.append(list(range(next_block, next_block + count)))
            next_block += count
        elif action < 0.25:  # one ends
            live.pop(rng.randrange(len(live)))
        elif action < 0.35:  # one gives blocks back: a new, shorter list
            index = rng.randrange(len(live))
            live[index] = live[index][: rng.randrange(len(live[index]) + 1)]
        for ids in live:  # most steps add a block to some requests
            if rng.random() < 0.3:
                ids.extend(range(next_block, next_block + rng.choice([1, 2, 40])))
                next_block += 40
        # A step schedules some of the live requests, in any order.
        scheduled = rng.sample(live, rng.randint(min(1, len(live)), len(live)))
        check(tables, scheduled)


@pytest.mark.parametrize("seed", range(4))
def test_steps_of_the_same_lists_in_the_same_order(seed: int) -> None:
    """The rows of the previous step are reused when it gives the same lists again (most
    decode steps): through lists that grow in place, lists replaced by equal or shorter
    copies, and lists that held nothing and then grow."""
    rng = random.Random(seed)
    tables = BlockTables(num_rows=4, width=2)
    num_lists = block_tables.FEW_LISTS + 8  # the many-list path
    live = [
        list(range(index * 100, index * 100 + rng.choice([0, 1, 3]))) for index in range(num_lists)
    ]
    next_block = 10_000
    for _ in range(200):
        for index, ids in enumerate(live):
            action = rng.random()
            if action < 0.2:  # grows in place
                ids.extend(range(next_block, next_block + rng.choice([1, 2, 9])))
                next_block += 9
            elif action < 0.25:  # replaced by an equal copy
                live[index] = list(ids)
            elif action < 0.3:  # gives blocks back: a new, shorter list
                live[index] = ids[: rng.randrange(len(ids) + 1)]
        for _ in range(rng.choice([1, 3])):  # the same lists, step after step
            check(tables, live)
        if rng.random() < 0.3:  # a step of a few of them, gathered in plain Python
            check(tables, rng.sample(live, block_tables.FEW_LISTS))
        if rng.random() < 0.2:  # a step of others, with no rows free: rows are reclaimed
            check(tables, [[next_block + index] for index in range(num_lists)])
            next_block += num_lists


def test_a_list_given_twice_in_one_step_and_an_empty_step() -> None:
    tables = BlockTables(num_rows=2)
    shared, other = [4, 5], [7]
    check(tables, [shared, other, shared])
    shared.append(6)
    check(tables, [shared, shared])
    table, held = tables.gather([])
    assert table.shape == (0, 1) and held.shape == (0,)


def test_rows_of_requests_no_longer_scheduled_are_reused_without_growing() -> None:
    tables = BlockTables(num_rows=8)
    for step in range(100):  # a stream of short requests, 7 at a time
        check(tables, [[step * 10 + i] * (i + 1) for i in range(7)])
    assert len(tables._lists) == 8


def test_a_list_shortened_in_place_is_refused() -> None:
    tables = BlockTables()
    ids = [1, 2, 3]
    check(tables, [ids])
    del ids[1:]
    with pytest.raises(ValueError, match="shrank in place"):
        tables.gather([ids])
