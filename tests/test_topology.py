"""The YAML topology layer: the example files, every error case, warnings, limits."""

from __future__ import annotations

import dataclasses
import os
import re
import textwrap
from pathlib import Path

import pytest

from relay import topology
from relay.core.config import CoreConfig, Limits
from relay.errors import ConfigError
from relay.meta import METADATA_STREAM

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "config"

THREE = """\
relays:
  - {id: 0, host: 127.0.0.1, mesh_port: 7100, client_port: 7200, streams: ["orders.*", audit]}
  - {id: 1, host: 127.0.0.1, mesh_port: 7101, client_port: 7201, streams: ["orders.*", audit]}
  - {id: 2, host: 127.0.0.1, mesh_port: 7102, client_port: 7202, streams: ["orders.*", audit]}
streams: [orders.eu, audit]
"""


def write(tmp_path: Path, text: str, name: str = "mesh.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        topology.load(path)
    message = str(info.value)
    for line in message.splitlines():
        assert line.startswith(f"{path}: "), line
    return message


def relay(i: int, **fields: object) -> dict[str, object]:
    spec: dict[str, object] = {
        "id": i,
        "host": "127.0.0.1",
        "mesh_port": 7100 + i,
        "client_port": 7200 + i,
        "streams": ["orders.*", "audit"],
    }
    spec.update(fields)
    return spec


def mesh(*relays: dict[str, object], extra: str = "", streams: str = "[orders.eu]") -> str:
    lines = ["relays:"]
    for spec in relays:
        inner = ", ".join(f"{k}: {_yaml(v)}" for k, v in spec.items())
        lines.append(f"  - {{{inner}}}")
    if streams:
        lines.append(f"streams: {streams}")
    return "\n".join(lines) + "\n" + textwrap.dedent(extra)


def _yaml(value: object) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\0", "\\0") + '"'
    return str(value)


# --- the example files -----------------------------------------------------------------


def test_example_three_relays() -> None:
    cfg = topology.load(CONFIG / "topology.yaml")
    assert sorted(cfg.relays) == [0, 1, 2]
    assert cfg.streams == ("orders.eu", "orders.us", "audit")
    for i, spec in cfg.relays.items():
        assert spec.id == i
        assert spec.host == "127.0.0.1"
        assert spec.mesh_endpoint == f"tcp://127.0.0.1:{7100 + i}"
        assert spec.client_endpoint == f"tcp://127.0.0.1:{7200 + i}"
        assert spec.streams == ("orders.*", "audit", METADATA_STREAM)  # every relay serves it
    assert cfg.members(METADATA_STREAM) == (0, 1, 2)
    for stream in cfg.streams:
        assert cfg.members(stream) == (0, 1, 2)
    assert cfg.members("orders.asia") == (0, 1, 2)
    assert cfg.members("payments.card") == ()
    assert cfg.limits == Limits()
    assert cfg.warnings == ()
    assert cfg.data_dir == ROOT / "data"
    assert cfg.path == CONFIG / "topology.yaml"


def test_example_five_relays_partitioned() -> None:
    cfg = topology.load(CONFIG / "topology-5.yaml")
    assert sorted(cfg.relays) == [0, 1, 2, 3, 4]
    assert cfg.members("orders.eu") == (0, 1, 2)
    assert cfg.members("orders.us") == (0, 1, 2)
    assert cfg.members("payments.card") == (2, 3, 4)
    assert cfg.members("audit") == (0, 1, 2, 3, 4)
    assert cfg.members("other") == ()
    assert set(cfg.streams) == {"orders.eu", "orders.us", "payments.card", "payments.sepa", "audit"}
    for stream in cfg.streams:
        assert cfg.members(stream)
    assert cfg.warnings == ()
    assert cfg.topology.relay_ids == (0, 1, 2, 3, 4)
    ports = [p for r in cfg.relays.values() for p in (r.mesh_port, r.client_port)]
    assert len(set(ports)) == len(ports)


def test_core_config(tmp_path: Path) -> None:
    cfg = topology.load(write(tmp_path, THREE))
    core = cfg.core_config(1)
    assert isinstance(core, CoreConfig)
    assert core.relay_id == 1
    assert core.topology is cfg.topology
    assert core.limits is cfg.limits
    with pytest.raises(ConfigError, match=r"relay 7 is not in the topology") as info:
        cfg.core_config(7)
    assert str(tmp_path / "mesh.yaml") in str(info.value)
    with pytest.raises(ConfigError):
        cfg.core_config(True)


def test_loads_and_both_stream_forms(tmp_path: Path) -> None:
    text = mesh(relay(0), relay(1), relay(2), streams="[orders.eu, {name: audit, min_relays: 3}]")
    cfg = topology.loads(text)
    assert cfg.streams == ("orders.eu", "audit")
    assert str(cfg.path) == "<string>"
    assert cfg.data_dir == Path(os.path.abspath("../data"))
    assert topology.loads(text, tmp_path / "x.yaml").data_dir == (tmp_path.parent / "data")


def test_relays_are_keyed_by_id_in_order() -> None:
    cfg = topology.loads(mesh(relay(5), relay(2), relay(9)))
    assert list(cfg.relays) == [2, 5, 9]
    assert cfg.members("orders.eu") == (2, 5, 9)


def test_streams_and_limits_optional() -> None:
    cfg = topology.loads(mesh(relay(0), relay(1), relay(2), streams=""))
    assert cfg.streams == ()
    assert cfg.limits == Limits()
    cfg = topology.loads(mesh(relay(0), relay(1), relay(2), extra="limits:\ndata_dir: /srv/x\n"))
    assert cfg.limits == Limits()
    assert cfg.data_dir == Path("/srv/x")


def test_limits_override_applied(tmp_path: Path) -> None:
    text = THREE + "limits:\n  suspect_timeout_ms: 300\n  max_tx_bytes: 4096\n"
    cfg = topology.load(write(tmp_path, text))
    assert cfg.limits.suspect_timeout_ms == 300
    assert cfg.limits.max_tx_bytes == 4096
    assert cfg.limits.heartbeat_interval_ms == Limits().heartbeat_interval_ms
    assert cfg.core_config(0).limits.suspect_timeout_ms == 300


def test_data_dir_relative_to_file(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    path = write(tmp_path, THREE + "data_dir: state/here\n", name="conf/mesh.yaml")
    assert topology.load(path).data_dir == tmp_path / "conf" / "state" / "here"


def test_ipv6_endpoint() -> None:
    cfg = topology.loads(mesh(relay(0, host="::1"), relay(1), relay(2)))
    assert cfg.relays[0].mesh_endpoint == "tcp://[::1]:7100"


# --- warnings ---------------------------------------------------------------------------


def test_warning_for_fewer_than_three_relays(tmp_path: Path) -> None:
    text = mesh(
        relay(0),
        relay(1, streams=["orders.*"]),
        relay(2, streams=["orders.*"]),
        streams="[orders.eu, audit]",
    )
    cfg = topology.load(write(tmp_path, text))
    assert len(cfg.warnings) == 1
    (warning,) = cfg.warnings
    assert warning.startswith(f"{tmp_path / 'mesh.yaml'}: streams[1]: ")
    assert "'audit'" in warning
    assert "only 1 relay (relay 0)" in warning
    assert cfg.members("audit") == (0,)

    two = topology.loads(mesh(relay(0), relay(1), streams="[orders.eu]"))
    assert len(two.warnings) == 1
    assert "only 2 relays (relays 0, 1)" in two.warnings[0]
    assert "tolerates no relay failure" in two.warnings[0]


# --- errors -----------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="no such file") as info:
        topology.load(path)
    assert str(info.value).startswith(f"{path}: ")


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory") as info:
        topology.load(tmp_path)
    assert str(info.value).startswith(f"{tmp_path}: ")
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"relays: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        topology.load(path)


def test_yaml_syntax_error_has_line(tmp_path: Path) -> None:
    message = error(tmp_path, "relays:\n  - id: 0\n   host: [127.0.0.1\n")
    assert "invalid YAML" in message
    assert "line 3" in message


def test_yaml_duplicate_key(tmp_path: Path) -> None:
    message = error(tmp_path, THREE + "relays: []\n")
    assert "duplicate key 'relays'" in message
    assert "line 6" in message
    assert "first given on line 1" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "the topology is empty"),
        ("- 1\n- 2\n", "expected a mapping with 'relays' at the top level, got a list"),
        ("streams: [a]\n", "relays: missing; this field is required"),
        ("relays: []\n", "relays: at least one relay is required"),
        ("relays:\n", "relays: expected a list, got an empty value"),
    ],
)
def test_top_level_shape(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in error(tmp_path, text)


def test_unknown_keys(tmp_path: Path) -> None:
    message = error(tmp_path, mesh(relay(0, mesh_prot=1), relay(1), relay(2), extra="extra: 1\n"))
    assert "relays[0].mesh_prot: unknown field; did you mean 'mesh_port'?" in message
    assert "extra: unknown field" in message
    message = error(tmp_path, THREE + "limits:\n  suspect_timeout: 100\n")
    assert "limits.suspect_timeout: unknown limit; did you mean 'suspect_timeout_ms'?" in message
    message = error(tmp_path, mesh(relay(0), streams="[{name: a, quorum: 2}]"))
    assert "streams[0].quorum: unknown field" in message


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("mesh_port", '"7101"', "relays[1].mesh_port: expected an integer, got the string '7101'"),
        ("client_port", "7201.5", "relays[1].client_port: expected an integer, got the number"),
        ("id", "true", "relays[1].id: expected an integer, got the boolean True"),
        ("host", "12", "relays[1].host: expected a string, got the integer 12"),
        ("streams", "audit", "relays[1].streams: expected a list, got the string 'audit'"),
        ("streams", "[audit, 3]", "relays[1].streams[1]: expected a string, got the integer 3"),
    ],
)
def test_wrong_types(tmp_path: Path, field: str, value: str, expected: str) -> None:
    bad = relay(1)
    del bad[field]
    inner = ", ".join(f"{k}: {_yaml(v)}" for k, v in bad.items())
    text = mesh(relay(0), relay(2)).replace(
        "relays:\n  - {id: 0", f"relays:\n  - {{{inner}, {field}: {value}}}\n  - {{id: 0"
    )
    text = text.replace("relays:\n  - {id: 1", "relays:\n  - {id: 0").replace(
        "  - {id: 0", "  - {id: 9", 1
    )
    message = error(tmp_path, text)
    assert expected.replace("relays[1]", "relays[0]") in message


def test_min_relays_and_stream_entry_types(tmp_path: Path) -> None:
    message = error(tmp_path, mesh(relay(0), streams='[{name: a, min_relays: "3"}]'))
    assert "streams[0].min_relays: expected an integer, got the string '3'" in message
    message = error(tmp_path, mesh(relay(0), streams="[{name: a, min_relays: 0}]"))
    assert "streams[0].min_relays: 0 must be at least 1" in message
    message = error(tmp_path, mesh(relay(0), streams="[orders.eu, 42]"))
    assert "streams[1]: expected a stream name or a mapping" in message
    message = error(tmp_path, mesh(relay(0), streams="[{min_relays: 1}]"))
    assert "streams[0].name: missing; this field is required" in message
    message = error(tmp_path, mesh(relay(0), extra="limits: [1]\n"))
    assert "limits: expected a mapping, got a list" in message


def test_relay_ids_unique_and_in_range(tmp_path: Path) -> None:
    message = error(tmp_path, mesh(relay(0), relay(1), relay(2, id=0)))
    assert "relays[2].id: 0 is already used by relays[0]" in message
    message = error(tmp_path, mesh(relay(0), relay(1024)))
    assert "relays[1].id: 1024 is outside 0..1023" in message
    message = error(tmp_path, mesh(relay(-1), relay(1)))
    assert "relays[0].id: -1 is outside 0..1023" in message


def test_host_and_port_pairs_unique(tmp_path: Path) -> None:
    message = error(tmp_path, mesh(relay(0), relay(1, mesh_port=7100), relay(2)))
    assert "relays[1].mesh_port: 7100 is already used by relay 0" in message
    message = error(tmp_path, mesh(relay(0), relay(1, client_port=7100), relay(2)))
    assert "relays[1].client_port: 7100 is already used by relay 0 (its mesh_port" in message
    message = error(tmp_path, mesh(relay(0, client_port=7100), relay(1), relay(2)))
    assert "relays[0].client_port: 7100 is already used by relay 0 (its mesh_port" in message
    # the same port on another host is fine
    cfg = topology.loads(mesh(relay(0), relay(1, host="127.0.0.2", mesh_port=7100), relay(2)))
    assert cfg.relays[1].mesh_endpoint == "tcp://127.0.0.2:7100"


@pytest.mark.parametrize("port", [0, 65536, -5])
def test_port_range(tmp_path: Path, port: int) -> None:
    message = error(tmp_path, mesh(relay(0), relay(1, client_port=port), relay(2)))
    assert f"relays[1].client_port: {port} is outside 1..65535" in message


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("", "is not a host name or address"),
        ("0.0.0.0", "is a wildcard"),
        ("*", "is a wildcard"),
        ("tcp://127.0.0.1", "without scheme or path"),
        ("127.0.0.1:7100", "ports go in mesh_port and client_port"),
    ],
)
def test_bad_host(tmp_path: Path, host: str, expected: str) -> None:
    message = error(tmp_path, mesh(relay(0), relay(1, host=host), relay(2)))
    assert "relays[1].host: " in message
    assert expected in message


def without_host(i: int, **fields: object) -> dict[str, object]:
    spec = relay(i, **fields)
    del spec["host"]
    return spec


def test_host_is_advertise_and_bind_in_one() -> None:
    spec = topology.loads(mesh(relay(0), relay(1), relay(2))).relays[0]
    assert (spec.host, spec.bind, spec.bind_host) == ("127.0.0.1", None, "127.0.0.1")
    assert spec.mesh_bind_endpoint == spec.mesh_endpoint == "tcp://127.0.0.1:7100"
    assert spec.client_bind_endpoint == spec.client_endpoint == "tcp://127.0.0.1:7200"


@pytest.mark.parametrize("bind", ["0.0.0.0", "::", "10.0.0.7", "eth0.example"])
def test_bind_may_be_a_wildcard_or_an_address(bind: str) -> None:
    cfg = topology.loads(mesh(without_host(0, advertise="10.0.0.5", bind=bind), relay(1), relay(2)))
    spec = cfg.relays[0]
    assert (spec.host, spec.bind, spec.bind_host) == ("10.0.0.5", bind, bind)
    assert spec.mesh_endpoint == "tcp://10.0.0.5:7100"  # peers connect to the advertised one
    bracketed = f"[{bind}]" if ":" in bind else bind
    assert spec.mesh_bind_endpoint == f"tcp://{bracketed}:7100"
    assert spec.client_bind_endpoint == f"tcp://{bracketed}:7200"


def test_advertise_alone_binds_the_advertised_address() -> None:
    spec = topology.loads(mesh(without_host(0, advertise="10.0.0.5"), relay(1))).relays[0]
    assert (spec.host, spec.bind_host) == ("10.0.0.5", "10.0.0.5")
    assert spec.client_bind_endpoint == spec.client_endpoint == "tcp://10.0.0.5:7200"


@pytest.mark.parametrize("advertise", ["0.0.0.0", "::", "*", "[::]", "0:0::0"])
def test_advertise_is_never_a_wildcard(tmp_path: Path, advertise: str) -> None:
    message = error(tmp_path, mesh(without_host(0, advertise=advertise), relay(1)))
    assert f"relays[0].advertise: {advertise!r} is a wildcard; advertise is the address " in (
        message
    )
    assert "(a wildcard belongs in bind)" in message


def test_host_wildcard_points_to_advertise_and_bind(tmp_path: Path) -> None:
    message = error(tmp_path, mesh(relay(0, host="0.0.0.0"), relay(1)))
    assert "relays[0].host: '0.0.0.0' is a wildcard" in message
    assert "give advertise: <this host's address> and bind: 0.0.0.0 instead" in message


@pytest.mark.parametrize("bind", ["*", "[::]"])
def test_bind_wildcard_spelled_for_zeromq_only(tmp_path: Path, bind: str) -> None:
    message = error(tmp_path, mesh(without_host(0, advertise="10.0.0.5", bind=bind), relay(1)))
    assert f"relays[0].bind: {bind!r}: write the wildcard as 0.0.0.0" in message


@pytest.mark.parametrize(
    ("bind", "expected"),
    [
        ("", "is not a host name or address"),
        ("tcp://0.0.0.0", "without scheme or path"),
        ("0.0.0.0:7100", "ports go in mesh_port and client_port"),
    ],
)
def test_bad_bind(tmp_path: Path, bind: str, expected: str) -> None:
    message = error(tmp_path, mesh(without_host(0, advertise="10.0.0.5", bind=bind), relay(1)))
    assert "relays[0].bind: " in message
    assert expected in message


def test_host_with_advertise_or_bind_and_neither(tmp_path: Path) -> None:
    message = error(tmp_path, mesh(relay(0, advertise="10.0.0.5"), relay(1)))
    assert "relays[0].advertise: give host (the address to bind and advertise) or advertise, " in (
        message
    )
    message = error(tmp_path, mesh(relay(0, bind="0.0.0.0"), relay(1)))
    assert (
        "relays[0].bind: host sets the bind address too; give advertise: 127.0.0.1 with "
        "bind: 0.0.0.0 instead of host"
    ) in message
    message = error(tmp_path, mesh(relay(0), without_host(1)))
    assert "relays[1]: missing host or advertise: give advertise (" in message


def test_ports_are_unique_per_advertised_address(tmp_path: Path) -> None:
    # Three hosts, each relay on the same ports, every one bound to the wildcard: fine.
    ports = {"mesh_port": 7100, "client_port": 7200, "http_port": 7300}
    hosts = [
        without_host(i, advertise=f"10.0.0.{i + 1}", bind="0.0.0.0", **ports) for i in range(3)
    ]
    cfg = topology.loads(mesh(*hosts))
    assert [spec.mesh_endpoint for spec in cfg.relays.values()] == [
        "tcp://10.0.0.1:7100",
        "tcp://10.0.0.2:7100",
        "tcp://10.0.0.3:7100",
    ]
    # Two relays advertising one address are on one host: a port used twice is refused.
    hosts[1]["advertise"] = "10.0.0.1"
    message = error(tmp_path, mesh(*hosts))
    assert "relays[1].mesh_port: 7100 is already used by relay 0 (its mesh_port on 10.0.0.1)" in (
        message
    )
    assert "relays[1].http_port: 7300 is already used by relay 0" in message


def test_bind_conflicts_on_one_machine(tmp_path: Path) -> None:
    # relay 1 advertises another name but binds relay 0's address: the same machine, where
    # relay 0 holds the port on every address.
    zero = without_host(0, advertise="10.0.0.1", bind="0.0.0.0")
    one = without_host(1, advertise="relay-1.example", bind="10.0.0.1", mesh_port=7200)
    message = error(tmp_path, mesh(zero, one))
    assert (
        "relays[1].mesh_port: 7200 cannot be bound at 10.0.0.1: relay 0 binds it at 0.0.0.0 "
        "on the same machine (its client_port)"
    ) in message
    zero["bind"] = "::"  # every address, IPv4 ones too
    message = error(tmp_path, mesh(zero, one))
    assert "relays[1].mesh_port: 7200 cannot be bound at 10.0.0.1: relay 0 binds it at ::" in (
        message
    )
    one["mesh_port"] = 7101  # another port of the machine: fine
    assert topology.loads(mesh(zero, one)).relays[1].mesh_bind_endpoint == "tcp://10.0.0.1:7101"
    # A loopback bind names no machine: every host has one.
    lonely = without_host(1, advertise="10.0.0.2", bind="127.0.0.1", mesh_port=7200)
    assert topology.loads(mesh(zero, lonely)).relays[1].bind_host == "127.0.0.1"


def test_relay_without_streams(tmp_path: Path) -> None:
    # A relay being taken out of the mesh serves no stream, not even the metadata one:
    # allowed, with a warning that says what it does.
    config = topology.loads(mesh(relay(0), relay(1, streams=[]), relay(2)))
    assert config.relays[1].streams == ()
    assert config.members(METADATA_STREAM) == (0, 2)
    assert any("relays[1].streams: relay 1 serves no stream" in w for w in config.warnings)
    message = error(tmp_path, mesh(relay(0), relay(1, streams=["audit", "audit"]), relay(2)))
    assert "relays[1].streams[1]: 'audit' is listed twice (first as relays[1].streams[0])" in (
        message
    )


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("", "a stream name must not be empty"),
        ("a|b", "'|' is not allowed"),
        ("a\0b", "NUL is not allowed"),
        ("x" * 256, "is 256 UTF-8 bytes long; at most 255 allowed"),
        ("é" * 128, "is 256 UTF-8 bytes long; at most 255 allowed"),
    ],
)
def test_stream_names(tmp_path: Path, name: str, expected: str) -> None:
    message = error(tmp_path, mesh(relay(0, streams=["audit", name]), relay(1)))
    assert "relays[0].streams[1]: " in message
    assert expected in message
    message = error(tmp_path, mesh(relay(0), relay(1), streams=f"[audit, {_yaml(name)}]"))
    assert "streams[1].name: " in message
    assert expected in message


def test_stream_name_of_255_bytes_is_fine() -> None:
    name = "orders." + "x" * 248
    cfg = topology.loads(mesh(relay(0), relay(1), relay(2), streams=f"[{name}]"))
    assert cfg.streams == (name,)


def test_stream_name_bound_by_lower_limit(tmp_path: Path) -> None:
    text = mesh(relay(0), relay(1), relay(2), streams="[orders.europe]")
    message = error(tmp_path, text + "limits: {max_stream_name_bytes: 8}\n")
    assert "streams[0]: 'orders.europe' is 13 UTF-8 bytes long; at most 8 allowed" in message
    assert "relays[0].streams[0]" not in message  # 'orders.*' fits


def test_declared_stream_is_exact_and_unique(tmp_path: Path) -> None:
    message = error(tmp_path, mesh(relay(0), streams='["orders.*"]'))
    assert "streams[0].name: 'orders.*' is a pattern" in message
    message = error(tmp_path, mesh(relay(0), relay(1), relay(2), streams="[audit, audit]"))
    assert "streams[1]: 'audit' is listed twice (first as streams[0])" in message


def test_stream_no_relay_serves(tmp_path: Path) -> None:
    message = error(tmp_path, mesh(relay(0), relay(1), relay(2), streams="[audit, payments.card]"))
    assert "streams[1]: 'payments.card' is a stream no relay serves" in message


def test_min_relays_not_met(tmp_path: Path) -> None:
    text = mesh(
        relay(0),
        relay(1),
        relay(2, streams=["orders.*"]),
        streams="[{name: audit, min_relays: 3}, {name: orders.eu, min_relays: 3}]",
    )
    message = error(tmp_path, text)
    assert "streams[0].min_relays: 'audit' needs 3 relays but only 2 serve it" in message
    assert "(relays 0, 1)" in message
    assert "quorum cannot be met" in message
    assert "orders.eu" not in message
    # met exactly: no error, and no warning either
    cfg = topology.loads(text.replace("audit, min_relays: 3", "audit, min_relays: 2"))
    assert len(cfg.warnings) == 1  # audit on 2 relays
    assert "streams[0]" in cfg.warnings[0]


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ("{max_tx_bytes: 0}", "limits.max_tx_bytes: must be a positive integer, got 0"),
        ("{max_tx_bytes: big}", "limits.max_tx_bytes: must be a positive integer, got 'big'"),
        ("{max_tx_bytes: true}", "limits.max_tx_bytes: must be a positive integer, got True"),
        (
            "{suspect_timeout_ms: 10}",
            "limits.suspect_timeout_ms: must exceed heartbeat_interval_ms (10 <= 20)",
        ),
        (
            "{heartbeat_interval_ms: 500}",
            "limits.heartbeat_interval_ms: suspect_timeout_ms must exceed heartbeat_interval_ms",
        ),
    ],
)
def test_limits_checked_by_core(tmp_path: Path, limits: str, expected: str) -> None:
    assert expected in error(tmp_path, THREE + f"limits: {limits}\n")


def test_empty_data_dir(tmp_path: Path) -> None:
    assert "data_dir: must not be empty" in error(tmp_path, THREE + 'data_dir: ""\n')


def test_all_problems_in_one_error(tmp_path: Path) -> None:
    text = mesh(
        relay(0),
        relay(0, mesh_port=7100, client_port=7201),
        relay(2),
        streams="[audit, nothing]",
    )
    message = error(tmp_path, text)
    lines = message.splitlines()
    assert any("relays[1].id: 0 is already used" in line for line in lines)
    assert any("relays[1].mesh_port: 7100 is already used" in line for line in lines)
    assert any("streams[1]: 'nothing' is a stream no relay serves" in line for line in lines)


def test_spool_settings_default_off_and_checked(tmp_path: Path) -> None:
    loads = topology.loads
    relays = (
        "relays:\n  - {id: 0, host: 127.0.0.1, mesh_port: 7100, client_port: 7200, streams: [a]}\n"
    )
    plain = loads(relays, tmp_path / "t.yaml")
    assert not plain.spool.enabled
    assert plain.spool_dir == plain.data_dir / "spool"
    assert plain.store_location.local_root == plain.data_dir / "store"
    on = loads(relays + "spool: {enabled: true, segment_max_age_ms: 500}\n", tmp_path / "t.yaml")
    assert on.spool.enabled and on.spool.segment_max_age_ms == 500
    with pytest.raises(ConfigError) as info:
        loads(relays + "spool: {enabled: 1, disk_max_bytes: 0, size: 3}\n", tmp_path / "t.yaml")
    text = str(info.value)
    assert "spool.enabled: expected true or false, got the integer 1" in text
    assert "spool.disk_max_bytes: must be a positive integer, got 0" in text
    assert "spool.size: unknown field" in text


CURVE = "security: {curve: true}\naccess: {admin: {admin: true}}\n"


def test_status_over_http_follows_curve_unless_set_and_is_checked(tmp_path: Path) -> None:
    """http.expose_status (what relay/opsserver.py serves besides /metrics and health):
    unset, no more than the client port gives the same outsider: on without CurveZMQ,
    off with it (the client port gives the status document to admin clients only)."""
    path = tmp_path / "t.yaml"
    assert topology.loads(THREE, path).http.expose_status is True
    assert topology.loads(THREE + CURVE, path).http.expose_status is False
    exposed = topology.loads(THREE + CURVE + "http: {expose_status: true}\n", path)
    assert exposed.http.expose_status is True
    hidden = topology.loads(THREE + "http: {expose_status: false}\n", path)
    assert hidden.http.expose_status is False
    message = error(tmp_path, THREE + 'http: {expose_status: "yes", expose: 1}\n')
    assert "http.expose_status: expected true or false, got the string 'yes'" in message
    assert "http.expose: unknown field; did you mean 'expose_status'?" in message
    assert "http: expected a mapping, got the boolean True" in error(
        tmp_path, THREE + "http: true\n"
    )


# --- what a new file changes for a running relay (relay/topology/change.py) ---------------


def _mesh_text(streams: dict[int, list[str]], mesh_port_of_1: int = 7101, extra: str = "") -> str:
    relays = "".join(
        f"  - {{id: {r}, host: 127.0.0.1, mesh_port: {mesh_port_of_1 if r == 1 else 7100 + r}, "
        f"client_port: {7200 + r}, streams: {names}}}\n"
        for r, names in streams.items()
    )
    return f"relays:\n{relays}streams: [orders]\n{extra}"


def test_a_new_file_changes_streams_relays_and_refuses_the_rest_by_name() -> None:
    from relay.topology.change import compare

    old = topology.loads(_mesh_text({0: ["orders", "logs.*"], 1: ["orders"], 2: ["audit"]}))
    grown = topology.loads(_mesh_text({0: ["orders", "logs.*"], 1: ["orders"], 2: ["orders"]}))
    change = compare(old, grown, 2, tracked=["logs.x"])
    assert change.streams == {"orders": ((0, 1), (0, 1, 2)), "audit": ((2,), ())}
    assert change.served == (("audit", METADATA_STREAM), ("orders", METADATA_STREAM))
    assert not change.refused and not change.empty
    assert change.words().startswith("audit: relays [2] -> none; orders: relays [0, 1] ->")
    assert compare(old, old, 0, tracked=["logs.x"]).empty

    moved = topology.loads(_mesh_text({0: ["orders"], 1: ["orders"], 2: ["audit"]}, 7111))
    assert compare(old, moved, 0).refused == ("relays[1].mesh_port changes",)
    more = topology.loads(_mesh_text({0: ["orders"], 1: ["orders"], 2: ["audit"], 3: ["orders"]}))
    grows = compare(old, more, 0)
    assert grows.added_relays == (3,) and not grows.refused, grows
    assert grows.words().startswith("relays [3] join the mesh; "), grows.words()
    shrinks = compare(more, old, 0)
    assert shrinks.removed_relays == (3,) and not shrinks.refused, shrinks
    assert shrinks.words().startswith("relays [3] leave the mesh; "), shrinks.words()
    (itself,) = compare(more, old, 3).refused
    assert itself.startswith("this relay (3) is not in it: give it a file in which it serves no")
    limited = topology.loads(
        _mesh_text(
            {0: ["orders", "logs.*"], 1: ["orders"], 2: ["audit"]},
            extra="limits:\n  max_tx_bytes: 1000\n",
        )
    )
    lowered = compare(old, limited, 0)  # taken: it bounds what comes from then on
    assert not lowered.refused and not lowered.empty, lowered
    assert lowered.limits == (("max_tx_bytes", 1024 * 1024, 1000),), lowered
    assert lowered.words().endswith("limits.max_tx_bytes 1048576 -> 1000"), lowered.words()
    fixed = topology.loads(
        _mesh_text(
            {0: ["orders", "logs.*"], 1: ["orders"], 2: ["audit"]},
            extra=(
                "limits:\n  dedupe_window_entries: 1000\n  heartbeat_interval_ms: 30\n"
                "  max_tx_bytes: 1000\n"
            ),
        )
    )
    refused = compare(old, fixed, 0)
    assert refused.refused == (
        "limits.dedupe_window_entries changes (every relay must skip the same duplicates "
        "(protocol 5.6))",
        "limits.heartbeat_interval_ms changes (the mesh links' reconnect interval is set "
        "when they open)",
    ), refused.refused
    assert refused.limits == (("max_tx_bytes", 1024 * 1024, 1000),), refused
    hidden = topology.loads(
        _mesh_text(
            {0: ["orders", "logs.*"], 1: ["orders"], 2: ["audit"]},
            extra="http:\n  expose_status: false\n",
        )
    )
    assert compare(old, hidden, 0).refused == ("http changes",)  # at a restart


def test_the_example_file_marks_the_limits_a_reload_does_not_take() -> None:
    """config/topology.yaml marks `[start]` the limits a running relay cannot take
    (LIMITS_AT_START) and `[mesh]` those every relay must hold alike (MESH_LIMITS), and
    lists every limit: the marks follow the code."""
    from relay.core.config import LIMITS_AT_START, MESH_LIMITS

    marks: dict[str, str] = {}
    for line in (ROOT / "config" / "topology.yaml").read_text(encoding="utf-8").splitlines():
        found = re.match(r"\s*# (\w+): \d+\s*(?:# \[(start|mesh)\])?", line)
        if found and found.group(1) in {f.name for f in dataclasses.fields(Limits)}:
            marks[found.group(1)] = found.group(2) or ""
    assert sorted(marks) == sorted(f.name for f in dataclasses.fields(Limits))
    assert {n for n, m in marks.items() if m == "start"} == set(LIMITS_AT_START)
    assert {n for n, m in marks.items() if m == "mesh"} == set(MESH_LIMITS)
