"""The public SDK surface keeps every name it had: code written against
``weenv.Sandbox`` or ``from weenv.sdk import NotFoundError`` goes on working
whatever moves inside the package (names may be added, none removed)."""

from __future__ import annotations

import pytest

import weenv
import weenv.sdk

TOP = ["AsyncSandbox", "Sandbox", "__version__", "connect_cluster", "meter"]
"""``weenv.__all__``: what ``import weenv`` offers."""

SDK = [
    "AsyncCommandHandle",
    "AsyncNodeClient",
    "AsyncSandbox",
    "AuthenticationError",
    "CapacityError",
    "CommandHandle",
    "CommandResult",
    "CommandTimeoutError",
    "DaemonError",
    "InvalidInputError",
    "NodeClient",
    "NotFoundError",
    "OutputLimitError",
    "Sandbox",
    "WeenvError",
    "meter",
]
"""``weenv.sdk.__all__``."""


@pytest.mark.parametrize("name", TOP)
def test_the_package_offers(name):
    assert name in weenv.__all__
    assert getattr(weenv, name) is not None


@pytest.mark.parametrize("name", SDK)
def test_the_sdk_offers(name):
    assert name in weenv.sdk.__all__
    assert getattr(weenv.sdk, name) is not None


def test_the_package_and_the_sdk_hand_out_the_same_objects():
    assert weenv.Sandbox is weenv.sdk.Sandbox
    assert weenv.AsyncSandbox is weenv.sdk.AsyncSandbox
    assert weenv.meter is weenv.sdk.meter
    assert callable(weenv.connect_cluster)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError):
        weenv.NoSuchThing  # noqa: B018
