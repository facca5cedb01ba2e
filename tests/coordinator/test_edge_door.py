"""The door's request limits (coordinator/edge.py): what one client is, whatever form its address takes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from veriroll.coordinator.config import CoordinatorConfig
from veriroll.coordinator.edge import Door, Refusal
from veriroll.protos.netaddr import peer_address
from veriroll.protos.reasons import Reason

NO_KEY = SimpleNamespace(public_key=SimpleNamespace(raw=b""))  # refused right after the address's limit


def door(peer_burst: float) -> Door:
    cfg = CoordinatorConfig.model_validate({"server": {"peer_rate_per_s": 0.001, "peer_burst": peer_burst}})
    return Door(cfg, ledger=None, clock=lambda: 1_000_000)


def refusal(d: Door, peer: str) -> Refusal:
    with pytest.raises(Refusal) as refused:
        asyncio.run(d.admit("/veriroll.v1.Coordinator/Heartbeat", "Heartbeat", b"", NO_KEY, peer))
    return refused.value


def over_its_limit(r: Refusal) -> bool:
    return r.reason is Reason.RATE_LIMITED and "from this address" in r.detail


def test_one_ipv4_client_over_a_dual_stack_listener_has_one_budget():
    d = door(peer_burst=2)
    # the same client, seen once over an IPv6 socket (IPv4-mapped) and once over an IPv4 one
    first, second = (peer_address(p) for p in ("ipv6:[::ffff:1.2.3.4]:5", "ipv4:1.2.3.4:6"))
    assert not over_its_limit(refusal(d, first)) and not over_its_limit(refusal(d, second))
    assert over_its_limit(refusal(d, first)) and over_its_limit(refusal(d, second))
    assert not over_its_limit(refusal(d, "1.2.3.5"))  # its neighbour has a budget of its own


def test_the_addresses_of_one_ipv6_64_share_one_budget():
    d = door(peer_burst=2)
    assert not over_its_limit(refusal(d, "2001:db8:1:2::1")) and not over_its_limit(refusal(d, "2001:db8:1:2::2"))
    assert over_its_limit(refusal(d, "2001:db8:1:2:ffff::3"))  # a fresh address in the same /64 does not help
    assert not over_its_limit(refusal(d, "2001:db8:1:3::1"))
