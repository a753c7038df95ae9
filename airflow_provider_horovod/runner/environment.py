"""What a host's Python environment holds for a run: this provider's version and the Horovod build
(its frameworks, MPI, Gloo), read without importing Horovod or any framework (a few milliseconds).

The driver checks its own before Spark starts (``require_training_stack``: a light install, or
Horovod as PyPI's sdist builds it, fails there with the command that fixes it); every barrier task
reports its own in its facts and the plan is refused when an executor's differs from the driver's
(``readiness.check_facts``).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import struct
import sys
from pathlib import Path

from airflow_provider_horovod.exceptions import TrainingStackError
from airflow_provider_horovod.runner.launchers import Launcher, facts_of

DISTRIBUTION = "airflow-provider-horovod"
INSTALL_HINT = "pip install 'airflow-provider-horovod[torch]' then airflow-horovod build"
# framework -> (the extension's folder and file prefix in the horovod package, its key in metadata.json,
# the module a rank imports)
EXTENSIONS = {
    "pytorch": ("torch/mpi_lib_v2", "pytorch", "torch"),
    "tensorflow": ("tensorflow/mpi_lib", "tensorflow", "tensorflow"),
    "mxnet": ("mxnet/mpi_lib", "mxnet", "mxnet"),
}
# classes compiled into every extension only when Horovod was built with that controller
CONTROLLER_SYMBOLS = {"MPI": b"MPIController", "Gloo": b"GlooController"}
SHT_DYNSYM = 11


@dataclasses.dataclass(frozen=True)
class HorovodBuild:
    """One installed Horovod: its version, the frameworks it was built against, MPI and Gloo."""

    version: str
    frameworks: tuple[str, ...]  # e.g. ("pytorch 2.13.0+cpu", "tensorflow 2.21.0")
    controllers: tuple[str, ...]  # "MPI", "Gloo"

    def describe(self) -> str:
        """One line, the same on every host with the same build: what the facts carry."""
        return "horovod %s (%s; %s)" % (self.version, ", ".join(self.frameworks) or "no framework",
                                        ", ".join(self.controllers) or "no MPI, no Gloo")


def provider_version() -> str:
    """This package's version as installed (its distribution's metadata, which pip wrote)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def horovod_build() -> HorovodBuild | None:
    """The Horovod this interpreter would import, or ``None`` when there is none."""
    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    built = _built_versions(root)
    frameworks, libraries = [], []
    for name, (stem, key, _module) in EXTENSIONS.items():
        library = next(iter(sorted((root / stem).parent.glob(Path(stem).name + ".*.so"))), None)
        if library is not None:
            frameworks.append("%s %s" % (name, built.get(key, "?")))
            libraries.append(library)
    names = _dynamic_names(libraries[0]) if libraries else b""
    return HorovodBuild(version=_distribution_version("horovod"), frameworks=tuple(frameworks),
                        controllers=tuple(c for c, symbol in CONTROLLER_SYMBOLS.items() if symbol in names))


def stack_of_this_host(horovod: bool = True) -> dict[str, str]:
    """What a barrier task reports (and the driver compares): provider version and Horovod build.
    ``horovod=False`` (the driver of ``launcher="torch"``): the provider only, so Horovod is not compared."""
    if not horovod:
        return {"provider": provider_version()}
    build = horovod_build()
    return {"provider": provider_version(), "horovod": build.describe() if build else "no horovod"}


def stack_differences(driver: dict[str, str], executor: dict[str, str]) -> list[str]:
    """What differs between the driver's stack and an executor's, in words: ``[]`` when nothing."""
    labels = {"provider": DISTRIBUTION, "horovod": "Horovod"}
    return ["%s %s here, %s on the driver" % (labels[key], executor.get(key, "?"), driver[key])
            for key in labels if key in driver and executor.get(key) != driver[key]]


def require_training_stack(launcher: Launcher) -> HorovodBuild | None:
    """The Horovod build this driver runs the job with; ``TrainingStackError`` naming what is missing
    and how to install it when there is none, or it cannot run ``launcher`` or any framework.
    ``launcher="torch"`` needs torch only (and returns ``None``): no Horovod, no MPI."""
    python = sys.executable
    facts = facts_of(launcher)
    if not facts.runs_horovod:
        for module in facts.rank_modules:
            if importlib.util.find_spec(module) is None:
                raise TrainingStackError("launcher=%r needs %s, which is not installed in %s. Install it: pip install "
                                         "'airflow-provider-horovod[%s]' (no Horovod build needed)."
                                         % (str(launcher), module, python, facts.extra))
        return None
    build = horovod_build()
    if build is None:
        raise TrainingStackError("Horovod is not installed in %s: the driver plans the ranks with it and every "
                                 "executor runs them with it. Install the training stack: %s." % (python, INSTALL_HINT))
    if not build.frameworks:
        raise TrainingStackError("The Horovod in %s was built without any framework, MPI or Gloo (%s; PyPI's sdist "
                                 "builds it so). Rebuild it: %s." % (python, build.describe(), INSTALL_HINT))
    needed = facts.horovod_controller
    if needed not in build.controllers:
        raise TrainingStackError("The Horovod in %s was built without %s, which launcher=%r needs (%s). Rebuild it: "
                                 "%s." % (python, needed, str(launcher), build.describe(), INSTALL_HINT))
    absent = [module for name, (_stem, _key, module) in EXTENSIONS.items()
              if any(f.startswith(name + " ") for f in build.frameworks) and importlib.util.find_spec(module) is None]
    if len(absent) == len(build.frameworks):
        which = "%s is" % absent[0] if len(absent) == 1 else "neither %s is" % " nor ".join(absent)
        raise TrainingStackError("%s is built for its frameworks, but %s installed in %s. Install it: %s." % (
            build.describe(), which, python, INSTALL_HINT))
    return build


TENSORFLOW_INSTALL_HINT = "pip install 'airflow-provider-horovod[tensorflow]' then airflow-horovod build --with tensorflow"
TENSORFLOW_MODULES = ("tensorflow", "tf_keras", "keras", "horovod.tensorflow", "horovod.keras")


def require_framework(build: HorovodBuild | None, modules: set[str], what: str) -> None:
    """``TrainingStackError`` with the install command when ``what`` (the training function) uses
    TensorFlow or Keras and the driver's Horovod was built without it: every rank's import of
    ``horovod.tensorflow`` would fail later with Horovod's own "reinstall" message."""
    if build is None:
        return  # launcher="torch": Horovod is not used
    used = sorted(m for m in modules if any(m == t or m.startswith(t + ".") for t in TENSORFLOW_MODULES))
    if used and not any(f.startswith("tensorflow ") for f in build.frameworks):
        raise TrainingStackError("%s uses %s, but the Horovod in %s was built without TensorFlow (%s). Install the "
                                 "TensorFlow stack and rebuild Horovod with it: %s." % (
                                     what, ", ".join(used), sys.executable, build.describe(), TENSORFLOW_INSTALL_HINT))


def _distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _built_versions(root: Path) -> dict[str, str]:
    """The framework versions Horovod's build recorded (``horovod/metadata.json``)."""
    try:
        return {str(k): str(v) for k, v in json.loads((root / "metadata.json").read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _dynamic_names(library: Path) -> bytes:
    """The dynamic string table of an ELF64 shared library (its exported symbol names and needed
    libraries), read from the section headers: ~100 KB of a 60 MB file; ``b""`` if unreadable."""
    try:
        with open(library, "rb") as f:
            header = f.read(64)
            shoff, = struct.unpack_from("<Q", header, 0x28)
            shentsize, shnum = struct.unpack_from("<HH", header, 0x3A)
            f.seek(shoff)
            table = f.read(shentsize * shnum)
            sections = [struct.unpack_from("<IIQQQQI", table, i * shentsize) for i in range(shnum)]
            dynsym = next(s for s in sections if s[1] == SHT_DYNSYM)
            _name, _type, _flags, _addr, offset, size, _link = sections[dynsym[6]]
            f.seek(offset)
            return f.read(size)
    except (OSError, struct.error, StopIteration, IndexError):
        return b""
