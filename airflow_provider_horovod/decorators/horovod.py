"""``@task.horovod``: the decorated function is the training function every Horovod rank runs.

.. code-block:: python

    @task.horovod(np=2, timeline=True, outlets=[model])
    def train(epochs: int):
        import horovod.torch as hvd

        hvd.init()
        ...
        return {"loss": loss}

    train(epochs=5)

The call's arguments (plain values or XComArgs) become ``op_args``/``op_kwargs``; every other
``HorovodRunnerOperator`` argument goes to the decorator. The function runs on the ranks, not in
the Airflow task, so it receives no Airflow context.

As with ``@task``, the task's ``return_value`` is what the function returned on rank 0 (unrolled
into one XCom per key with ``multiple_outputs=True``); a value that is not JSON is stored as
``result.pkl`` and the XCom holds ``{"artifact_uri", "type", "format"}``. The try's metadata has
its own XCom keys: ``horovod_artifacts_uri``, ``horovod_checkpoint_uri``, ``horovod_timeline_uri``,
``horovod_try_number``, ``horovod_duration_s``, ``horovod_metrics`` (rank 0's newest ``runtime.report``);
downstream, ``train(...)["horovod_checkpoint_uri"]``. ``mlflow_conn_id=`` and ``progress_interval=``
work here as on the operator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator, task_decorator_factory

from airflow_provider_horovod.operators.horovod import HorovodRunnerOperator

if TYPE_CHECKING:
    from airflow.sdk import Context


class _HorovodDecoratedOperator(DecoratedOperator, HorovodRunnerOperator):
    """``HorovodRunnerOperator`` whose ``training_callable`` is the decorated function."""

    custom_operator_name = "@task.horovod"
    template_fields: Sequence[str] = tuple(
        dict.fromkeys((*DecoratedOperator.template_fields, *HorovodRunnerOperator.template_fields))
    )
    template_fields_renderers = {**DecoratedOperator.template_fields_renderers, **HorovodRunnerOperator.template_fields_renderers}

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Sequence[Any] | None = None,
        op_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            kwargs_to_upstream={"training_callable": python_callable, "op_args": op_args, "op_kwargs": op_kwargs},
            python_callable=python_callable,
            op_args=op_args,
            op_kwargs=op_kwargs,
            **kwargs,
        )

    def execute(self, context: Context) -> Any:
        """Run the job; return the training function's value (the metadata has its own XCom keys)."""
        return super().execute(context)["result"]


def horovod_task(
    python_callable: Callable[..., Any] | None = None,
    multiple_outputs: bool | None = None,
    **kwargs: Any,
) -> TaskDecorator:
    """Wrap a training function into a ``HorovodRunnerOperator`` (``@task.horovod``).

    :param python_callable: the training function (set when used as ``@task.horovod`` without
        parentheses).
    :param multiple_outputs: unroll the returned dict into XComs, as for ``@task``.
    :param kwargs: any ``HorovodRunnerOperator`` argument (``np``, ``launcher``, ``timeline``, ...).
    """
    return task_decorator_factory(
        python_callable=python_callable,
        multiple_outputs=multiple_outputs,
        decorated_operator_class=_HorovodDecoratedOperator,
        **kwargs,
    )


__all__ = ["horovod_task"]
