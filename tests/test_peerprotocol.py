"""The peer protocol announcement (relay/peerprotocol.py): its layout stays readable both
ways across builds. Earlier builds send five fields, and this one reads them; later
builds may add fields and limits, and this one ignores what it does not know."""

from __future__ import annotations

import msgpack
import pytest

from relay import peerprotocol
from relay.core.config import MESH_LIMITS, Limits


def test_an_announcement_carries_the_limits_every_relay_must_hold_alike() -> None:
    heard = peerprotocol.parse(peerprotocol.announcement(3, Limits(dedupe_window_entries=7)))
    assert heard.relay == 3 and heard.compatible()
    assert dict(heard.mesh_limits) == {
        name: (7 if name == "dedupe_window_entries" else getattr(Limits(), name))
        for name in MESH_LIMITS
    }
    assert "limits.dedupe_window_entries 7 there, 262144 here" in peerprotocol.limits_words(
        heard, Limits()
    )
    assert peerprotocol.limits_words(heard, Limits(dedupe_window_entries=7)) == ""


def test_an_earlier_builds_five_fields_say_no_limits_and_a_later_builds_extras_are_ignored() -> (
    None
):
    earlier = peerprotocol.parse(msgpack.packb([2, 1, 1, 1, "0.0.9"]))
    assert earlier.mesh_limits == () and peerprotocol.limits_words(earlier, Limits()) == ""
    later = peerprotocol.parse(
        msgpack.packb([2, 1, 1, 1, "9.0", {"dedupe_window_entries": 5, "new_limit": 3}, "more"])
    )
    assert later.mesh_limits == (("dedupe_window_entries", 5),)


@pytest.mark.parametrize("limits", [[1], {"dedupe_window_entries": -1}, {"x": "y"}])
def test_bad_limits_in_an_announcement_are_refused_by_name(limits: object) -> None:
    with pytest.raises(ValueError, match="bad limits"):
        peerprotocol.parse(msgpack.packb([2, 1, 1, 1, "9.0", limits]))
