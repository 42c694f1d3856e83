from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.workers.switchboard import Switchboard


@pytest.fixture
def board() -> Iterator[Switchboard]:
    switchboard = Switchboard()
    try:
        yield switchboard
    finally:
        switchboard.close()
