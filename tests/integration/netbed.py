"""A multi-host test bed on one machine: one network namespace per host, joined by a bridge.

Each host has its own address in a private subnet, its loopback up and an interface named
differently from the others' (``enp0s3`` on the driver, ``eth0``, ``ens5``, ... on the workers),
as on real machines. Worker hosts also get a private ``/tmp`` (a mount namespace with its own
tmpfs, into which a checkout and virtualenv that lie under /tmp are bound) and a host name of
their own (a UTS namespace, with an ``/etc/hosts`` naming every host; ``NetBed(hostname=...)`` gives every
worker the same one, as containers called alike; ``NetBed(shm=...)`` a small ``/dev/shm``),
both held by a *keeper* process: no host reads another's files, the driver included, and no two
hosts look like one machine to Gloo or Open MPI. A host's
link can be shaped (``tc tbf``), and new TCP connections from a host to a range of the driver's
ports can be dropped (a firewall), both with ``tc``: netfilter is not available here.

``NetBed(loopback_names=True)`` is the bed of a Debian machine: each worker host's own name resolves
to ``127.0.1.1`` in its ``/etc/hosts`` (the other hosts' names to their addresses, as DNS would
give them), Spark's workers are started by host name, and only the JVMs (``jdk.net.hosts.file``)
resolve every name to its host's address, as Spark on such a machine ends up advertising it.

Every name carries the owner's pid and a random id (``hvdtb-<pid>-<id>-<host>``; links ``hv<id>...``),
so beds of concurrent test sessions never meet, and a bed whose owner died is swept by the next.
``NetBed.down()`` kills every process in the bed's namespaces and removes namespaces, links and
bridge; the pytest fixture calls it in ``finally``.

Root is required. ``NetBed.unavailable()`` says why a bed cannot be built here (for ``pytest.skip``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests import jvm
from tests.integration.cluster import stop_process_groups

PREFIX = "hvdtb"
_NETNS = re.compile(r"^%s-(\d+)-([0-9a-f]{6})-" % PREFIX)
WORKER_IFACES = ("eth0", "ens5", "enp7s0", "eth1")
DRIVER_IFACE = "enp0s3"
TMPFS_SIZE = "3g"


def shared_under_tmp() -> list[Path]:
    """The checkout and the virtualenv running it, where they lie under /tmp (outermost only): the
    folders every host must see although each worker host has a private /tmp."""
    tmp = Path("/tmp")
    wanted = sorted({p for p in (Path(__file__).resolve().parents[2], Path(sys.prefix).resolve())
                     if p.is_relative_to(tmp) and p != tmp})
    return [p for p in wanted if not any(p != q and p.is_relative_to(q) for q in wanted)]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@dataclasses.dataclass
class Host:
    """One machine of the bed."""

    name: str  # "driver", "a", "b", ...
    netns: str
    iface: str  # the interface's name inside the namespace
    address: str
    peer: str  # the veth end on the bridge, in the root namespace
    hostname: str = ""  # worker hosts: a name of their own (UTS namespace), resolved by their /etc/hosts
    shm: str = ""  # worker hosts: the size of a /dev/shm of their own ("64m"); "": the machine's
    keeper_pid: int = 0  # holds the host's namespaces (worker hosts); 0: the host shares the machine's files

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host: its network namespace, and its private files if it has them."""
        if self.keeper_pid:
            return ["nsenter", "-t", str(self.keeper_pid), "-m", "-n", "-u", "--", *argv]
        return ["nsenter", "--net=/run/netns/%s" % self.netns, "--", *argv]


class NetBed:
    """A driver host and ``workers`` worker hosts in network namespaces on one bridge."""

    def __init__(self, workers: int = 2, *, loopback_names: bool = False, hostname: str = "",
                 shm: dict[str, str] | None = None) -> None:
        """``hostname``: one name for every worker host (containers named alike; not with
        ``loopback_names``, whose workers are reached by name); ``shm``: a /dev/shm of its own, of
        that size, for each named worker host (``{"a": "64m"}``: Docker's default)."""
        if hostname and loopback_names:
            raise ValueError("a bed with loopback_names reaches its workers by name: they cannot share one")
        self.id = secrets.token_hex(3)
        self.loopback_names = loopback_names
        self.owner = os.getpid()
        self.subnet = "10.213.%d" % (int(self.id[:2], 16))  # bridges carry no address: subnets never clash
        self.bridge = "hv%sbr" % self.id
        names = ["driver"] + [chr(ord("a") + i) for i in range(workers)]
        self.hosts: dict[str, Host] = {}
        for i, name in enumerate(names):
            self.hosts[name] = Host(
                name=name, netns="%s-%d-%s-%s" % (PREFIX, self.owner, self.id, name),
                iface=DRIVER_IFACE if name == "driver" else WORKER_IFACES[i - 1],
                address="%s.%d" % (self.subnet, 10 + i), peer="hv%sh%d" % (self.id, i),
                hostname="" if name == "driver" else hostname or "%s-%s-%s" % (PREFIX, self.id, name),
                shm=(shm or {}).get(name, ""))
        self._keepers: list[subprocess.Popen] = []

    # -- what tests use ----------------------------------------------------------------------------
    @property
    def driver(self) -> Host:
        return self.hosts["driver"]

    @property
    def workers(self) -> list[Host]:
        return [h for name, h in self.hosts.items() if name != "driver"]

    def host_of(self, address: str) -> Host:
        return next(h for h in self.hosts.values() if h.address == address.rsplit(":", 1)[0])

    def popen(self, host: Host, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(host.argv(argv), **kwargs)

    def run(self, host: Host, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(host.argv(argv), **kwargs)

    def pids(self, host: Host) -> list[int]:
        """Every process in the host's network namespace."""
        out = _ip("netns", "pids", host.netns, check=False).stdout
        return [int(p) for p in out.split()]

    def processes(self, host: Host, *markers: str) -> list[str]:
        """``pid cmdline`` of the host's processes named like a marker (``orted``) or, for a dotted
        marker (a Python module), whose command line contains it."""
        found = []
        for pid in self.pids(host):
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                cmd = " ".join(proc.cmdline())
                if any((m in cmd) if "." in m else proc.name() == m for m in markers):
                    found.append("%d %s" % (pid, cmd))
        return found

    def kill_host(self, host: Host) -> int:
        """The machine is lost: SIGKILL every process on it at once. Returns how many there were."""
        pids = [p for p in self.pids(host) if p != host.keeper_pid]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def shape(self, host: Host, rate: str = "1gbit") -> None:
        """Shape what ``host`` sends to ``rate`` (a token bucket on its interface)."""
        self.unshape(host)
        burst = "1mb" if rate.endswith("gbit") else "256kb"
        _ip("netns", "exec", host.netns, "tc", "qdisc", "add", "dev", host.iface, "root", "tbf", "rate", rate,
            "burst", burst, "latency", "50ms")

    def unshape(self, host: Host) -> None:
        _ip("netns", "exec", host.netns, "tc", "qdisc", "del", "dev", host.iface, "root", check=False)

    def block_new_connections(self, host: Host, to: Host, port: int, mask: int) -> None:
        """Drop every TCP SYN that ``host`` sends to ``to`` on a port ``p`` with ``p & mask == port``
        (what a firewall in front of ``to`` does to ports it does not allow). Replies pass."""
        self.unshape(host)
        tc = ["netns", "exec", host.netns, "tc"]
        dev = ["dev", host.iface]
        _ip(*tc, "qdisc", "add", *dev, "root", "handle", "1:", "htb", "default", "10")
        _ip(*tc, "class", "add", *dev, "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit")  # everything else
        _ip(*tc, "class", "add", *dev, "parent", "1:", "classid", "1:30", "htb", "rate", "8kbit")
        _ip(*tc, "qdisc", "add", *dev, "parent", "1:30", "handle", "30:", "pfifo", "limit", "0")  # drops all it gets
        # TCP (no IP options: Linux sends none on a SYN): destination port at byte 22, flags at byte 33
        _ip(*tc, "filter", "add", *dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "dst", "%s/32" % to.address, "match", "ip", "protocol", "6", "0xff",
            "match", "u16", "0x%x" % port, "0x%x" % mask, "at", "22",
            "match", "u8", "0x02", "0x12", "at", "33",  # SYN without ACK: a new connection
            "flowid", "1:30")

    def set_port_range(self, host: Host, low: int, high: int) -> None:
        """The ports ``host`` hands out for ``bind(0)`` (and outgoing connections)."""
        _ip("netns", "exec", host.netns, "sysctl", "-q", "-w", "net.ipv4.ip_local_port_range=%d %d" % (low, high))

    # -- life --------------------------------------------------------------------------------------
    @staticmethod
    def unavailable() -> str | None:
        """Why no bed can be built here, or None."""
        if os.geteuid() != 0:
            return "the network test bed needs root (network namespaces, veth, bridge)"
        missing = [p for p in ("ip", "tc", "nsenter", "unshare") if shutil.which(p) is None]
        if missing:
            return "the network test bed needs %s (iproute2, util-linux)" % " and ".join(missing)
        probe = "%s-probe-%d" % (PREFIX, os.getpid())
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return "the kernel refused a network namespace: %s" % made.stderr.strip()
        try:
            veth = _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False)
            if veth.returncode != 0:
                return "the kernel refused a veth pair: %s" % veth.stderr.strip()
            mount = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--mount", "--propagation", "private",
                                    "mount", "-t", "tmpfs", "tmpfs", "/tmp"], capture_output=True, text=True)
            if mount.returncode != 0:
                return "the kernel refused a private mount namespace: %s" % mount.stderr.strip()
        finally:
            _ip("netns", "del", probe, check=False)
        return None

    def up(self) -> NetBed:
        sweep()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            self.tmp_stash.mkdir()
            for i, host in enumerate(self.hosts.values()):
                _ip("netns", "add", host.netns)
                tmp = "hv%sp%d" % (self.id, i)
                _ip("link", "add", host.peer, "type", "veth", "peer", "name", tmp)
                _ip("link", "set", tmp, "netns", host.netns)
                _ip("link", "set", host.peer, "master", self.bridge, "up")
                _ip("-n", host.netns, "link", "set", tmp, "name", host.iface)
                _ip("-n", host.netns, "addr", "add", "%s/24" % host.address, "dev", host.iface)
                _ip("-n", host.netns, "link", "set", host.iface, "up")
                _ip("-n", host.netns, "link", "set", "lo", "up")
                if host.name != "driver":
                    host.keeper_pid = self._keep_private_tmp(host)
            if self.loopback_names:  # the driver host keeps the machine's name
                names = [("127.0.0.1", "localhost"), (self.driver.address, socket.gethostname())]
                names += [(h.address, h.hostname) for h in self.workers]
                self.jvm_hosts_file.write_text("".join("%s %s\n" % pair for pair in names))
        except BaseException:
            self.down()
            raise
        return self

    @property
    def jvm_hosts_file(self) -> Path:
        """Every host's name and address, for the JVMs (``-Djdk.net.hosts.file``); outside ``/tmp``,
        which each worker host has its own of."""
        return Path("/dev/shm/%s-%d-%s-jvm-hosts" % (PREFIX, self.owner, self.id))

    @property
    def tmp_stash(self) -> Path:
        """An empty folder outside /tmp where each worker host fills its private /tmp (in its own mount
        namespace) before moving it onto /tmp."""
        return Path("/dev/shm/%s-%d-%s-tmp" % (PREFIX, self.owner, self.id))

    def jvm_options(self) -> str:
        """``JAVA_TOOL_OPTIONS`` of the bed's JVMs under ``loopback_names``: names resolve to addresses."""
        return "-Djdk.net.hosts.file=%s" % self.jvm_hosts_file

    def etc_hosts(self, host: Host) -> str:
        """The ``/etc/hosts`` of a worker host: every host's name to its address or, with
        ``loopback_names``, its own name to ``127.0.1.1`` (Debian's default line)."""
        own = "127.0.1.1 %s\n" % host.hostname if self.loopback_names else ""
        return "127.0.0.1 localhost\n::1 localhost\n" + own + "".join(
            "%s %s\n" % (h.address, h.hostname) for h in self.hosts.values()
            if h.hostname and not (self.loopback_names and h is host))

    def _keep_private_tmp(self, host: Host) -> int:
        """A process that holds the host's own namespaces: files (a tmpfs of its own on /tmp, with the
        checkout and its virtualenv bound in where they lie under /tmp) and host name (Gloo and Open MPI
        take ranks with the same host name for neighbours on one machine: shared memory, loopback), with
        an /etc/hosts that resolves the bed's hosts (``etc_hosts``). The tmpfs is filled on ``tmp_stash``
        while the machine's /tmp is still visible to the bindings, then moved onto /tmp."""
        script = ('hostname "$1" && mount -t tmpfs -o size=%s,mode=1777 hvdtb "$3" '
                  '&& for p in "${@:4}"; do mkdir -p "$3${p#/tmp}" && mount --bind "$p" "$3${p#/tmp}" || exit 1; done '
                  '&& mount --move "$3" /tmp && printf "%%s" "$2" > /tmp/.hosts '
                  '&& mount --bind /tmp/.hosts /etc/hosts '
                  '&& { [ -z "$HVDTB_SHM" ] || mount -t tmpfs -o size="$HVDTB_SHM",mode=1777 hvdshm /dev/shm; } '
                  '&& echo ready && exec sleep 1000000' % TMPFS_SIZE)
        keeper = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, "unshare", "--mount", "--uts", "--propagation", "private", "--",
             "bash", "-c", script, "keeper", host.hostname, self.etc_hosts(host), str(self.tmp_stash),
             *map(str, shared_under_tmp())], env={**os.environ, "HVDTB_SHM": host.shm},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._keepers.append(keeper)
        line = keeper.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError("host %s: no private /tmp: %s %s" % (host.name, line, keeper.stdout.read()))
        return keeper.pid

    def down(self) -> None:
        """Kill every process in the bed, remove its namespaces, links and bridge. Never raises."""
        for host in self.hosts.values():
            _kill_all_in(host.netns)
        for keeper in self._keepers:
            with contextlib.suppress(Exception):
                keeper.kill()
                keeper.wait(5)
        for host in self.hosts.values():
            _ip("netns", "del", host.netns, check=False)
            _ip("link", "del", host.peer, check=False)
        _ip("link", "del", self.bridge, check=False)
        self.jvm_hosts_file.unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.tmp_stash.rmdir()

    def leftovers(self) -> list[str]:
        """What of this bed is still on the machine (namespaces, links): empty after ``down()``."""
        ns = _ip("netns", "list", check=False).stdout
        links = _ip("-br", "link", check=False).stdout
        return [n.split()[0] for n in ns.splitlines() if self.id in n] + \
               [l.split()[0] for l in links.splitlines() if ("hv%s" % self.id) in l]

    # -- a bed described to another process (the driver's scenario runs in the driver namespace) ---
    def to_json(self) -> str:
        return json.dumps({"id": self.id, "owner": self.owner, "subnet": self.subnet, "bridge": self.bridge,
                           "loopback_names": self.loopback_names,
                           "hosts": [dataclasses.asdict(h) for h in self.hosts.values()]})

    @classmethod
    def from_json(cls, text: str) -> NetBed:
        raw = json.loads(text)
        bed = cls.__new__(cls)
        bed.id, bed.owner, bed.subnet, bed.bridge = raw["id"], raw["owner"], raw["subnet"], raw["bridge"]
        bed.loopback_names = raw["loopback_names"]
        bed.hosts = {h["name"]: Host(**h) for h in raw["hosts"]}
        bed._keepers = []
        return bed


def _kill_all_in(netns: str) -> None:
    for _ in range(20):
        pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def sweep() -> list[str]:
    """Remove beds whose owning process is gone (a test session killed before its teardown)."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        found = _NETNS.match(name)
        if found is None or psutil.pid_exists(int(found.group(1))):
            continue
        _kill_all_in(name)
        _ip("netns", "del", name, check=False)
        removed.append(name)
        bed_id = found.group(2)
        Path("/dev/shm/%s-%s-%s-jvm-hosts" % (PREFIX, found.group(1), bed_id)).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            Path("/dev/shm/%s-%s-%s-tmp" % (PREFIX, found.group(1), bed_id)).rmdir()
        for link in _ip("-br", "link", check=False).stdout.splitlines():
            link_name = link.split()[0].split("@")[0]
            if link_name.startswith("hv%s" % bed_id):
                _ip("link", "del", link_name, check=False)
    return removed


class BedCluster:
    """Spark standalone on the bed: the master on the driver host, one worker per worker host, each
    bound to its host's address, with its work dir in the host's private /tmp."""

    def __init__(self, bed: NetBed, logs: Path, cores: int = 2, master_port: int = 7077) -> None:
        import pyspark

        self.bed = bed
        self.logs = logs
        self.cores = cores
        self.spark_home = Path(pyspark.__file__).parent
        self.master = "spark://%s:%d" % (bed.driver.address, master_port)
        self._master_port = master_port
        self.procs: list[subprocess.Popen] = []

    def _env(self, host: Host) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"SPARK_HOME": str(self.spark_home), "SPARK_LOCAL_IP": host.address, "SPARK_NO_DAEMONIZE": "1",
                    "PYSPARK_PYTHON": sys.executable, "SPARK_WORKER_OPTS": "", "SPARK_LOG_DIR": "/tmp/spark-logs"})
        env.pop("SPARK_CONF_DIR", None)
        if self.bed.loopback_names:
            env["JAVA_TOOL_OPTIONS"] = self.bed.jvm_options()
        return env

    def _start(self, host: Host, args: list[str], name: str) -> None:
        with (self.logs / ("%s.log" % name)).open("wb") as log:
            self.procs.append(self.bed.popen(host, [str(self.spark_home / "bin" / "spark-class"), *args],
                                             env=self._env(host), stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True))

    def start(self) -> BedCluster:
        d = self.bed.driver
        self._start(d, ["org.apache.spark.deploy.master.Master", "--host", d.address, "--port", str(self._master_port),
                        "--webui-port", "8080"], "master")
        for host in self.bed.workers:
            self.start_worker(host)
        self.wait_for_workers(len(self.bed.workers))
        return self

    def start_worker(self, host: Host) -> None:
        name = host.hostname if self.bed.loopback_names else host.address  # executors are named as their worker
        self._start(host, ["org.apache.spark.deploy.worker.Worker", self.master, "--host", name,
                           "--cores", str(self.cores), "--memory", "1g", "--webui-port", "8081",
                           "--work-dir", "/tmp/spark-work"], "worker-%s" % host.name)

    def wait_for_workers(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        log = self.logs / "master.log"
        while time.monotonic() < deadline:
            if log.exists() and log.read_text(errors="replace").count("Registering worker") >= n:
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.5)
        raise RuntimeError("the bed's Spark cluster did not come up; see the logs in %s" % self.logs)

    def app_conf(self) -> dict[str, str]:
        """What an application on the bed needs: executors of ``cores`` cores, the driver on its host."""
        return {
            **jvm.executor_conf(),
            "spark.driver.host": self.bed.driver.address,
            "spark.driver.bindAddress": self.bed.driver.address,
            "spark.driver.port": "7078",
            "spark.driver.blockManager.port": "7079",
            "spark.executor.cores": str(self.cores),
            "spark.executor.memory": "640m",
            "spark.cores.max": str(self.cores * len(self.bed.workers)),
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
        }

    def run_scenarios(self, out: Path, runs: list[str], timeout: float) -> dict:
        """The driver's side of ``runs`` (``scenarios/bed_runs.py``) in the driver's namespace: what each showed."""
        root = Path(__file__).resolve().parents[2]
        env = dict(os.environ, PYTHONPATH=str(root), SPARK_LOCAL_IP=self.bed.driver.address)
        if self.bed.loopback_names:
            env["JAVA_TOOL_OPTIONS"] = self.bed.jvm_options()
        argv = [sys.executable, "-m", "tests.integration.scenarios.bed_runs", self.bed.to_json(), self.master,
                json.dumps(self.app_conf()), str(out), *runs]
        proc = self.bed.popen(self.bed.driver, argv, cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert out.exists(), output[-5000:]
        runs_seen = json.loads(out.read_text())
        runs_seen["_output"] = output
        return runs_seen

    def stop(self) -> None:
        stop_process_groups(self.procs)
