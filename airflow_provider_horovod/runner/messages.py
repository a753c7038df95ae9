"""The messages between processes, one frozen dataclass each: typed fields, ``to_json`` for the
wire, ``from_json`` that turns anything malformed into a ``wire.ProtocolError``."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

from airflow_provider_horovod.runner import names
from airflow_provider_horovod.runner.wire import ProtocolError

MAX_METRICS = 64  # names per report: a report is a handful of numbers, never a tensor's worth
MAX_NAME_CHARS = 100


@dataclasses.dataclass(frozen=True)
class Report:
    """Rank 0's progress (``runtime.report``): the step, the steps in all, named numbers, when."""

    time: float
    step: int | None = None
    total_steps: int | None = None
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def make(cls, time: float, step: Any, total_steps: Any, metrics: Mapping[str, Any]) -> Report:
        """A report from what training code passed; ``TypeError``/``ValueError`` that says what to pass."""
        return cls(time=float(time), step=_count("step", step), total_steps=_count("total_steps", total_steps),
                   metrics=_numbers(metrics))

    def to_json(self) -> dict[str, Any]:
        return {"t": names.MSG_REPORT, "time": self.time, "step": self.step, "total_steps": self.total_steps,
                "metrics": dict(self.metrics)}

    @classmethod
    def from_json(cls, raw: Any) -> Report:
        if not isinstance(raw, Mapping) or not isinstance(raw.get("metrics"), Mapping):
            raise ProtocolError("a report without a metrics object")
        when = raw.get("time")
        if isinstance(when, bool) or not isinstance(when, (int, float)):
            raise ProtocolError("a report without a time")
        try:
            return cls.make(when, raw.get("step"), raw.get("total_steps"), raw["metrics"])
        except (TypeError, ValueError) as err:
            raise ProtocolError("a malformed report: %s" % err) from None


def _count(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise TypeError("runtime.report(%s=...) takes an int >= 0 or None; got %r" % (name, value))
    return int(value)


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    if len(metrics) > MAX_METRICS:
        raise ValueError("runtime.report takes at most %d metrics; got %d" % (MAX_METRICS, len(metrics)))
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key or len(key) > MAX_NAME_CHARS:
            raise ValueError("a metric's name must be a non-empty str of at most %d characters; got %r"
                             % (MAX_NAME_CHARS, key))
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError("runtime.report(%s=...) takes a number (int or float; call .item() on a tensor); got a %s"
                            % (key, type(value).__qualname__))
        number = float(value)
        if not math.isfinite(number):
            raise ValueError("runtime.report(%s=...) got %r; report finite numbers" % (key, number))
        out[key] = number
    return out
