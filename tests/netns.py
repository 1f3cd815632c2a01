"""Hosts on one machine: Linux network namespaces joined by veth pairs on a bridge.

Each ``Host`` is a network namespace with its own loopback and one address on a private
subnet from the benchmarking range (198.18.0.0/15), so that a process that advertises
``127.0.0.1`` or binds loopback is unreachable from the others, as on separate machines. The
bridge lives in the test's own namespace with the subnet's first address, so the test reaches
every host as a client outside the cluster would. Names resolve per host through
``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts`` (how a
test stands in for cluster DNS). ``HostLab.close`` kills every process started in a host and
deletes every namespace, link and hosts file it made, failure or not; a lab left behind by a
killed test run is removed when the next one starts.

Needs root (CAP_NET_ADMIN) and iproute2; ``HostLab`` raises ``NetnsUnavailable`` saying why
otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "tnl"  # interface names hold 15 characters: tnl<pid>v<n>p fits
NETNS_ETC = Path("/etc/netns")


class NetnsUnavailable(RuntimeError):
    """This machine cannot make network namespaces for the test (the message says why)."""


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(["-n", netns] if netns else []), *args]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise NetnsUnavailable(f"`{' '.join(command)}` failed: {result.stderr.strip()}")


@dataclass
class Host:
    name: str
    netns: str
    address: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], log: Path,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """Run ``argv`` inside this host (its own session, output to ``log``)."""
        with open(log, "ab") as out:
            process = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, *argv], stdout=out,
                stderr=subprocess.STDOUT, env=dict(env), cwd=cwd, start_new_session=True)
        self.processes.append(process)
        return process

    def cut_off(self, address: str, cut: bool = True) -> None:
        """Make ``address`` unreachable from this host (a network partition between two
        hosts; others still reach both), or reachable again."""
        _ip("route", "add" if cut else "del", "unreachable", f"{address}/32", netns=self.netns)

    def kill(self) -> None:
        """SIGKILL every process started here (a pod's container killed)."""
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


class HostLab:
    """A bridge and its hosts; a context manager that always cleans up."""

    def __init__(self, subnet: str = "198.18.7") -> None:
        if shutil.which("ip") is None:
            raise NetnsUnavailable("iproute2's `ip` is not installed")
        if os.geteuid() != 0:
            raise NetnsUnavailable("creating network namespaces needs root (CAP_NET_ADMIN)")
        remove_stale_labs()
        self.tag = f"{PREFIX}{os.getpid()}"
        self.subnet = subnet
        self.bridge = f"{self.tag}br"
        self.hosts: dict[str, Host] = {}
        _ip("link", "add", self.bridge, "type", "bridge")
        try:
            _ip("addr", "add", f"{subnet}.1/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> HostLab:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def add_host(self, name: str) -> Host:
        index = len(self.hosts) + 10
        netns = f"{self.tag}-{name}"
        host = Host(name, netns, f"{self.subnet}.{index}")
        self.hosts[name] = host
        outside, inside = f"{self.tag}v{index}", "eth0"
        _ip("netns", "add", netns)
        _ip("link", "add", outside, "type", "veth", "peer", "name", f"{outside}p")
        _ip("link", "set", f"{outside}p", "netns", netns)
        _ip("link", "set", f"{outside}p", "name", inside, netns=netns)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        _ip("addr", "add", f"{host.address}/24", "dev", inside, netns=netns)
        _ip("link", "set", inside, "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=netns)
        _ip("route", "add", "default", "via", f"{self.subnet}.1", netns=netns)
        return host

    def resolve(self, names: Mapping[str, Sequence[str]]) -> None:
        """Every host resolves each name to its addresses (a headless Service's records)."""
        lines = ["127.0.0.1 localhost"]
        lines += [f"{address} {name}" for name, addresses in names.items()
                  for address in addresses]
        for host in self.hosts.values():
            directory = NETNS_ETC / host.netns
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "hosts").write_text("\n".join(lines) + "\n")
            # A name it does not know fails at once, as a cluster's DNS answers: this
            # host's nameserver is unreachable from here, and each lookup would wait out
            # its timeouts (torch's store looks up its peers' names: 15 s each, measured).
            (directory / "resolv.conf").write_text(
                "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    def close(self) -> None:
        for host in self.hosts.values():
            host.kill()
        _remove_lab(self.tag)


def _remove_lab(tag: str) -> None:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        netns = line.split()[0] if line.split() else ""
        if netns.startswith(f"{tag}-"):
            _kill_namespace_processes(netns)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
            shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)
    ours = re.compile(rf"^{re.escape(tag)}(br|v\d+p?)$")
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if ours.match(name):
            subprocess.run(["ip", "link", "del", name], capture_output=True)


def _kill_namespace_processes(netns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
    for pid in pids.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def remove_stale_labs() -> None:
    """Labs of test runs that died without cleaning up (their pid is gone)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    tags = {line.split()[0].split("-")[0] for line in listed.splitlines()
            if re.match(rf"^{PREFIX}\d+-", line)}
    for tag in tags:
        pid = tag.removeprefix(PREFIX)
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _remove_lab(tag)
