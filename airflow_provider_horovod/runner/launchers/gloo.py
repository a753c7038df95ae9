"""``launcher="gloo"``: Horovod's own rendezvous server, bound to partition 0's address, and one
rank process per barrier task with the ``HOROVOD_*`` environment ``horovodrun --gloo`` gives.

Horovod's client sends no credential, but it builds its URL as ``http://<addr>:<port>/<scope>/<key>``
from ``HOROVOD_GLOO_RENDEZVOUS_ADDR`` as given. The ranks get ``<addr>:<port>/<token>`` there, so every
request's path starts with ``/<token>:<port>/``: a token derived from the run's secret, which the
server requires (``path_prefix``) and strips. A process that does not know it is answered 403.
"""

from __future__ import annotations

import hmac
import threading

from horovod.runner.common.util.hosts import SlotInfo
from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

from airflow_provider_horovod.runner import wire
from airflow_provider_horovod.runner.events import Failure
from airflow_provider_horovod.runner.launchers import Services
from airflow_provider_horovod.runner.launchers.processes import run_rank_processes
from airflow_provider_horovod.runner.names import TaskDir
from airflow_provider_horovod.runner.network import LOOPBACK
from airflow_provider_horovod.runner.plan import SLOT_INFO_FIELDS, Plan, Slot
from airflow_provider_horovod.runner.horovod_stall import stall_env


class _Handler(RendezvousHandler):
    """Horovod's handler (GET/PUT/DELETE of rendezvous keys) without what it inherits from
    ``SimpleHTTPRequestHandler``: no file is ever served, ``HEAD`` and other methods are refused."""

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
        self.send_status_code(405)

    def translate_path(self, path: str) -> str:
        return "/nonexistent"  # belt and braces: nothing on disk is reachable through this server

    def _admitted(self) -> bool:
        """Whether the path starts with the run's prefix (then stripped, for Horovod's handler); else 403."""
        prefix = self.server.path_prefix + "/"
        if hmac.compare_digest(self.path[: len(prefix)].encode(), prefix.encode()):
            self.path = self.path[len(prefix) - 1 :]
            return True
        self.server.refused += 1
        self.send_status_code(403)
        return False

    def do_GET(self) -> None:  # noqa: N802 - http.server's names
        if self._admitted():
            super().do_GET()

    def do_PUT(self) -> None:  # noqa: N802
        if self._admitted():
            super().do_PUT()

    def do_DELETE(self) -> None:  # noqa: N802
        if self._admitted():
            super().do_DELETE()


class _Server(RendezvousHTTPServer):
    """Answers only the plan's task addresses (the Gloo rendezvous has no authentication of its own)."""

    allowed: frozenset[str] = frozenset()
    refused = 0
    path_prefix = ""

    def verify_request(self, request, client_address) -> bool:
        if client_address[0] in self.allowed:
            return True
        self.refused += 1
        return False


class Rendezvous:
    """Horovod's ``RendezvousHTTPServer``, bound to ``host`` only, answering only the hosts of the
    plan once ``init`` has it (nobody before), and living only as long as the task."""

    def __init__(self, host: str, secret: bytes) -> None:
        self._httpd = _Server((host, 0), _Handler, 0)
        self.port: int = self._httpd.server_address[1]
        self._httpd.path_prefix = "/%s:%d" % (wire.rendezvous_token(secret), self.port)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hvdrunner-rendezvous", daemon=True)
        self._thread.start()

    @property
    def refused(self) -> int:
        return self._httpd.refused

    def init(self, plan: Plan) -> None:
        self._httpd.allowed = frozenset(s.address for s in plan.slots)
        self._httpd.init(
            [
                SlotInfo(**{name: getattr(s, name) for name in SLOT_INFO_FIELDS})
                for s in plan.slots
            ]
        )

    def stop(self) -> None:
        """Stop serving without waiting: ``shutdown()`` returns only when the serving loop next
        looks (every 0.5 s), and the task need not wait for that to return its rows."""

        def stop_now() -> None:
            self._httpd.shutdown()
            self._httpd.server_close()

        threading.Thread(target=stop_now, name="hvdrunner-rendezvous-stop", daemon=True).start()


# -- the launcher's interface (``launchers``) -------------------------------------------------------
class GlooServices(Services):
    """Partition 0 serves Horovod's rendezvous; the other tasks serve nothing."""

    def __init__(self, rendezvous: Rendezvous | None) -> None:
        self.rendezvous = rendezvous

    def ports(self) -> dict[str, int]:
        return {"rendezvous_port": self.rendezvous.port} if self.rendezvous else {}

    def expect(self, plan: Plan, partition: int) -> None:
        if self.rendezvous is not None:
            self.rendezvous.init(plan)

    def close(self) -> None:
        if self.rendezvous is not None:
            self.rendezvous.stop()


def serve(spec, partition: int, executor: str, address: str, task: TaskDir, env: dict[str, str],
          client) -> GlooServices:
    return GlooServices(Rendezvous(address, spec.secret) if partition == 0 else None)


def host_env(spec) -> dict[str, str]:
    return stall_env(spec.stall_timeout_s)


def warm_env(spec, env: dict[str, str], local_size: int) -> dict[str, str]:
    return {}


def missing_programs(path: str) -> tuple[str, ...]:
    return ()


def slot_env(spec, slot: Slot, rendezvous: tuple[str, int]) -> dict[str, str]:
    """What ``horovodrun --gloo`` gives a rank (``gloo_run.create_slot_env_vars``): who it is, and
    where Horovod's rendezvous server is. Horovod's client builds ``http://<ADDR>:<PORT>/<scope>/<key>``,
    so ``<addr>:<port>/<token>`` as ADDR puts the run's token first in every request's path (the
    server requires it, ``Rendezvous``)."""
    addr, port = rendezvous
    return {
        "HOROVOD_HOSTNAME": slot.hostname,
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "%s:%d/%s" % (addr, port, wire.rendezvous_token(spec.secret)),
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": slot.iface,
        "NCCL_SOCKET_IFNAME": slot.iface,
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(spec.gloo_timeout_s),
    }


def start(spec, plan: Plan, partition: int, task: TaskDir, env: dict[str, str], services: GlooServices,
          client) -> Failure | None:
    """This task's own rank, pointed at partition 0's rendezvous."""
    root = plan.slots[0]
    return run_rank_processes([plan.for_partition(partition)], env,
                              lambda slot: slot_env(spec, slot, (root.address, root.rendezvous_port)))


def start_local(spec, plan: Plan, task: TaskDir, env: dict[str, str]) -> Failure | None:
    rendezvous = Rendezvous(LOOPBACK, spec.secret)
    try:
        rendezvous.init(plan)
        return run_rank_processes(list(plan.slots), env, lambda slot: slot_env(spec, slot, (LOOPBACK, rendezvous.port)))
    finally:
        rendezvous.stop()
