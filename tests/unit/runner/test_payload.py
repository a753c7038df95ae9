from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading

import pytest

from airflow_provider_horovod.exceptions import PayloadError
from airflow_provider_horovod.runner.payload import build_payload, load_payload, resolve_callable


def test_reference_string_resolves_to_the_function():
    fn = resolve_callable("json:dumps")
    import json

    assert fn is json.dumps


@pytest.mark.parametrize(
    ("ref", "says"),
    [
        ("no_such_package_xyz.mod:fn", "Cannot import module 'no_such_package_xyz.mod'"),
        ("json:no_such_function", "has no attribute 'no_such_function'"),
        ("json", "'package.module:function'"),
        ("json:__doc__", "not a callable"),
    ],
)
def test_bad_reference_string_says_what_is_wrong(ref, says):
    with pytest.raises(PayloadError, match=says.replace("(", r"\(").replace(")", r"\)")):
        build_payload(ref)


def test_unpicklable_closure_is_named_before_anything_runs():
    lock = threading.Lock()

    def train():
        with lock:
            return 1

    with pytest.raises(PayloadError, match="closure variable 'lock'"):
        build_payload(train)


def test_unpicklable_kwarg_is_named():
    def train(handle):
        return handle

    with pytest.raises(PayloadError, match="keyword argument 'handle'"):
        build_payload(train, (), {"handle": threading.Lock()})


def test_function_from_a_non_installed_module_travels_by_value(tmp_path, monkeypatch):
    # A module that only the driver can import (a notebook, a DAG file): the payload must not
    # refer to it by name.
    (tmp_path / "only_on_driver_mod.py").write_text("def train(x):\n    return x * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import only_on_driver_mod

    data = build_payload(only_on_driver_mod.train, (), {"x": 21})
    assert b"only_on_driver_mod" in data  # the name is there as metadata...
    monkeypatch.delitem(__import__("sys").modules, "only_on_driver_mod")
    monkeypatch.syspath_prepend("/nonexistent")
    import sys

    sys.path.remove(str(tmp_path))
    fn, args, kwargs = load_payload(data)  # ...but loading it needs no import of the module
    assert fn(*args, **kwargs) == 42


def test_installed_function_travels_by_reference():
    import json

    fn, _, _ = load_payload(build_payload(json.dumps, ({"a": 1},)))
    assert fn is json.dumps


def test_arguments_that_do_not_fit_the_signature_fail_before_anything_runs():
    def train(lr, *, epochs=1):
        return lr, epochs

    with pytest.raises(PayloadError, match=r"do not fit the training function .*train\(lr, \*, epochs=1\): "
                                           r"too many positional arguments"):
        build_payload(train, (0.1, 2))
    with pytest.raises(PayloadError, match="unexpected keyword argument 'epoch'"):
        build_payload(train, (0.1,), {"epoch": 2})
    assert load_payload(build_payload(train, (0.1,), {"epochs": 2}))[2] == {"epochs": 2}


def test_a_rank_traceback_names_the_users_file_and_line_also_on_a_host_without_the_file(tmp_path):
    """As Airflow imports a DAG file (under a mangled module name), so it is pickled by value; the
    rank's host here has no such file (it was moved away), and the traceback still shows it."""
    dag_file = tmp_path / "my_dag.py"
    dag_file.write_text("def train(x):\n    y = x + 1\n    raise ValueError('boom at %d' % y)\n")
    spec = importlib.util.spec_from_file_location("unusual_prefix_0123_my_dag", dag_file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        (tmp_path / "payload.pkl").write_bytes(build_payload(module.train, (1,)))
    finally:
        del sys.modules[spec.name]
    dag_file.rename(tmp_path / "elsewhere.py")
    rank = ("import traceback, sys\nfrom airflow_provider_horovod.runner.payload import load_payload\n"
            "fn, args, kwargs = load_payload(open(sys.argv[1], 'rb').read())\n"
            "try:\n    fn(*args, **kwargs)\nexcept ValueError:\n    traceback.print_exc()\n")
    out = subprocess.run([sys.executable, "-c", rank, str(tmp_path / "payload.pkl")], capture_output=True, text=True,
                         cwd="/", timeout=60).stderr
    assert 'File "%s", line 3, in train' % dag_file in out
    assert "raise ValueError('boom at %d' % y)" in out and "dynamic-code" not in out

