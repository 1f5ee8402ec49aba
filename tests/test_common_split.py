"""common.split.balanced_ranges: the balanced contiguous split behind 2.3's segments and 2.5's stages.

Not graded (it is given code, not an exercise): these tests check the repository itself.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.split import balanced_ranges

CASES = [(8, 3), (8, 2), (8, 8), (10, 4), (7, 3), (1, 1), (5, 1), (9, 4), (100, 7), (13, 5)]


@pytest.mark.parametrize("num_items,num_parts", CASES)
def test_balanced_ranges_are_contiguous_balanced_and_complete(num_items, num_parts):
    parts = balanced_ranges(num_items, num_parts)
    case = f"balanced_ranges({num_items}, {num_parts}) = {[list(p) for p in parts]}"
    assert len(parts) == num_parts, f"{case}: expected one range per part"
    assert [i for part in parts for i in part] == list(range(num_items)), (
        f"{case}: concatenated, the parts must hold 0..{num_items - 1} once each and in order")
    sizes = [len(part) for part in parts]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1, f"{case}: sizes {sizes} must be >= 1 and differ by <= 1"
    assert sizes == sorted(sizes, reverse=True), f"{case}: the first num_items % num_parts parts get the extra item"


def test_balanced_ranges_example_from_the_docstring():
    assert balanced_ranges(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]


@pytest.mark.parametrize("num_items,num_parts", [(2, 3), (0, 1), (5, 0), (5, -1)])
def test_balanced_ranges_rejects_impossible_splits(num_items, num_parts):
    with pytest.raises(ValueError):
        balanced_ranges(num_items, num_parts)


_PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=200)


@_PROPERTY
@given(num_items=st.integers(1, 200), num_parts=st.integers(1, 200))
def test_balanced_ranges_any_split(num_items, num_parts):
    """Any (items, parts): ValueError when a part would be empty, else contiguous non-empty parts in order,
    sizes num_items // num_parts and one more for the first num_items % num_parts."""
    if num_parts > num_items:
        with pytest.raises(ValueError):
            balanced_ranges(num_items, num_parts)
        return
    parts = balanced_ranges(num_items, num_parts)
    size, extra = divmod(num_items, num_parts)
    assert [len(part) for part in parts] == [size + 1] * extra + [size] * (num_parts - extra)
    assert [i for part in parts for i in part] == list(range(num_items))
    assert all(part.step == 1 for part in parts)


@_PROPERTY
@given(num_items=st.integers(-5, 50), num_parts=st.integers(-5, 0))
def test_balanced_ranges_rejects_fewer_than_one_part(num_items, num_parts):
    with pytest.raises(ValueError):
        balanced_ranges(num_items, num_parts)
