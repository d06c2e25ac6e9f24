"""The arithmetic of ranged DCP reads: which byte spans hold a box, which chunks to read."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpersist.integrations.dcp_ranges import plan_file_reads, region_spans


@st.composite
def boxes(draw: st.DrawFn) -> tuple[list[int], int, list[int], list[int]]:
    shape = draw(st.lists(st.integers(1, 7), min_size=0, max_size=3))
    offsets = [draw(st.integers(0, n - 1)) for n in shape]
    lengths = [draw(st.integers(0, n - o)) for n, o in zip(shape, offsets, strict=True)]
    return shape, draw(st.sampled_from([1, 2, 4, 8])), offsets, lengths


def box_bytes(shape: list[int], itemsize: int, offsets: list[int], lengths: list[int]) -> set[int]:
    """Every byte of the box, from a numpy index of the whole tensor's bytes."""
    whole = np.arange(int(np.prod(shape)) * itemsize).reshape([*shape, itemsize])
    index = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
    return set(whole[index].ravel().tolist())


@settings(max_examples=300, deadline=None)
@given(boxes(), st.integers(1, 64))
def test_spans_cover_the_box_and_nothing_they_could_skip(
    box: tuple[list[int], int, list[int], list[int]], merge_gap_bytes: int
) -> None:
    shape, itemsize, offsets, lengths = box
    spans = region_spans(shape, itemsize, offsets, lengths, merge_gap_bytes)
    wanted = box_bytes(shape, itemsize, offsets, lengths)
    covered = {b for lo, hi in spans for b in range(lo, hi)}
    assert wanted <= covered
    for lo, hi in spans:  # each span starts and ends on bytes of the box
        assert lo < hi and lo in wanted and hi - 1 in wanted
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start - end >= merge_gap_bytes  # closer spans were merged
        assert not wanted & set(range(end, start))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 900)), max_size=4), max_size=5),
    st.sampled_from([64, 256, 1024]),
)
def test_reads_are_whole_needed_chunks_and_every_item_sits_in_one_window(
    raw: list[list[tuple[int, int]]], chunk_bytes: int
) -> None:
    file_bytes = 6000
    item_spans = []
    for spans in raw:  # sorted, disjoint spans inside the file
        cleaned: list[tuple[int, int]] = []
        for start, length in sorted(spans):
            if not cleaned or start > cleaned[-1][1]:
                cleaned.append((start, min(start + length, file_bytes)))
        item_spans.append(cleaned)
    reads = plan_file_reads(item_spans, chunk_bytes, file_bytes)
    needed = {b for spans in item_spans for lo, hi in spans for b in range(lo, hi)}
    read = [b for w in reads.windows for lo, hi in w.chunks for b in range(lo, hi)]
    assert len(read) == len(set(read)) and needed <= set(read)  # nothing read twice, all read
    for w in reads.windows:
        for lo, hi in w.chunks:
            assert w.lo_bytes <= lo < hi <= w.hi_bytes and lo % chunk_bytes == 0
            assert hi % chunk_bytes == 0 or hi == file_bytes
            # only chunks holding a needed byte are read
            for c in range(lo, hi, chunk_bytes):
                assert needed & set(range(c, min(c + chunk_bytes, hi)))
    bounds = [(w.lo_bytes, w.hi_bytes) for w in reads.windows]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(bounds))  # windows disjoint, sorted
    for spans, w in zip(item_spans, reads.window_of_item, strict=True):
        if not spans:
            assert w == -1
            continue
        window = reads.windows[w]
        assert window.lo_bytes <= spans[0][0] and spans[-1][1] <= window.hi_bytes
