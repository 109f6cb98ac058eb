"""A decode step's inputs come from shorter paths than a mixed step's (_mixed_arrays): the
vectorized _decode_arrays, and _few_decode_arrays in plain Python for a few requests; on every
decode batch all three must give the same arrays, and the same errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.attention.block_tables import BlockTables
from tandem.attention.metadata import (
    FEW_DECODES,
    _decode_arrays,
    _few_decode_arrays,
    _mixed_arrays,
    build_batch,
)

from helpers import Slice

BLOCK_SIZE = 4
CPU = torch.device("cpu")


@st.composite
def decode_batches(draw) -> tuple[list[Slice], list[bool] | None]:
    requests = []
    for _ in range(draw(st.integers(1, 12))):
        num_computed = draw(st.integers(0, 30))
        token_ids = draw(st.lists(st.integers(0, 999), min_size=num_computed + 1, max_size=40))
        if draw(st.booleans()):  # async scheduling: the token is still being sampled
            token_ids[num_computed] = -1
        num_blocks = -(-(num_computed + 1) // BLOCK_SIZE) + draw(st.integers(0, 2))
        block_ids = draw(st.lists(st.integers(0, 500), min_size=num_blocks, max_size=num_blocks))
        requests.append(Slice(token_ids, num_computed, 1, block_ids))
    mask = draw(st.none() | st.lists(st.booleans(), min_size=len(requests), max_size=len(requests)))
    return requests, mask


@settings(max_examples=200, deadline=None)
@given(decode_batches())
def test_decode_paths_equal_the_general_one(batch) -> None:
    requests, mask = batch
    general = _mixed_arrays(requests, BLOCK_SIZE, mask, None, None, BlockTables())
    for path in (_decode_arrays, _few_decode_arrays):
        fast = path(requests, BLOCK_SIZE, mask, BlockTables())
        for field in dataclasses.fields(fast):
            expected, got = getattr(general, field.name), getattr(fast, field.name)
            if expected is None:
                assert got is None, (path.__name__, field.name)
            else:
                np.testing.assert_array_equal(
                    got, expected, err_msg=f"{path.__name__} {field.name}"
                )
                assert got.dtype == expected.dtype, (path.__name__, field.name)


@pytest.mark.parametrize("table_ids", [0, 8, 1024])
def test_a_few_decodes_tables_built_inline_or_gathered_are_the_same(monkeypatch, table_ids):
    """Up to FEW_TABLE_IDS ids the few-request path builds its block table in its one array;
    past them it gathers it from the runner's BlockTables: either way the general path's."""
    import tandem.attention.metadata as metadata

    monkeypatch.setattr(metadata, "FEW_TABLE_IDS", table_ids)
    requests = [
        Slice(list(range(40)), 35, 1, [9, 4, 7, 2, 6, 11, 12, 13, 14]),
        Slice(list(range(5)), 2, 1, [3]),
        Slice(list(range(20)), 16, 1, [1, 8, 5, 10, 15]),
    ]
    tables = BlockTables()
    for mask in (None, [True, False, True]):
        general = _mixed_arrays(requests, BLOCK_SIZE, mask, None, None, BlockTables())
        few = _few_decode_arrays(requests, BLOCK_SIZE, mask, tables)
        for field in dataclasses.fields(few):
            expected, got = getattr(general, field.name), getattr(few, field.name)
            if expected is not None:
                np.testing.assert_array_equal(got, expected, err_msg=field.name)
                assert got.dtype == expected.dtype, field.name


def test_a_step_of_no_requests_is_an_empty_batch() -> None:
    general = _mixed_arrays([], BLOCK_SIZE, None, None, None, BlockTables())
    for path in (_decode_arrays, _few_decode_arrays):
        empty = path([], BLOCK_SIZE, None, BlockTables())
        for field in dataclasses.fields(empty):
            expected, got = getattr(general, field.name), getattr(empty, field.name)
            if expected is not None:
                assert got.shape == expected.shape, (path.__name__, field.name)


def test_decode_paths_refuse_what_the_general_one_refuses() -> None:
    missing_token = [Slice([1, 2], 2, 1, [0])]
    short_table = [Slice(list(range(6)), 4, 1, [0])]  # position 4 needs a second block
    both = [*short_table, *missing_token]  # every path reports the missing token first
    for requests, message in [
        (missing_token, "fewer known token ids"),
        (short_table, "too short"),
        (both, "fewer known token ids"),
    ]:
        for path in (_decode_arrays, _few_decode_arrays):
            with pytest.raises(ValueError, match=message):
                path(requests, BLOCK_SIZE, None, BlockTables())
        with pytest.raises(ValueError, match=message):
            _mixed_arrays(requests, BLOCK_SIZE, None, None, None, BlockTables())


def test_a_sample_mask_of_the_wrong_length_is_refused_on_every_path() -> None:
    requests = [Slice([1, 2], 1, 1, [0]), Slice([3, 4], 1, 1, [1])]
    for path in (_decode_arrays, _few_decode_arrays):
        with pytest.raises(ValueError, match="one entry per request"):
            path(requests, BLOCK_SIZE, [True], BlockTables())
    with pytest.raises(ValueError, match="one entry per request"):
        _mixed_arrays(requests, BLOCK_SIZE, [True, False, True], None, None, BlockTables())


def test_build_batch_takes_a_decode_path_only_for_one_token_each(monkeypatch) -> None:
    import tandem.attention.metadata as metadata

    calls = []
    for path in (_decode_arrays, _few_decode_arrays):
        monkeypatch.setattr(
            metadata, path.__name__,
            lambda *args, path=path: calls.append(path.__name__) or path(*args),
        )  # fmt: skip
    decode = [Slice([1, 2, 3], 2, 1, [7]), Slice([4, 5], 1, 1, [8])]
    build_batch(decode, BLOCK_SIZE, CPU)
    many = [Slice([1, 2, 3], 2, 1, [index]) for index in range(FEW_DECODES + 1)]
    build_batch(many, BLOCK_SIZE, CPU)
    assert calls == ["_few_decode_arrays", "_decode_arrays"]
    build_batch([*decode, Slice([6, 7, 8], 0, 3, [9])], BLOCK_SIZE, CPU)  # a prefill
    build_batch(decode, BLOCK_SIZE, CPU, draft_token_ids=[[9], []])
    build_batch(decode, BLOCK_SIZE, CPU, prompt_logits_ranges=[(0, 0), (0, 0)])
    assert len(calls) == 2


@pytest.mark.parametrize("num_requests", [1, FEW_DECODES, FEW_DECODES + 1])
def test_placeholder_tokens_are_found_on_both_sides_of_the_few_request_path(num_requests) -> None:
    """Async scheduling's placeholders (-1: a token still being sampled) are found whichever
    way the ids are looked at (Python for a few, numpy for more)."""
    requests = [
        Slice([5, 6, -1 if index % 3 == 1 else 7], 2, 1, [index]) for index in range(num_requests)
    ]
    batch = build_batch(requests, BLOCK_SIZE, CPU)
    expected = [index for index in range(num_requests) if index % 3 == 1]
    if not expected:
        assert batch.placeholder_indices is None and batch.placeholder_requests_cpu is None
        return
    assert batch.placeholder_indices.tolist() == expected
    assert batch.placeholder_requests_cpu.tolist() == expected
