"""Fixtures for the Hub tests: a fake Hub on 127.0.0.1 and an environment that never reaches the real one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.hub.fakehub import FakeHub
from tests.hub.helpers import TOKEN, USER


@pytest.fixture(autouse=True)
def _offline_hub_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # A developer's real token must never be used by (or leak into) these tests.
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with FakeHub(tokens={TOKEN: USER}) as h:
        yield h
