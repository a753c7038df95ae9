"""Where a barrier task is reached: the source address of its connection to the driver, never its host name."""

from __future__ import annotations

import socket

from airflow_provider_horovod.runner.network import endpoint_of, source_address, task_endpoint


def test_a_task_is_reached_at_the_address_its_driver_connection_leaves_from(monkeypatch):
    # Debian's "127.0.1.1 <hostname>": a name that resolves to loopback must never be the address
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        conn = socket.create_connection(listener.getsockname())
        try:
            endpoint = task_endpoint(source_address(conn), "worker-a.example:41234")
        finally:
            conn.close()
    finally:
        listener.close()
    assert (endpoint.address, endpoint.iface, endpoint.network) == ("127.0.0.1", "lo", "127.0.0.0/8")


def test_without_a_driver_connection_the_executor_address_spark_reports_is_used():
    endpoint = task_endpoint(None, "127.0.0.1:41234")
    assert (endpoint.address, endpoint.iface) == ("127.0.0.1", "lo")


def test_an_address_no_interface_holds_has_no_interface_and_no_network():
    endpoint = endpoint_of("192.0.2.77")  # TEST-NET-1
    assert (endpoint.iface, endpoint.network) == ("", "")
