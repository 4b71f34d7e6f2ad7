"""The get_host relay's limits from the daemon's environment (:func:`weenv.server.e2b.ports.relay_settings`)."""

from __future__ import annotations

import pytest

from weenv.errors import InvalidInputError
from weenv.server.e2b.ports import RELAY_IDLE_S, relay_settings


def test_defaults_are_a_quarter_of_the_tcp_cap_and_a_minute(monkeypatch):
    monkeypatch.delenv("WEENV_RELAY_MAX", raising=False)
    monkeypatch.delenv("WEENV_RELAY_IDLE_S", raising=False)
    assert relay_settings(1024) == {"max_relays": 256, "idle_timeout": RELAY_IDLE_S}
    monkeypatch.setenv("WEENV_RELAY_MAX", "5000")  # never the whole cap: the API keeps some
    monkeypatch.setenv("WEENV_RELAY_IDLE_S", "2.5")
    assert relay_settings(1024) == {"max_relays": 1016, "idle_timeout": 2.5}


@pytest.mark.parametrize("name,value", [("WEENV_RELAY_MAX", "0"), ("WEENV_RELAY_MAX", "many"),
                                        ("WEENV_RELAY_IDLE_S", "-1"), ("WEENV_RELAY_IDLE_S", "nan")])
def test_a_bad_value_names_its_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidInputError, match=name):
        relay_settings(1024)
