"""Simulated hosts on one Linux machine: network namespaces with an SSH server each.

Each host is a network namespace with two links, as a small cluster of Macs has:

- a management link (a veth pair to the machine, addresses ``10.213.<4n+i>.1`` here and
  ``10.213.<4n+i>.2`` in the host) that SSH uses;
- a data link (a veth into a bridge shared by the hosts, ``10.214.<n>.<i+1>``) that the ranks'
  ring connections use. ``link_down(i)`` takes host ``i``'s data link down, as an unplugged
  cable. With ``link="relay"`` a relay (``tests/linkrelay.py``) takes the bridge's place, and
  ``set_link(delay_ms, loss)`` sets the data links' latency and packet loss (the kernels this
  runs on may lack ``tc netem``, so the relay does it in user space).

``n`` is a network slot this fixture holds (a lock under /run) while it lives, so fixtures in
concurrent test workers never share addresses.

Each host's SSH server runs in a mount namespace of its own with a private tmpfs at
``private_dir``: what ranks write there is on that host only, as with separate machines (the
harness's checkout and Python are shared, as an identical install on each Mac would be). The
SSH key pair and host key are made for the fixture in a root-only directory and removed with it;
nothing is written to ``~/.ssh``. Needs root, ``ip`` (iproute2), ``sshd`` (openssh-server) and
``ssh`` (openssh-client); ``unavailable()`` says what is missing.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SSHD = "/usr/sbin/sshd"
MAX_SLOTS = 60  # 4 management subnets each in 10.213.0-239
PACKAGES = "openssh-server openssh-client iproute2"
HERE = Path(__file__).resolve().parent
# ethtool -K IFACE tx off, without ethtool: a veth leaves TCP checksums to the receiving end's
# kernel, which a frame forwarded from user space no longer reaches as such.
TX_CHECKSUM_OFF = """
import ctypes, fcntl, socket, struct, sys
value = ctypes.create_string_buffer(struct.pack("II", 0x17, 0), 8)  # ETHTOOL_STXCSUM, off
request = struct.pack("16sP", sys.argv[1].encode(), ctypes.addressof(value))
fcntl.ioctl(socket.socket(), 0x8946, request)  # SIOCETHTOOL
"""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why simulated hosts cannot be made here, or ``None``."""
    if not sys.platform.startswith("linux"):
        return "simulated hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, veth links, an SSH server per host)"
    missing = [tool for tool, path in (("ip", shutil.which("ip")), ("sshd", SSHD if os.path.exists(SSHD) else None),
                                       ("ssh", shutil.which("ssh")), ("ssh-keygen", shutil.which("ssh-keygen")),
                                       ("unshare", shutil.which("unshare"))) if not path]
    if missing:
        return f"simulated hosts need {', '.join(missing)} (Debian packages: {PACKAGES}, util-linux)"
    probe = f"mxprobe{secrets.token_hex(3)}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def has_netem() -> bool:
    """Whether the kernel has the netem queueing discipline (delay, loss)."""
    probe = f"mxnetem{secrets.token_hex(2)}"
    _run("ip", "link", "add", probe, "type", "dummy", check=False)
    try:
        return _run("tc", "qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms", check=False).returncode == 0
    finally:
        _run("ip", "link", "del", probe, check=False)


@dataclass
class SimHost:
    index: int
    netns: str
    ssh_addr: str  # management link, for SSH
    data_addr: str  # data link, for the ranks
    root_data_if: str  # the data link's end on the machine's side
    sshd: subprocess.Popen | None = None


def _orphan_pidfile(p: Path, since: float) -> bool:
    """Whether ``p`` is an mlx.launch pidfile made since ``since`` whose rank has ended."""
    try:
        text = p.read_text().strip()
        if not (p.is_file() and p.stat().st_mtime >= since and text.isdigit()):
            return False
        os.kill(int(text), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError):
        return False  # gone, unreadable, or a live process of another user
    return False


@dataclass
class SimHosts:
    """``count`` simulated hosts; use as a context manager."""

    count: int = 2
    token: str = field(default_factory=lambda: secrets.token_hex(3))
    hosts: list[SimHost] = field(default_factory=list)
    workdir: Path | None = None
    relay: subprocess.Popen | None = None
    link: str = "bridge"  # "bridge" (the kernel's) or "relay" (latency and loss, ``linkrelay``)
    slot: int = -1
    started: float = 0.0  # time.time() when the hosts were made
    _slot_file: Any = None

    @property
    def bridge(self) -> str:
        return f"mxb{self.token}"

    @property
    def private_dir(self) -> str:
        """A directory each host has privately (a tmpfs of its own); empty on the machine."""
        return f"/mnt/mxh-{self.token}"

    def __enter__(self) -> SimHosts:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _take_slot(self) -> None:
        for n in range(MAX_SLOTS):
            f = open(f"/run/mxh-net-{n}.lock", "a")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            self.slot, self._slot_file = n, f
            return
        raise RuntimeError(f"all {MAX_SLOTS} network slots for simulated hosts are in use")

    def _start(self) -> None:
        if self.count > 4:
            raise ValueError("at most 4 simulated hosts")
        self._take_slot()
        self.started = time.time() - 1
        where = "/run" if os.path.isdir("/run") else None  # outside /tmp, which tests may use freely
        self.workdir = Path(tempfile.mkdtemp(prefix=f"mxh-{self.token}-", dir=where))
        os.chmod(self.workdir, 0o700)
        os.makedirs(self.private_dir, exist_ok=True)
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        key = self.workdir / "id_ed25519"
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.workdir / "host_key"))
        (self.workdir / "authorized_keys").write_text((self.workdir / "id_ed25519.pub").read_text())
        self._write_ssh_wrapper(key)
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        for i in range(self.count):
            ns = f"mxh{self.token}{i}"
            m = 4 * self.slot + i
            h = SimHost(i, ns, f"10.213.{m}.2", f"10.214.{self.slot}.{i + 1}", f"mxd{self.token}{i}")
            self.hosts.append(h)
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            mgmt = f"mxm{self.token}{i}"
            _run("ip", "link", "add", mgmt, "type", "veth", "peer", "name", "mgmt0", "netns", ns)
            _run("ip", "addr", "add", f"10.213.{m}.1/24", "dev", mgmt)
            _run("ip", "link", "set", mgmt, "up")
            _run("ip", "-n", ns, "addr", "add", f"{h.ssh_addr}/24", "dev", "mgmt0")
            _run("ip", "-n", ns, "link", "set", "mgmt0", "up")
            _run("ip", "link", "add", h.root_data_if, "type", "veth", "peer", "name", "data0", "netns", ns)
            if self.link == "bridge":
                _run("ip", "link", "set", h.root_data_if, "master", self.bridge)
            else:  # frames go through the relay as they are: complete checksums, none above the MTU
                _run("ip", "-n", ns, "link", "set", "data0", "gso_max_size", "1500")
                _run("ip", "netns", "exec", ns, sys.executable, "-c", TX_CHECKSUM_OFF, "data0")
            _run("ip", "link", "set", h.root_data_if, "up")
            _run("ip", "-n", ns, "addr", "add", f"{h.data_addr}/24", "dev", "data0")
            _run("ip", "-n", ns, "link", "set", "data0", "up")
            h.sshd = self._start_sshd(h)
        if self.link == "relay":
            self.set_link()
            self.relay = subprocess.Popen([sys.executable, str(HERE / "linkrelay.py"), str(self.workdir / "link.json"),
                                           *(h.root_data_if for h in self.hosts)], stdin=subprocess.DEVNULL)
        for h in self.hosts:
            self._wait_ssh(h)

    def _write_ssh_wrapper(self, key: Path) -> None:
        assert self.workdir is not None
        config = self.workdir / "ssh_config"
        config.write_text(
            f"Host 10.213.*\n  IdentityFile {key}\n  IdentitiesOnly yes\n  StrictHostKeyChecking no\n"
            f"  UserKnownHostsFile /dev/null\n  LogLevel QUIET\n  BatchMode yes\n  ConnectTimeout 5\n"
        )
        bindir = self.workdir / "bin"
        bindir.mkdir()
        wrapper = bindir / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {config} "$@"\n')
        wrapper.chmod(0o755)

    @property
    def path_env(self) -> dict[str, str]:
        """Environment in which ``ssh`` reaches the hosts (the wrapper first on PATH)."""
        assert self.workdir is not None
        return {**os.environ, "PATH": f"{self.workdir / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}

    def _start_sshd(self, h: SimHost) -> subprocess.Popen:
        assert self.workdir is not None
        sshd = [SSHD, "-D", "-e", "-f", "/dev/null",
                "-o", f"ListenAddress={h.ssh_addr}", "-o", f"HostKey={self.workdir / 'host_key'}",
                "-o", "PidFile=none", "-o", f"AuthorizedKeysFile={self.workdir / 'authorized_keys'}",
                "-o", "StrictModes=no", "-o", "PasswordAuthentication=no", "-o", "KbdInteractiveAuthentication=no",
                "-o", "UsePAM=no", "-o", "PermitRootLogin=prohibit-password", "-o", "MaxStartups=100",
                "-o", "MaxSessions=100"]
        script = f'mount -t tmpfs -o mode=0700 mxh {self.private_dir} && exec "$@"'
        log = open(self.workdir / f"sshd{h.index}.log", "wb")
        return subprocess.Popen(["ip", "netns", "exec", h.netns, "unshare", "--mount", "--propagation", "private",
                                 "/bin/sh", "-c", script, "sh", *sshd],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_ssh(self, h: SimHost, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            r = subprocess.run(["ssh", h.ssh_addr, "true"], env=self.path_env, capture_output=True, text=True,
                               stdin=subprocess.DEVNULL)
            if r.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"simulated host {h.index} ({h.ssh_addr}) did not answer over SSH: {r.stderr}")
            time.sleep(0.1)

    def ssh(self, i: int, command: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run ``command`` on host ``i`` over SSH."""
        return subprocess.run(["ssh", self.hosts[i].ssh_addr, command], env=self.path_env, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=timeout)

    def hostfile(self, path: Path, ranks_per_host: int = 1) -> Path:
        """An mlx.launch hostfile of the hosts (``ranks_per_host`` entries each)."""
        hosts = [{"ssh": h.ssh_addr, "ips": [h.data_addr]} for h in self.hosts for _ in range(ranks_per_host)]
        path.write_text(json.dumps(hosts, indent=1) + "\n")
        return path

    def set_link(self, delay_ms: float = 0.0, loss: float = 0.0, seed: int = 0) -> None:
        """The relayed data link's one-way latency and packet loss (``link="relay"``)."""
        assert self.workdir is not None
        path = self.workdir / "link.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"delay_ms": delay_ms, "loss": loss, "seed": seed}))
        os.replace(tmp, path)
        t = time.time()
        os.utime(path, (t, t))

    def link_down(self, i: int) -> None:
        _run("ip", "link", "set", self.hosts[i].root_data_if, "down")

    def link_up(self, i: int) -> None:
        _run("ip", "link", "set", self.hosts[i].root_data_if, "up")

    def shared_leftovers(self, i: int) -> list[str]:
        """What host ``i`` left where the machine's files are visible to it (its /tmp is the
        machine's): its port lease directory (named after its network namespace), and files of
        mlx.launch's remote launches (``tmp.*`` in /tmp) made since the hosts started."""
        ino = os.stat(f"/run/netns/{self.hosts[i].netns}").st_ino
        out = [str(p) for p in Path("/tmp").glob(f"mlx-ddp-harness-ports-*-net{ino}")]
        # A pidfile names its rank. One whose rank lives, or that goes within moments of its rank,
        # belongs to a launch in flight or ending: another set of hosts' (another test process's)
        # where this set's ranks are gone (``processes``).
        pidfiles = [p for p in Path("/tmp").glob("tmp.*") if _orphan_pidfile(p, self.started)]
        if pidfiles:
            time.sleep(3)
            pidfiles = [p for p in pidfiles if _orphan_pidfile(p, self.started)]
        return out + [str(p) for p in pidfiles]

    def processes(self, i: int) -> list[str]:
        """Command lines of the processes in host ``i``'s namespace other than its SSH server."""
        pids = _run("ip", "netns", "pids", self.hosts[i].netns, check=False).stdout.split()
        out = []
        for pid in pids:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            if SSHD not in cmd and "unshare" not in cmd:
                out.append(f"{pid} {cmd}")
        return out

    def stop(self) -> None:
        """Kill everything in the hosts, remove the namespaces, links, keys and mount points."""
        for h in self.hosts:
            for pid in _run("ip", "netns", "pids", h.netns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            if h.sshd is not None:
                h.sshd.wait(timeout=10)
            _run("ip", "netns", "del", h.netns, check=False)
            _run("ip", "link", "del", h.root_data_if, check=False)
            _run("ip", "link", "del", f"mxm{self.token}{h.index}", check=False)
        self.hosts = []
        if self.relay is not None:
            self.relay.kill()
            self.relay.wait()
        _run("ip", "link", "del", self.bridge, check=False)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if os.path.isdir(self.private_dir):
            try:
                os.rmdir(self.private_dir)
            except OSError:
                pass
        if self._slot_file is not None:
            self._slot_file.close()  # the slot is free again
            self._slot_file = None
