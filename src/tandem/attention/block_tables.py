"""Block tables kept from step to step, so that building a step's table costs what changed.

Rebuilding every request's table each step copies every block id of every running request:
at 256 requests of 2k tokens, 32k ids a step, more than the rest of the step's bookkeeping. A
runner keeps one `BlockTables`: each request's ids live in a row of one array, a step copies
only the ids a request gained since its previous step, and the step's table is one gather of
its rows.

A request is known by its block-id list object. The KV-cache manager's lists only grow while
they are the same object (a request that gives blocks back gets a new list), so a list's
length says which of its ids the row lacks. A row holds a reference to its list, so the
list's id cannot pass to another object while the row is in use. A step of many lists equal
to those of the last step that looked its lists up, in the same order (most decode steps of a
large batch), reuses that step's rows without looking each list up: sound because a list
never changes but by growing, even after a request has been given a new one, so a row that
mirrored a list equal to this one mirrors the start of this one.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

import numpy as np

_EMPTY_ROW = 0  # all zeros, never assigned: the row of a request that holds no blocks
# Steps of at most this many lists are gathered in plain Python (_gather_known): numpy's cost
# per call, a microsecond or more (several after a forward has run through the caches), is
# most of what gathering a few rows costs, and Python's per list is a tenth of it.
FEW_LISTS = 32


class BlockTables:
    def __init__(self, num_rows: int = 64, width: int = 16) -> None:
        self._table = np.zeros((num_rows, width), dtype=np.int64)
        self._num_blocks = np.zeros(num_rows, dtype=np.int64)  # ids each row holds
        self._lists: list[Sequence[int] | None] = [None] * num_rows  # row -> its list
        self._row_of: dict[int, int] = {}  # id(list) -> row
        self._free_rows = list(range(num_rows - 1, _EMPTY_ROW, -1))
        # The lists and rows of the last step that looked its lists up (None: not reusable).
        self._last_lists: list[Sequence[int]] | None = None
        self._last_rows = np.zeros(0, dtype=np.int64)

    def gather(self, block_lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """The step's table, `[len(block_lists), most ids in a list]` (at least one column)
        padded with 0, and how many ids each list has."""
        num_lists = len(block_lists)
        if num_lists <= FEW_LISTS:
            rows = [self._row_of.get(id(block_ids), -1) for block_ids in block_lists]
            if -1 not in rows:
                return self._gather_known(block_lists, rows)
        held = np.fromiter(map(len, block_lists), np.int64, num_lists)
        if block_lists == self._last_lists:
            # The lists of the last step that looked its lists up, in its order (the same
            # decodes again): its rows (see the module's docstring).
            rows = self._last_rows
        else:
            rows = np.fromiter(
                map(self._row_of.get, map(id, block_lists), repeat(-1)), np.int64, num_lists
            )
            if num_lists and rows.min() < 0:
                self._add_rows(block_lists, rows)
            # Not a step with a list that holds no blocks: its row is the shared empty one,
            # and the list must get a row of its own once it grows.
            self._last_lists = list(block_lists) if (rows != _EMPTY_ROW).all() else None
            self._last_rows = rows
        most = int(held.max(initial=0))
        if most > self._table.shape[1]:
            self._widen(most)
        stored = self._num_blocks[rows]
        for index in np.flatnonzero(held != stored).tolist():
            self._copy_new_ids(int(rows[index]), block_lists[index], int(stored[index]))
        return self._table[rows, : max(most, 1)], held

    def _gather_known(
        self, block_lists: Sequence[Sequence[int]], rows: list[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """gather() of a few lists that all have rows, in plain Python but for the one
        gather of the rows."""
        held = [len(block_ids) for block_ids in block_lists]
        most = max(held, default=0)
        if most > self._table.shape[1]:
            self._widen(most)
        stored = self._num_blocks
        for row, block_ids, num_held in zip(rows, block_lists, held, strict=True):
            if num_held != stored[row]:
                self._copy_new_ids(row, block_ids, int(stored[row]))
        return self._table[rows, : max(most, 1)], np.array(held, dtype=np.int64)

    def _add_rows(self, block_lists: Sequence[Sequence[int]], rows: np.ndarray) -> None:
        """Give the lists without a row (`rows` -1) one, in place."""
        for index in np.flatnonzero(rows < 0).tolist():
            block_ids = block_lists[index]
            row = self._row_of.get(id(block_ids))  # a list given twice has one row
            if row is None:
                row = self._new_row(block_ids, rows) if block_ids else _EMPTY_ROW
            rows[index] = row

    def _copy_new_ids(self, row: int, block_ids: Sequence[int], num_stored: int) -> None:
        num_held = len(block_ids)
        if num_held < num_stored:
            raise ValueError(
                "a block-id list shrank in place; give a request that frees blocks a new list"
            )
        self._table[row, num_stored:num_held] = block_ids[num_stored:]
        self._num_blocks[row] = num_held

    def _new_row(self, block_ids: Sequence[int], rows: np.ndarray) -> int:
        """A zeroed row for `block_ids`; `rows`: the step's, which keep theirs."""
        if not self._free_rows:
            self._free_unused_rows(rows)
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        self._table[row] = 0
        self._num_blocks[row] = 0
        self._lists[row] = block_ids
        self._row_of[id(block_ids)] = row
        return row

    def _free_unused_rows(self, rows: np.ndarray) -> None:
        """Give back the rows no list of this step uses (requests finished, preempted, or
        waiting): one pass, run only when no row is free."""
        unused = np.ones(len(self._lists), dtype=bool)
        unused[rows[rows >= 0]] = False
        unused[_EMPTY_ROW] = False
        for row in np.flatnonzero(unused).tolist():
            block_ids = self._lists[row]
            assert block_ids is not None, "with no row free, every row mirrors a list"
            del self._row_of[id(block_ids)]
            self._lists[row] = None
            self._free_rows.append(row)

    def _grow_rows(self) -> None:
        num_rows = len(self._lists)
        self._table = np.concatenate([self._table, np.zeros_like(self._table)])
        self._num_blocks = np.concatenate([self._num_blocks, np.zeros_like(self._num_blocks)])
        self._lists.extend([None] * num_rows)
        self._free_rows.extend(range(2 * num_rows - 1, num_rows - 1, -1))

    def _widen(self, width: int) -> None:
        grown = np.zeros((len(self._lists), max(width, 2 * self._table.shape[1])), np.int64)
        grown[:, : self._table.shape[1]] = self._table
        self._table = grown
