"""PathPrefix: publish's in-place view of a live path reads as the tuple it replaced."""
import pytest

from forkserve.control.path_prefix import PathPrefix


def test_reads_as_the_tuple_prefix():
    path = list(range(40))
    view = PathPrefix(path, 35)
    copy = tuple(path[:35])
    assert len(view) == 35 and tuple(view) == copy
    for s in (slice(0, 16), slice(16, 32), slice(32, 48), slice(None), slice(3, None, 2),
              slice(-5, None), slice(0, -3)):
        assert tuple(view[s]) == copy[s]
    assert isinstance(view[:16], PathPrefix)  # a prefix of a prefix stays a view
    assert view[-1] == 34 and view[0] == 0
    with pytest.raises(IndexError):
        view[35]
    with pytest.raises(ValueError):
        PathPrefix(path, 41)
