"""The API's pool keeps its overflow connections: the same cap, no session opened per burst."""

from api.app import _kept_overflow


def test_the_overflow_is_kept_within_the_same_cap():
    assert _kept_overflow(10, 10) == {"pool_size": 20, "max_overflow": 0}
    assert _kept_overflow(3, 0) == {"pool_size": 3, "max_overflow": 0}
    assert _kept_overflow(10, -1) == {}  # an unlimited overflow cannot all be kept: as configured
