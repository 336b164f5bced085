import pytest

from .helpers import ListSink


@pytest.fixture
def sink() -> ListSink:
    return ListSink()
