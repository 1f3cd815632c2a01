"""Test helpers for KV transfer between processes and "hosts": connector processes driven over
a pipe, Linux network namespaces joined by a veth pair, and the sockets a process listens on.

A ``PeerProcess`` is a spawned process that hosts one UCX producer or consumer, optionally
inside a network namespace (joined with setns(2) before UCX starts, so every thread it
makes lives there). ``veth_namespace`` makes a namespace whose only link to this one is a
veth pair with addresses from 198.18.0.0/15 (the benchmarking range), and removes it even
when the test fails; it needs root, and fails (never skips) saying so when it cannot.
"""

from __future__ import annotations

import ctypes
import ipaddress
import math
import multiprocessing as mp
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait
from typing import Any

import pytest
import torch

from kv_transfer.connector import KvHandle, KvTransferError
from kv_transfer.layout import ITEM_SIZES, KvLayout

_CLONE_NEWNET, _CLONE_NEWNS = 0x40000000, 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 1 << 19, 2


def kv_pattern(layout: KvLayout, num_blocks: int, seed: int) -> torch.Tensor:
    """A cache whose every element's bits are a (nonlinear) function of its position."""
    shape = (num_blocks, layout.num_layers, 2, layout.num_kv_heads, layout.block_size,
             layout.head_size)
    prime = 2_147_483_647
    x = (torch.arange(math.prod(shape), dtype=torch.int64) * 40_503 + seed * 7_919) % prime
    x = (x * x + seed) % prime
    bits: torch.Tensor
    if ITEM_SIZES[layout.dtype] == 2:
        bits = (x % 65_536 - 32_768).to(torch.int16)
    else:
        bits = (x - 2**30).to(torch.int32)
    return bits.view(getattr(torch, layout.dtype)).view(shape).clone()


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype.itemsize == 2 else torch.int32)


def enter_network_namespace(name: str) -> None:
    """Move this (still single-threaded) process into namespace ``name``, as ``ip netns
    exec`` does: setns(2), then a private mount namespace with /sys mounted afresh, since
    sysfs shows the interfaces of the namespace it was mounted in (UCX lists them there)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), f"{what} failed entering {name}")

    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(_CLONE_NEWNS), "unshare")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", _MNT_DETACH), "umount /sys")
    check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount sysfs")


@dataclass(frozen=True)
class PullOutcome:
    """A pull as a peer process saw it (monotonic clock: the same in every process)."""

    submitted: float
    finished: float
    transport: str = ""
    mode: str = ""
    reason: str = ""  # the KvTransferError reason when it failed
    detail: str = ""


def _pull(consumer: Any, handle: KvHandle, remote: list[int], local: list[int],
          timeout: float) -> PullOutcome:
    submitted = time.monotonic()
    try:
        result = consumer.pull(handle, remote, local, timeout).result(timeout + 10)
    except KvTransferError as failure:
        return PullOutcome(submitted, time.monotonic(), reason=failure.reason,
                           detail=failure.detail)
    return PullOutcome(submitted, time.monotonic(), result.transport, result.mode)


def _serve(conn: Connection, peer: Any, cache: torch.Tensor) -> None:
    """Answer the test's commands until "stop"."""
    while True:
        command, args = conn.recv()
        try:
            if command == "pin":
                conn.send(peer.pin(*args))
            elif command == "release":
                conn.send(peer.release(*args))
            elif command == "pull":
                conn.send(_pull(peer, *args))
            elif command == "pull_until_failure":  # back to back; every outcome
                outcomes = [_pull(peer, *args)]
                while not outcomes[-1].reason:
                    outcomes.append(_pull(peer, *args))
                conn.send(outcomes)
            elif command == "blocks":
                conn.send(cache[args[0]].clone())
            elif command == "connections":
                conn.send(peer.num_connections)
            elif command == "stop":
                peer.close()
                conn.send(None)
                return
        except Exception as exc:  # report to the test instead of dying silently
            conn.send(exc)


def _peer_main(conn: Connection, netns: str | None, role: str, layout: KvLayout,
               num_blocks: int, seed: int, options: dict[str, Any]) -> None:
    if netns is not None:
        enter_network_namespace(netns)
    from kv_transfer.ucx_connector import UcxKvConsumer, UcxKvProducer

    cache = kv_pattern(layout, num_blocks, seed)
    try:
        peer: Any
        if role == "producer":
            peer = UcxKvProducer(cache, layout, engine_id=options.pop("engine_id", "prefill"),
                                 **options)
            conn.send(peer.start())
        else:
            peer = UcxKvConsumer(cache, layout, **options)
            conn.send(None)
    except Exception as exc:
        conn.send(exc)
        return
    _serve(conn, peer, cache)


class PeerProcess:
    """A spawned process hosting one UCX producer or consumer (``role``)."""

    def __init__(self, role: str, layout: KvLayout, num_blocks: int, seed: int,
                 netns: str | None = None, **options: Any):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_peer_main, args=(child, netns, role, layout, num_blocks, seed, options),
            daemon=True)
        self.process.start()
        self.killed_at = 0.0
        self.address: tuple[str, int] | None = self._answer("start", timeout=120)

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def _answer(self, what: str, timeout: float) -> Any:
        ready = mp_wait([self._conn, self.process.sentinel], timeout)
        if self._conn not in ready:
            raise TimeoutError(f"peer process gave no answer to {what}")
        answer = self._conn.recv()
        if isinstance(answer, Exception):
            raise answer
        return answer

    def call(self, command: str, *args: Any, timeout: float = 60) -> Any:
        self._conn.send((command, args))
        return self._answer(command, timeout)

    def send(self, command: str, *args: Any) -> None:
        """Start a command without waiting for its answer (``answer`` collects it)."""
        self._conn.send((command, args))

    def answer(self, timeout: float = 60) -> Any:
        return self._answer("the command", timeout)

    def pin(self, request_id: str, block_ids: list[int], lease: float = 60.0,
            num_tokens: int | None = None) -> KvHandle:
        tokens = len(block_ids) * 16 if num_tokens is None else num_tokens
        handle = self.call("pin", request_id, block_ids, tokens, lease)
        assert isinstance(handle, KvHandle)
        return handle

    def freeze(self) -> None:
        """SIGSTOP, returning once every thread has stopped."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while True:
            states = []
            for task in os.listdir(f"/proc/{self.pid}/task"):
                with open(f"/proc/{self.pid}/task/{task}/stat", encoding="ascii") as stat:
                    states.append(stat.read().rsplit(")", 1)[1].split()[0])
            if all(state in ("T", "t") for state in states):
                return
            assert time.monotonic() < deadline, f"process {self.pid} did not stop: {states}"
            time.sleep(0.01)

    def kill(self) -> float:
        """SIGKILL; the monotonic time it was sent (also kept as ``killed_at``)."""
        if self.process.is_alive():
            self.killed_at = time.monotonic()
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(10)
        return self.killed_at

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.call("stop", timeout=30)
            except (TimeoutError, OSError, EOFError):
                pass
        self.kill()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@contextmanager
def veth_namespace() -> Iterator[tuple[str, str, str]]:
    """A network namespace linked to this one by a veth pair: (name, our address, its
    address), from 198.19.0.0/16. Removed on exit, whatever happened."""
    tag = os.getpid() % 60000
    name, here, there = f"kvt{tag}", f"kvh{tag}", f"kvn{tag}"
    subnet = f"198.19.{tag % 250 + 1}"
    ours, theirs = f"{subnet}.1", f"{subnet}.2"
    try:
        _ip("netns", "add", name)
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", name)
        _ip("addr", "add", f"{ours}/24", "dev", here)
        _ip("link", "set", here, "up")
        for args in (("addr", "add", f"{theirs}/24", "dev", there), ("link", "set", there, "up"),
                     ("link", "set", "lo", "up")):
            _ip("netns", "exec", name, "ip", *args)
    except (OSError, subprocess.SubprocessError) as exc:
        _remove_namespace(name, here)
        detail = getattr(exc, "stderr", "") or exc
        pytest.fail(f"cannot create a network namespace with a veth pair (needs root and "
                    f"iproute2): {detail}")
    try:
        yield name, ours, theirs
    finally:
        _remove_namespace(name, here)


def _remove_namespace(name: str, link: str) -> None:
    _ip("netns", "del", name, check=False)  # takes its end of the veth pair, and so the pair
    _ip("link", "del", link, check=False)


def listening_addresses(pid: int) -> list[str]:
    """The local addresses of every TCP socket process ``pid`` listens on (in its own
    network namespace), as "ip:port"."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}", encoding="ascii") as lines:
            for line in lines.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found.append(_address_of(fields[1]))
    return found


def _address_of(field: str) -> str:
    """/proc/net/tcp's "0100007F:1F90" as "127.0.0.1:8080" (IPv6 in 4-byte words)."""
    hex_ip, hex_port = field.split(":")
    raw = bytes.fromhex(hex_ip)
    # Each 32-bit word is in host (little-endian) order.
    ordered = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(ordered)
    return f"{address}:{int(hex_port, 16)}"
