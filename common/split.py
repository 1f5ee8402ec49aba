"""Cut n consecutive items (layers, blocks) into balanced contiguous parts.

Used by activation checkpointing (2.3: segments of blocks) and the model split
(2.5: pipeline stages); not an exercise, since it is arithmetic, not distribution.
"""

from __future__ import annotations


def balanced_ranges(num_items: int, num_parts: int, what: str = "items") -> list[range]:
    """`num_parts` contiguous, non-empty ranges covering 0..num_items-1, sizes differing by at most one.

    The first num_items % num_parts parts get the extra item:
    balanced_ranges(8, 3) == [range(0, 3), range(3, 6), range(6, 8)].
    Raises ValueError if num_parts < 1 or num_parts > num_items (a part would be empty).
    """
    if num_parts < 1:
        raise ValueError(f"the number of parts must be >= 1, got {num_parts}")
    if num_items < num_parts:
        raise ValueError(f"cannot cut {num_items} {what} into {num_parts} non-empty parts: use at most {num_items}")
    size, extra = divmod(num_items, num_parts)
    ranges, start = [], 0
    for part in range(num_parts):
        end = start + size + (1 if part < extra else 0)
        ranges.append(range(start, end))
        start = end
    return ranges
