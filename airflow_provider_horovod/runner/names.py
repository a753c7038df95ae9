"""Names the driver, the barrier tasks and the rank processes share, defined once.

Two contracts live here: the ``HVDRUNNER_*`` environment of a rank process and the layout of a
task folder (one per barrier task, or one for ``np < 0``). The messages on the channel are in
``messages.py``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from airflow_provider_horovod.runner.launchers import never_from_driver, rank_names

# -- the environment of every rank process ------------------------------------------------------
ENV_PLAN = "HVDRUNNER_PLAN"  # path of the plan (JSON) in the task folder
ENV_PAYLOAD = "HVDRUNNER_PAYLOAD"  # path of the cloudpickled function and its arguments
ENV_CHANNEL = "HVDRUNNER_CHANNEL"  # "host:port" of the driver's channel, "" when unreachable
ENV_VERBOSITY = "HVDRUNNER_VERBOSITY"  # "all" or "log_callback_only"
ENV_TIMELINE = "HVDRUNNER_TIMELINE"  # "1": every rank sets HOROVOD_TIMELINE, rank 0's comes back
ENV_HAS_RESUME = "HVDRUNNER_HAS_RESUME"  # "1": the host's first task fetched resume_from
ENV_RESUME_DIR = "HVDRUNNER_RESUME_DIR"  # where resume_from is on this host (runtime.resume_dir)
ENV_STALL_TIMEOUT = "HVDRUNNER_STALL_TIMEOUT"  # seconds: the rank's stall watch beats eight times per (rank/stacks.py)
ENV_STALL_WATCH = "HVDRUNNER_STALL_WATCH"  # "0" in env=: no stall watch, no stall rule (benchmarks/throughput.py --mode stall)
ENV_ATTEMPT = "HVDRUNNER_ATTEMPT"  # which attempt of the run this is: 0, then 1, ... after each restart
ENV_TASK_DIR = "HVDRUNNER_TASK_DIR"  # the rank's task folder (runtime.checkpoint_dir)
ENV_EXEC_SERVICES = "HVDRUNNER_EXEC_SERVICES"  # mpirun's rsh agent: {host: "addr:port"}
ENV_ARTIFACT_TRANSPORT = "HVDRUNNER_ARTIFACT_TRANSPORT"  # driver: "stream" turns the same-host copy off
ENV_BEFORE_MAIN = "HVDRUNNER_BEFORE_MAIN"  # "module:function" a launcher has its ranks call before the training function
ENV_WARM = "HVDRUNNER_WARM"  # "0" in env=: every rank starts cold, a fresh interpreter (rank/warm.py)
# The rank's place in the plan under every launcher (``plan.rank_env``): what rank-side code reads.
# A launcher's own contract is set by its module (``slot_env``; MPI's under mpirun) and its names are
# in the launchers' table: ``HOROVOD_RANK`` & co only under Gloo, as ``horovodrun`` does.
ENV_RANK = "HVDRUNNER_RANK"
ENV_SIZE = "HVDRUNNER_SIZE"
ENV_LOCAL_RANK = "HVDRUNNER_LOCAL_RANK"
ENV_LOCAL_SIZE = "HVDRUNNER_LOCAL_SIZE"
ENV_CROSS_RANK = "HVDRUNNER_CROSS_RANK"
ENV_CROSS_SIZE = "HVDRUNNER_CROSS_SIZE"
ENV_HOSTNAME = "HVDRUNNER_HOSTNAME"
ENV_GPUS = "HVDRUNNER_GPUS"  # the addresses of the GPUs Spark gave the rank's task ("0,1"); absent: none
# What a driver's own environment must never leak into a rank: the contract names the launchers'
# table marks so (the Gloo contract's ``HOROVOD_RANK`` & co), and Horovod's timeline.
HOROVOD_RANK_CONTRACT = (*never_from_driver(), "HOROVOD_TIMELINE")
# What of the task's environment reaches the ranks, mpirun and orted (``passes_to_ranks``;
# docs/security.md): an allow-list of what they and the frameworks need, never a name that holds a
# secret by its name; more through the user's ``env=`` (values) or ``HVDRUNNER_PASS_ENV`` (names).
ENV_PASS = "HVDRUNNER_PASS_ENV"  # in the task's environment: more names (or PREFIX_*) to pass on, comma-separated
RANK_ENV_NAMES = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TMPDIR", "TMP", "TEMP", "TZ", "LANG", "LANGUAGE",
    "LD_LIBRARY_PATH", "LD_PRELOAD", "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "JAVA_HOME",
    "PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED", "PYTHONWARNINGS",
    "PYTHONFAULTHANDLER", "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONSAFEPATH",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "TOKENIZERS_PARALLELISM",
)
RANK_ENV_PREFIXES = (
    "LC_", "XDG_",  # locale, user folders
    "CUDA_", "NCCL_", "NVIDIA_", "CUDNN_", "HIP_", "ROCR_", "ROCM_", "HSA_",  # accelerators and their collectives
    "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_",  # CPU threads
    "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "TRITON_", "TF_", "XLA_", "KERAS_", "HF_", "TRANSFORMERS_",  # frameworks
    "HOROVOD_", "OMPI_", "OPAL_", "PMIX_", "ORTE_", "GLOO_", "UCX_", "FI_",  # Horovod, Open MPI, Gloo, fabrics
    "HVDRUNNER_",  # this provider's own
    "AIRFLOW_CTX_",  # the task's Airflow context (dag, task, run, try), as Airflow gives any subprocess
)
# Names that hold a secret stay behind even when the allow-list has them (``HF_TOKEN``), unless
# ``HVDRUNNER_PASS_ENV`` names them.
SECRET_ENV_NAMES = (
    "PYTHON_WORKER_FACTORY_SECRET", "_SPARK_AUTH_SECRET",  # Spark's worker and RPC secrets
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__CELERY__BROKER_URL", "AIRFLOW__CELERY__RESULT_BACKEND",
)
SECRET_ENV_PREFIXES = ("AWS_", "AZURE_", "AIRFLOW_CONN_", "AIRFLOW_VAR_")  # cloud credentials, Airflow's connections
_SECRET_ENV_WORDS = re.compile(
    r"(^|_)(SECRETS?|TOKENS?|PASSWORDS?|PASSWD|CREDENTIALS?|API_?KEYS?|ACCESS_?KEYS?|PRIVATE_?KEYS?|FERNET_KEY)(_|$)")


def passes_to_ranks(name: str, passed: str = "") -> bool:
    """Whether the task's variable ``name`` reaches the ranks, mpirun and orted: named in ``passed``
    (``HVDRUNNER_PASS_ENV``: names, or prefixes ending in ``*``, comma-separated), or on the
    allow-list and not a secret by its name. Spark's and Airflow's own secrets never pass."""
    if name.upper() in SECRET_ENV_NAMES:
        return False
    for word in (w.strip() for w in passed.split(",")):
        if word and (name == word or (word.endswith("*") and name.startswith(word[:-1]))):
            return True
    return (name in RANK_ENV_NAMES or name.startswith(RANK_ENV_PREFIXES)) and not is_secret_env(name)


def is_secret_env(name: str) -> bool:
    """Whether the variable ``name`` holds a secret by its name: a known one (Spark's, Airflow's),
    a cloud credential (``AWS_*``, ``AZURE_*``), or a name with a word such as ``SECRET``, ``TOKEN``,
    ``PASSWORD``, ``CREDENTIALS`` or ``API_KEY`` in it."""
    upper = name.upper()
    return upper in SECRET_ENV_NAMES or upper.startswith(SECRET_ENV_PREFIXES) or bool(_SECRET_ENV_WORDS.search(upper))

# -- the task folder ------------------------------------------------------------------------------
PAYLOAD_FILE = "payload.pkl"
PLAN_FILE = "plan.json"
RESULT_FILE = "result.pkl"
ERROR_FILE = "rank-%d.error.json"
RANK_LOG = "rank-%d.log"
MPIRUN_LOG = "mpirun.log"
ORTED_LOG = "orted.log"
WARM_SOCKET = "warm.sock"  # the task's warm process listens here (0600, in the 0700 folder; rank/warm.py)
WARM_LOG = "warm.log"  # the warm process's own words
RANK_PID = "rank-%d.pid"  # the pid of a rank forked by the warm process (task/rank_states.py)
AGENT_LOG = "rsh.log"  # the agent's own words (Open MPI sends its output to /dev/null)
# Keys are handed over in 0600 files in the task's 0700 folder, never through the environment:
RANK_KEY = "rank-%d.key"  # a rank's channel key; the rank removes it once read
EXEC_KEY = "exec.key"  # the rsh agent's key for the exec services; lives while mpirun runs
ARTIFACTS_DIR = "artifacts"  # rank 0's: what comes back to the driver
SCRATCH_DIR = "scratch-rank-%d"  # every other rank's: thrown away
RESUME_DIR = "resume"  # the host's copy of resume_from (in its first task's folder)
CHECKPOINTS_DIR = "checkpoints"
OUTBOX_DIR = "outbox"  # rank 0's task: the checkpoint version on its way to the driver (shipper.py)
COMMITS_DIR = "commits"  # rank 0's task: runtime.commit_checkpoint's snapshot, until shipped
TIMELINE_FILE = "timeline.json"
DATASET_FILE = "dataset.arrow"  # the task's partition of dataset=, for the rank of this task
PREEMPTING_FILE = "preempting"  # the task's preemption notice to its ranks (task/termination.announce)


# Temporary folders are named after the process that owns them, so a later task can remove those
# whose owner died without cleaning up (a Python worker killed with its executor, SIGKILL).
TASK_DIR_PREFIX = "hvdrunner-%s-%s-%d-"  # run id ("<run>-<n>" after a restart), "p<partition>" or "local", owner pid
SESSION_DIR_PREFIX = "hvdo-%d-"  # an orted's Open MPI session directory; owner pid (kept short)
WARM_DIR_PREFIX = "hvdwarm-%d-"  # a warm process's folder (its socket, its log); owner pid: the pyspark daemon, or the worker
WARM_DIR = WARM_DIR_PREFIX + "k%s"  # an owner's kept warm process for one key: owner pid, the key's hash (launchers/processes.py)
WARM_KEY_CHARS = 12
WARM_DIR_RE = r"^hvdwarm-%d-k[0-9a-f]{12}$"  # an owner's kept warm processes (not those being started or moved aside)
OFFERS_DIR_PREFIX = "hvdoffers-%d-"  # the driver's proof files of its same-host offers (driver/channel.py); owner pid
STAGING_DIR_PREFIX = "hvdstaging-%d-"  # an Airflow try's local artifact folder and scratch (recorder.staging); owner pid
RESUME_DIR_PREFIX = "hvdresume-%d-"  # an Airflow try's local copy of the checkpoint it resumes from; owner pid
_OWNED = re.compile(r"^(?:hvdrunner-[0-9a-f]+(?:-\d+)?-(?:p\d+|local)|hvdo|hvdwarm|hvdoffers|hvdstaging|hvdresume)-(\d+)-")


def rank_of(env: dict[str, str]) -> int | None:
    """The rank an environment names: the task's word (``HVDRUNNER_RANK``), else any launcher's own."""
    for name in (ENV_RANK, *rank_names()):
        if env.get(name, "").isdigit():
            return int(env[name])
    return None


def new_temp_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


def sweep_orphans(root: str | None = None, owner: int | None = None) -> list[str]:
    """Remove this user's task and session folders whose owning process is gone; return their names.
    ``owner``: only the folders of that process, which the caller saw end (the janitor, ``procs``)."""
    root = root or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            found = _OWNED.match(entry.name)
            if found is None or not entry.is_dir(follow_symlinks=False):
                continue
            pid = int(found.group(1))
            if owner is not None and pid != owner:
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != os.getuid() or (owner is None and _exists(pid)):
                    continue
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.name)
    return removed


def _exists(pid: int) -> bool:
    import psutil

    return psutil.pid_exists(pid)


def children_env() -> dict[str, str]:
    """What of this process's environment reaches a process the task starts (``passes_to_ranks``)."""
    passed = os.environ.get(ENV_PASS, "")
    return {k: v for k, v in os.environ.items() if k not in HOROVOD_RANK_CONTRACT and passes_to_ranks(k, passed)}


class TaskDir:
    """The folder of one barrier task (or of the driver's local ranks), and every name in it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    payload = property(lambda self: self.path / PAYLOAD_FILE)
    plan = property(lambda self: self.path / PLAN_FILE)
    result = property(lambda self: self.path / RESULT_FILE)
    mpirun_log = property(lambda self: self.path / MPIRUN_LOG)
    orted_log = property(lambda self: self.path / ORTED_LOG)
    rsh_log = property(lambda self: self.path / AGENT_LOG)
    artifacts = property(lambda self: self.path / ARTIFACTS_DIR)
    resume = property(lambda self: self.path / RESUME_DIR)
    exec_key = property(lambda self: self.path / EXEC_KEY)
    dataset = property(lambda self: self.path / DATASET_FILE)
    preempting = property(lambda self: self.path / PREEMPTING_FILE)

    def rank_key(self, rank: int) -> Path:
        return self.path / (RANK_KEY % rank)

    def error(self, rank: int) -> Path:
        return self.path / (ERROR_FILE % rank)

    def rank_log(self, rank: int) -> Path:
        return self.path / (RANK_LOG % rank)

    def rank_pid(self, rank: int) -> Path:
        return self.path / (RANK_PID % rank)

    warm_socket = property(lambda self: self.path / WARM_SOCKET)
    warm_log = property(lambda self: self.path / WARM_LOG)

    def rank_folder(self, rank: int) -> Path:
        """Rank 0's artifact folder (it comes back), every other rank's scratch folder."""
        return self.artifacts if rank == 0 else self.path / (SCRATCH_DIR % rank)


TAIL_LINES = 100  # the last lines of a rank kept for its failure report (rank, task and driver alike)
