"""Which KV address a replica advertises, and to whom (``services.replica.kv_address``)."""

from __future__ import annotations

import pytest

from services.replica.kv_address import (
    KvAddressError,
    caller_host,
    may_advertise,
    resolve_kv_host,
)


def test_the_kv_address_is_the_one_bound_address() -> None:
    assert resolve_kv_host(None, "127.0.0.1", "prefill") == "127.0.0.1"
    assert resolve_kv_host(None, "198.18.0.5", "prefill") == "198.18.0.5"
    assert resolve_kv_host("198.18.0.7", "0.0.0.0", "prefill") == "198.18.0.7"


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_wildcard_bound_prefill_replica_needs_kv_host(host: str) -> None:
    with pytest.raises(KvAddressError, match="--kv-host"):
        resolve_kv_host(None, host, "prefill")
    with pytest.raises(KvAddressError, match="wildcard"):
        resolve_kv_host("0.0.0.0", host, "prefill")
    assert resolve_kv_host(None, host, "decode")  # listens for no KV: nothing advertised


def test_loopback_kv_is_advertised_to_local_callers_only() -> None:
    assert caller_host("ipv4:198.18.0.9:41234") == "198.18.0.9"
    assert caller_host("ipv6:[::1]:41234") == "::1"
    assert caller_host("unix:/tmp/socket") is None
    assert may_advertise("127.0.0.1", "ipv4:127.0.0.1:5000")
    assert may_advertise("127.0.0.1", "ipv6:[::1]:5000")
    assert not may_advertise("127.0.0.1", "ipv4:198.18.0.9:5000")
    assert may_advertise("198.18.0.5", "ipv4:198.18.0.9:5000")
