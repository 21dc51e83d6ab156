"""Configuration: topology membership, limit validation."""

from __future__ import annotations

import dataclasses

import pytest

from relay.core.config import CoreConfig, Limits, Topology
from relay.errors import ConfigError


def topology() -> Topology:
    return Topology(
        {
            7: ("orders.*",),
            2: ("orders.eu", "payments"),
            5: ("payments",),
            1: ("*",),
        }
    )


def test_members_exact_and_patterns_sorted() -> None:
    topo = topology()
    assert topo.members("orders.eu") == (1, 2, 7)
    assert topo.members("orders.us") == (1, 7)
    assert topo.members("payments") == (1, 2, 5)
    assert topo.members("ordersx") == (1,)
    assert topo.relay_ids == (1, 2, 5, 7)


def test_pattern_dot_is_literal() -> None:
    topo = Topology({3: ("orders.*",)})
    assert topo.members("orders.eu") == (3,)
    assert topo.members("ordersx") == ()
    assert topo.members("orders") == ()
    assert topo.members("Orders.eu") == ()  # case-sensitive


def test_members_of_unknown_stream_is_empty() -> None:
    topo = Topology({3: ("orders.*",), 4: ("payments",)})
    assert topo.members("unknown") == ()
    assert topo.members("payment") == ()
    assert not topo.serves(3, "payments")
    assert topo.serves(4, "payments")


def test_a_relay_may_serve_no_stream() -> None:
    # One being taken out of the mesh (docs/deploy.md section 9).
    topo = Topology({0: (), 1: ("orders",)})
    assert topo.members("orders") == (1,) and not topo.serves(0, "orders")


def test_memoised_answers_stay_correct() -> None:
    topo = topology()
    for _ in range(3):
        assert topo.members("orders.eu") == (1, 2, 7)
        assert topo.members("nothing-serves-this") == (1,)


@pytest.mark.parametrize("subscriptions", [{}, {1024: ("a",)}, {-1: ("a",)}, {1: ("",)}])
def test_bad_topologies(subscriptions: dict[int, tuple[str, ...]]) -> None:
    with pytest.raises(ConfigError):
        Topology(subscriptions)


def test_default_limits_are_valid() -> None:
    Limits()


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Limits)])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_limits_raise_naming_the_field(name: str, value: int) -> None:
    with pytest.raises(ConfigError, match=name):
        Limits(**{name: value})


@pytest.mark.parametrize("value", [1.5, "10", None])
def test_non_integer_limits_raise(value: object) -> None:
    with pytest.raises(ConfigError, match="max_tx_bytes"):
        Limits(max_tx_bytes=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(("heartbeat", "suspect"), [(20, 20), (20, 19), (100, 50)])
def test_suspect_must_exceed_heartbeat(heartbeat: int, suspect: int) -> None:
    with pytest.raises(ConfigError, match="suspect_timeout_ms"):
        Limits(heartbeat_interval_ms=heartbeat, suspect_timeout_ms=suspect)
    Limits(heartbeat_interval_ms=heartbeat, suspect_timeout_ms=heartbeat + 1)


def test_core_config() -> None:
    topo = topology()
    config = CoreConfig(relay_id=2, topology=topo)
    assert config.limits == Limits()
    with pytest.raises(ConfigError, match="3"):
        CoreConfig(relay_id=3, topology=topo)


def test_topology_rejects_a_bare_string_subscription() -> None:
    with pytest.raises(ConfigError, match="subscriptions must be a list"):
        Topology({1: "orders.*"})  # type: ignore[dict-item]


def test_topology_rejects_a_non_integer_relay_id() -> None:
    with pytest.raises(ConfigError, match="must be an integer"):
        Topology({"1": ("a",)})  # type: ignore[dict-item]


def test_limits_reject_a_boolean() -> None:
    with pytest.raises(ConfigError, match="heartbeat_interval_ms"):
        Limits(heartbeat_interval_ms=True)
