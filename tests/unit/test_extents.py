"""ExtentAllocator: first fit, coalescing, misuse, reserve, high water, and a reference model."""

from __future__ import annotations

import itertools
import random

import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.extents import ExtentAllocator


def runs(a: ExtentAllocator) -> list[tuple[int, int]]:
    """Free runs as (start, length), in order."""
    return [(s, a._lengths[s]) for s in a._starts]


def check_invariants(a: ExtentAllocator) -> None:
    r = runs(a)
    assert sorted(a._lengths) == a._starts
    assert sum(n for _, n in r) == a.free_units
    for (s1, n1), (s2, _) in itertools.pairwise(r):
        assert s1 + n1 < s2, f"runs {r} overlap or are not coalesced"
    assert all(n > 0 and s >= 0 and s + n <= a.total for s, n in r)


def test_empty_and_zero_total() -> None:
    a = ExtentAllocator(0)
    assert a.allocate(1) is None
    assert a.free_units == 0
    assert a.high_water == 0
    with pytest.raises(InvalidArgumentError):
        ExtentAllocator(-1)


def test_first_fit_allocation() -> None:
    a = ExtentAllocator(10)
    assert a.high_water == 0
    assert [a.allocate(3), a.allocate(3), a.allocate(3)] == [0, 3, 6]
    assert a.allocate(2) is None  # one unit left
    assert a.allocate(1) == 9
    assert a.free_units == 0
    assert a.allocate(1) is None


def test_first_fit_takes_the_lowest_run_that_fits() -> None:
    a = ExtentAllocator(20)
    for _ in range(10):
        a.allocate(2)
    a.free(2, 2)  # hole of 2 at 2
    a.free(10, 2)
    a.free(12, 2)  # hole of 4 at 10
    assert a.allocate(3) == 10  # the first hole is too small
    assert a.allocate(2) == 2  # now the first hole fits
    assert a.allocate(1) == 13
    check_invariants(a)


@pytest.mark.parametrize("n", [0, -1])
def test_non_positive_allocation_rejected(n: int) -> None:
    with pytest.raises(InvalidArgumentError, match="positive"):
        ExtentAllocator(4).allocate(n)


def _three_blocks() -> ExtentAllocator:
    a = ExtentAllocator(9)
    assert [a.allocate(3), a.allocate(3), a.allocate(3)] == [0, 3, 6]
    return a


def test_free_coalesces_with_previous() -> None:
    a = _three_blocks()
    a.free(0, 3)
    a.free(3, 3)
    assert runs(a) == [(0, 6)]
    assert a.allocate(6) == 0


def test_free_coalesces_with_next() -> None:
    a = _three_blocks()
    a.free(6, 3)
    a.free(3, 3)
    assert runs(a) == [(3, 6)]
    assert a.allocate(6) == 3


def test_free_coalesces_with_both() -> None:
    a = _three_blocks()
    a.free(0, 3)
    a.free(6, 3)
    assert runs(a) == [(0, 3), (6, 3)]
    a.free(3, 3)
    assert runs(a) == [(0, 9)]
    assert a.free_units == 9
    assert a.allocate(9) == 0


def test_free_without_neighbours_stays_separate() -> None:
    a = ExtentAllocator(9)
    for _ in range(9):
        a.allocate(1)
    a.free(2, 1)
    a.free(6, 1)
    assert runs(a) == [(2, 1), (6, 1)]


@pytest.mark.parametrize(("start", "n"), [(0, 3), (1, 1), (2, 2), (0, 9)])
def test_double_free_rejected(start: int, n: int) -> None:
    a = _three_blocks()
    a.free(0, 3)
    before = runs(a)
    with pytest.raises(InvalidArgumentError, match="double free"):
        a.free(start, n)
    assert runs(a) == before  # a rejected free changes nothing
    assert a.free_units == 3


@pytest.mark.parametrize(("start", "n"), [(-1, 2), (8, 2), (9, 1), (0, 0), (3, -1)])
def test_out_of_range_free_rejected(start: int, n: int) -> None:
    a = _three_blocks()
    with pytest.raises(InvalidArgumentError, match="cannot free"):
        a.free(start, n)
    assert a.free_units == 0


def test_reserve_splits_runs() -> None:
    a = ExtentAllocator(10)
    a.reserve(4, 2)
    assert runs(a) == [(0, 4), (6, 4)]
    assert a.free_units == 8
    a.reserve(0, 1)  # at the start of a run
    assert runs(a) == [(1, 3), (6, 4)]
    a.reserve(8, 2)  # at the end of a run
    assert runs(a) == [(1, 3), (6, 2)]
    a.reserve(1, 3)  # a whole run
    assert runs(a) == [(6, 2)]
    assert a.allocate(2) == 6
    check_invariants(a)


@pytest.mark.parametrize(("start", "n"), [(3, 2), (4, 1), (0, 11), (-1, 1), (9, 2), (2, 0)])
def test_reserve_of_used_or_invalid_run_rejected(start: int, n: int) -> None:
    a = ExtentAllocator(10)
    a.reserve(4, 2)
    before = runs(a)
    with pytest.raises(InvalidArgumentError):
        a.reserve(start, n)
    assert runs(a) == before
    assert a.free_units == 8


def test_high_water() -> None:
    a = ExtentAllocator(10)
    assert a.high_water == 0
    a.allocate(3)
    assert a.high_water == 3
    a.allocate(4)
    assert a.high_water == 7
    a.free(0, 3)  # a hole below does not lower it
    assert a.high_water == 7
    a.free(3, 4)
    assert a.high_water == 0
    a.reserve(8, 1)
    assert a.high_water == 9
    a.allocate(1)
    a.reserve(9, 1)
    assert a.high_water == 10
    b = ExtentAllocator(4)
    b.allocate(4)
    assert b.high_water == 4


def test_randomized_against_bitmap_reference() -> None:
    """Many random alloc/free/reserve ops; a bitmap with first-fit search is the oracle."""
    rng = random.Random(1234)
    total = 257
    a = ExtentAllocator(total)
    used = [False] * total
    live: list[tuple[int, int]] = []

    def ref_first_fit(n: int) -> int | None:
        run = 0
        for i, u in enumerate(used):
            run = 0 if u else run + 1
            if run == n:
                return i - n + 1
        return None

    for step in range(5000):
        op = rng.random()
        if op < 0.5 or not live:
            n = rng.choice([1, 1, 2, 3, 5, 8, 13, 40])
            want = ref_first_fit(n)
            got = a.allocate(n)
            assert got == want, f"step {step}: allocate({n}) gave {got}, reference {want}"
            if got is not None:
                used[got : got + n] = [True] * n
                live.append((got, n))
        elif op < 0.9:
            start, n = live.pop(rng.randrange(len(live)))
            a.free(start, n)
            used[start : start + n] = [False] * n
        elif op < 0.95:
            start, n = rng.choice(live)  # freeing something in use twice
            a.free(start, n)
            used[start : start + n] = [False] * n
            with pytest.raises(InvalidArgumentError):
                a.free(start, n)
            live.remove((start, n))
        else:
            start, n = rng.randrange(total), rng.randint(1, 6)
            if start + n <= total and not any(used[start : start + n]):
                a.reserve(start, n)
                used[start : start + n] = [True] * n
                live.append((start, n))
            else:
                with pytest.raises(InvalidArgumentError):
                    a.reserve(start, n)
        assert a.free_units == used.count(False)
        last_used = max((i for i, u in enumerate(used) if u), default=-1)
        assert a.high_water == last_used + 1
        if step % 50 == 0:
            check_invariants(a)
            free_runs = []
            i = 0
            while i < total:
                if not used[i]:
                    j = i
                    while j < total and not used[j]:
                        j += 1
                    free_runs.append((i, j - i))
                    i = j
                else:
                    i += 1
            assert runs(a) == free_runs


def test_first_free() -> None:
    a = ExtentAllocator(8)
    assert a.first_free() == 0
    assert a.allocate(8) == 0
    assert a.first_free() is None  # every unit used
    a.free(5, 2)
    a.free(2, 1)
    assert a.first_free() == 2
    assert ExtentAllocator(0).first_free() is None
