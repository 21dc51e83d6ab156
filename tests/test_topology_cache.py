"""The cache of checked topologies (relay/topology/cache.py): what it keeps is exactly what
checking gives, and anything that could make it wrong (a changed file, another working
directory, a damaged entry, a directory others may write) makes it check again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import pytest

from relay import topology
from relay.errors import ConfigError
from relay.topology import cache as topology_cache

ROOT = Path(__file__).resolve().parent.parent

# Every section, so a field of MeshConfig the document forgets shows up as a difference.
EVERY_SECTION = """\
relays:
  - {id: 0, host: 127.0.0.1, mesh_port: 7100, client_port: 7200, http_port: 7300,
     streams: ["orders.*", audit]}
  - {id: 1, advertise: 10.0.0.2, bind: 0.0.0.0, mesh_port: 7101, client_port: 7201,
     streams: ["orders.*"], public_key: "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"}
  - {id: 2, host: "::1", mesh_port: 7102, client_port: 7202, streams: [audit, "orders.*"]}
streams: [orders.eu, {name: audit, min_relays: 2}]
limits: {suspect_timeout_ms: 300, produce_timeout_ms: 3000}
data_dir: state
spool: {enabled: true, segment_max_bytes: 4096}
store:
  location: s3://bucket/relay
  s3: {endpoint_url: "http://127.0.0.1:9000", region: eu-west-1, allow_http: true}
  keep_deltas_s: 3600
  spark: {master: "local[2]", executor_python: bin/python, conf: {spark.ui.enabled: false}}
security: {curve: true, keys_dir: keys, client_key_file: keys/client-admin.key_secret}
http: {expose_status: true}
access:
  admin: {produce: ["*"], consume: ["*"], admin: true, metadata: ["*"]}
  app: {produce: [orders.eu], consume: ["orders.*"], metadata: ["consumers/app-*"],
        public_key: "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"}
"""


def write(directory: Path, text: str, name: str = "mesh.yaml") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def entries(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.topology.msgpack"))


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv(topology_cache.CACHE_DIR_ENV, str(directory))
    return directory


@pytest.mark.parametrize(
    "path", [ROOT / "config" / "topology.yaml", ROOT / "config" / "topology-5.yaml", None]
)
def test_the_document_gives_back_the_checked_topology(tmp_path: Path, path: Path | None) -> None:
    checked = topology.loads(
        EVERY_SECTION if path is None else path.read_text(), path or tmp_path / "mesh.yaml"
    )
    raw = msgpack.packb(topology_cache.as_document(checked), use_bin_type=True)
    again = topology_cache.from_document(msgpack.unpackb(raw, use_list=False))
    assert again == checked
    assert again.topology.members("orders.eu") == checked.topology.members("orders.eu")
    assert again.store_location == checked.store_location


def test_a_second_load_comes_from_the_cache(tmp_path: Path, cache: Path) -> None:
    path = write(tmp_path, EVERY_SECTION)
    first = topology.load(path)
    assert len(entries(cache)) == 1
    assert topology.load(path) == first
    # In a process of its own: the second load neither checks nor imports pydantic.
    probe = (
        "import sys; from relay import topology; c = topology.load(sys.argv[1]); "
        "print(sorted(c.relays), 'pydantic' in sys.modules, 'relay.topology.check' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(path)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, topology_cache.CACHE_DIR_ENV: str(cache)},
    ).stdout
    assert out.split() == ["[0,", "1,", "2]", "False", "False"]


def test_a_changed_file_is_checked_again(tmp_path: Path, cache: Path) -> None:
    path = write(tmp_path, EVERY_SECTION)
    assert topology.load(path).relays[0].http_port == 7300
    path.write_text(EVERY_SECTION.replace("http_port: 7300", "http_port: 7399"))
    assert topology.load(path).relays[0].http_port == 7399
    path.write_text(EVERY_SECTION.replace("http_port: 7300", "http_port: 70000"))
    with pytest.raises(ConfigError, match=r"relays\[0\].http_port: 70000 is outside"):
        topology.load(path)
    with pytest.raises(ConfigError):  # a problem is never kept: found again each time
        topology.load(path)
    assert len(entries(cache)) == 1


def test_relative_paths_follow_the_working_directory(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("a", "b"):
        write(tmp_path / name / "conf", EVERY_SECTION)
    loaded = {}
    for name in ("a", "b", "a"):
        monkeypatch.chdir(tmp_path / name)
        config = topology.load("conf/mesh.yaml")
        assert config.path == Path("conf/mesh.yaml")
        loaded[name] = config.data_dir
    assert loaded == {
        "a": tmp_path / "a" / "conf" / "state",
        "b": tmp_path / "b" / "conf" / "state",
    }


@pytest.mark.parametrize("damage", [b"", b"\x93not a map", b"\x81\xa3key\xc4\x01x"])
def test_a_damaged_entry_is_a_miss(tmp_path: Path, cache: Path, damage: bytes) -> None:
    path = write(tmp_path, EVERY_SECTION)
    checked = topology.load(path)
    (entry,) = entries(cache)
    entry.write_bytes(damage)
    assert topology.load(path) == checked
    assert entry.read_bytes() != damage  # written again


def test_an_entry_under_another_key_is_not_used(tmp_path: Path, cache: Path) -> None:
    """The key is what ties an entry to a file's text: an entry with the file's key is used
    as it is (so only this user may write the directory, below); any other is not."""
    path = write(tmp_path, EVERY_SECTION)
    checked = topology.load(path)
    (entry,) = entries(cache)
    kept = msgpack.unpackb(entry.read_bytes())
    kept["key"] = b"\0" * 16
    kept["config"]["relays"][0]["client_port"] = 9999
    entry.write_bytes(msgpack.packb(kept, use_bin_type=True))
    assert topology.load(path) == checked


def test_a_directory_others_may_write_is_not_used(tmp_path: Path, cache: Path) -> None:
    cache.mkdir(mode=0o700)
    cache.chmod(0o777)
    path = write(tmp_path, EVERY_SECTION)
    assert topology.load(path).relays[1].host == "10.0.0.2"
    assert entries(cache) == []


def test_an_empty_setting_turns_the_cache_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(topology_cache.CACHE_DIR_ENV, "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = write(tmp_path, EVERY_SECTION)
    assert topology.load(path) == topology.load(path)
    assert not (tmp_path / "xdg").exists()


def test_an_unwritable_cache_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(topology_cache.CACHE_DIR_ENV, str(blocker / "cache"))
    path = write(tmp_path, EVERY_SECTION)
    assert topology.load(path).streams == ("orders.eu", "audit")


def test_at_most_so_many_entries(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(topology_cache, "MAX_CACHED_TOPOLOGIES", 3)
    for i in range(6):
        topology.load(write(tmp_path / str(i), EVERY_SECTION))
    assert len(entries(cache)) == 3
