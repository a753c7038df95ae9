"""Gloo: Horovod's own rendezvous server, bound to one task's address, and the rank processes."""

from __future__ import annotations

import threading

from horovod.runner.common.util.hosts import SlotInfo
from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

from airflow_provider_horovod.runner.plan import Plan


class Rendezvous:
    """Horovod's ``RendezvousHTTPServer``, bound to ``host`` only (it has no authentication of its
    own, so it listens on the task's address and lives only as long as the task)."""

    def __init__(self, host: str) -> None:
        self._httpd = RendezvousHTTPServer((host, 0), RendezvousHandler, 0)
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hvdrunner-rendezvous", daemon=True)
        self._thread.start()

    def init(self, plan: Plan) -> None:
        self._httpd.init(
            [
                SlotInfo(
                    hostname=s.hostname,
                    rank=s.rank,
                    local_rank=s.local_rank,
                    cross_rank=s.cross_rank,
                    size=s.size,
                    local_size=s.local_size,
                    cross_size=s.cross_size,
                )
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
