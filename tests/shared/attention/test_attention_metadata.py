"""count_leading_decodes (both runners' num_decodes) against a plain-Python count."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from shared.attention.metadata import count_leading_decodes


def _python_count(query_lens: list[int]) -> int:
    n = 0
    for q in query_lens:
        if q != 1:
            break
        n += 1
    return n


def test_worked_examples():
    assert count_leading_decodes(np.array([1, 1, 3, 1])) == 2
    assert count_leading_decodes(np.array([1, 1])) == 2
    assert count_leading_decodes(np.array([4, 1])) == 0
    assert count_leading_decodes(np.array([], dtype=np.int32)) == 0


@given(st.lists(st.integers(min_value=0, max_value=4), max_size=40))
def test_matches_python_count(query_lens):
    arr = np.array(query_lens, dtype=np.int32)
    assert count_leading_decodes(arr) == _python_count(query_lens)
