"""Build Horovod 0.28.1 for the torch (and TensorFlow) of this environment: ``airflow-horovod build``.

No Horovod wheel exists on PyPI, and its sdist does not build against torch >= 2.1, CMake 4 or
TensorFlow 2.21 as released. This module fetches the sdist with pip, applies ``PATCHES``, builds
against the frameworks installed beside it (no build isolation), caches the wheel outside any
checkout, installs it and checks that each framework's Horovod extension loads and was built with
MPI and Gloo (``verify``). ``scripts/setup`` calls it.
Only the standard library is imported: setup runs it before the package itself is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HOROVOD_VERSION = "0.28.1"
# The sdist's SHA-256 (horovod-0.28.1.tar.gz as the registry serves it): pip refuses anything else
# (--require-hashes, its cache included), and the file is checked again before it is unpacked.
SDIST_SHA256 = "92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"
TENSORFLOW = "tensorflow"
FRAMEWORKS = ("torch", TENSORFLOW)
FRAMEWORK_NAMES = {"torch": "PyTorch", TENSORFLOW: "TensorFlow"}
EXTENSIONS = {"torch": "horovod.torch", TENSORFLOW: "horovod.tensorflow"}
CONTROLLERS = ("MPI", "Gloo")
# Run in a process of its own per framework: load the extension, ask it what it was built with.
BUILT_WITH = """
import importlib, json, sys
extension = importlib.import_module(sys.argv[1])
print(json.dumps({"MPI": bool(extension.mpi_built()), "Gloo": bool(extension.gloo_built())}))
"""


class HorovodBuildError(RuntimeError):
    """Horovod could not be built, installed or verified; the message says what to install or read."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """Line ``line`` (1-based) of ``path`` in the sdist reads ``old`` (indentation aside) and becomes ``new``."""

    path: str
    line: int
    old: str
    new: str
    why: str
    framework: str | None = None  # applied only when that framework is built


PATCHES = (
    Patch("CMakeLists.txt", 19, "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)",
          "torch >= 2.1 headers need C++17, and Gloo must be built with the same standard"),
    Patch("horovod/torch/CMakeLists.txt", 67, "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)",
          "torch >= 2.1 headers need C++17"),
    Patch("horovod/common/gloo/gloo_context.cc", 282, "device_attr.iface = gloo_iface_;",
          "device_attr.iface = global_context.gloo_iface_;",
          "a process set's device must bind HOROVOD_GLOO_IFACE like the global one: its own gloo_iface_ is never"
          " set, so Gloo advertised the address of gethostname(), loopback on Debian's 127.0.1.1 hosts"),
    Patch("horovod/common/gloo/gloo_controller.cc", 92, "global_ranks_.reserve(size_);",
          "global_ranks_ = std::vector<int>(size_);",
          "the Gloo controller's rank list must hold its ranks, as the MPI controller's does: reserve() left it"
          " empty, so the stall check (StallInspector::CheckForStalledTensors loops over global_ranks.size())"
          " never named a missing rank and HOROVOD_STALL_CHECK/SHUTDOWN_TIME_SECONDS did nothing under Gloo"),
    Patch("horovod/tensorflow/xla_mpi_ops.cc", 23, "#if TENSORFLOW_VERSION >= 2006000000",
          "#if TENSORFLOW_VERSION >= 2006000000 && HAVE_GPU",
          "GPU-only file; on TF >= 2.6 its XLA headers need highwayhash, which TensorFlow's wheel lacks",
          TENSORFLOW),
    Patch("horovod/tensorflow/keras/__init__.py", 29, "from keras import backend as K",
          "K = keras.backend  # tf.keras (tf-keras), not Keras 3",
          "`import keras` is Keras 3 even with TF_USE_LEGACY_KERAS=1", TENSORFLOW),
    Patch("horovod/tensorflow/keras/callbacks.py", 23, "from keras import backend as K",
          "K = keras.backend  # tf.keras (tf-keras), not Keras 3",
          "`import keras` is Keras 3 even with TF_USE_LEGACY_KERAS=1", TENSORFLOW),
)


def patches_for(frameworks: tuple[str, ...]) -> tuple[Patch, ...]:
    """The patches a build of ``frameworks`` needs."""
    return tuple(p for p in PATCHES if p.framework is None or p.framework in frameworks)


def apply_patches(root: Path, patches: tuple[Patch, ...]) -> None:
    """Apply ``patches`` to the unpacked sdist at ``root``; fail, naming the line, unless each one took."""
    for patch in patches:
        path = root / patch.path
        lines = path.read_text().split("\n")
        found = lines[patch.line - 1] if patch.line <= len(lines) else "<end of file>"
        if found.strip() != patch.old:
            raise HorovodBuildError(
                "Horovod patch did not apply: %s line %d reads %r, expected %r. Is this the Horovod %s sdist?"
                % (patch.path, patch.line, found.strip(), patch.old, HOROVOD_VERSION))
        lines[patch.line - 1] = found[: len(found) - len(found.lstrip())] + patch.new
        path.write_text("\n".join(lines))


def cache_root() -> Path:
    """$AIRFLOW_PROVIDER_HOROVOD_CACHE, else $XDG_CACHE_HOME (or ~/.cache)/airflow-provider-horovod."""
    explicit = os.environ.get("AIRFLOW_PROVIDER_HOROVOD_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "airflow-provider-horovod"


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def cache_key(frameworks: tuple[str, ...], versions: dict[str, str]) -> str:
    """Names one build: Horovod, the Python, each framework's version, and a digest of the patch set.

    A changed patch changes the key, so a wheel built with older (or no) patches is never reused.
    """
    patches = patches_for(frameworks)
    edits = [(p.path, p.line, p.old, p.new) for p in patches]
    digest = hashlib.sha256(repr(edits).encode()).hexdigest()[:10]
    parts = ["horovod-%s" % HOROVOD_VERSION, "py%d.%d" % sys.version_info[:2]]
    parts += ["%s-%s" % (name, versions[name]) for name in FRAMEWORKS if name in frameworks]
    return "-".join(parts + ["patches-%s" % digest])


TOOL_HINTS = {
    "c++": "a C++ compiler (g++ 9 or newer): `apt-get install g++` (Debian/Ubuntu) or set $CXX",
    "mpicc": "Open MPI's compiler wrapper `mpicc`: `apt-get install openmpi-bin libopenmpi-dev`",
    "cmake": "CMake 3.13 or newer: `pip install cmake` in this environment",
    "make": "make: `apt-get install make`",
}


def missing_prerequisites(frameworks: tuple[str, ...], which=shutil.which) -> list[str]:
    """What a build of ``frameworks`` lacks here, each with how to get it; empty when all is present."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    tools = {"c++": os.environ.get("CXX") or "c++", "mpicc": "mpicc", "cmake": "cmake", "make": "make"}
    missing = [TOOL_HINTS[name] for name, program in tools.items() if which(program, path=search) is None]
    for framework in frameworks:
        if installed_version(framework) is None:
            missing.append("%s, installed in this environment first (the build links against it): `pip install %s`"
                           % (framework, framework))
    return missing


def build_env(frameworks: tuple[str, ...]) -> dict[str, str]:
    """The environment of Horovod's build: the frameworks asked for, Gloo and MPI, nothing else."""
    env = dict(os.environ, CMAKE_POLICY_VERSION_MINIMUM="3.5", HOROVOD_WITH_GLOO="1", HOROVOD_WITH_MPI="1",
               HOROVOD_WITHOUT_MXNET="1", MAKEFLAGS=os.environ.get("MAKEFLAGS", "-j%d" % (os.cpu_count() or 1)))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    for framework, flag in (("torch", "PYTORCH"), (TENSORFLOW, "TENSORFLOW")):
        env["HOROVOD_WITH%s_%s" % ("" if framework in frameworks else "OUT", flag)] = "1"
    return env


def pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]


def run_pip(what: str, *args: str) -> None:
    """Run pip with ``args``; fail saying ``what`` could not be done (pip has printed why)."""
    if subprocess.run(pip(*args)).returncode != 0:
        raise HorovodBuildError("pip could not %s (see pip's message above)" % what)


def build_wheel(frameworks: tuple[str, ...], wheelhouse: Path, log: Path) -> Path:
    """Fetch, patch and build the sdist; return the wheel, moved into ``wheelhouse``."""
    missing = missing_prerequisites(frameworks)
    if missing:
        raise HorovodBuildError("Cannot build Horovod %s; missing:\n  - %s" % (HOROVOD_VERSION, "\n  - ".join(missing)))
    with tempfile.TemporaryDirectory(prefix="horovod-build-") as scratch:
        work = Path(scratch)
        with tarfile.open(download_sdist(work)) as sdist:
            sdist.extractall(work, filter="data")
        src = work / ("horovod-%s" % HOROVOD_VERSION)
        apply_patches(src, patches_for(frameworks))
        with open_log(log) as out:
            built = subprocess.run(pip("wheel", "--no-build-isolation", "--no-deps", "-w", str(work / "out"), str(src)),
                                   env=build_env(frameworks), stdout=out, stderr=subprocess.STDOUT)
        if built.returncode != 0:
            raise HorovodBuildError("Horovod build failed; the relevant lines of %s:\n%s" % (log, build_errors(log)))
        wheel = next((work / "out").glob("horovod-*.whl"))
        wheelhouse.mkdir(mode=0o700, parents=True, exist_ok=True)
        cached = Path(shutil.move(str(wheel), wheelhouse / wheel.name))
        record_digest(cached)
        return cached


def download_sdist(work: Path) -> Path:
    """The Horovod sdist in ``work``, fetched by pip with its hash pinned (``SDIST_SHA256``) and checked again."""
    requirement = work / "horovod.txt"
    requirement.write_text("horovod==%s --hash=sha256:%s\n" % (HOROVOD_VERSION, SDIST_SHA256))
    run_pip("download the Horovod %s sdist with SHA-256 %s" % (HOROVOD_VERSION, SDIST_SHA256), "download",
            "--no-deps", "--no-binary", ":all:", "--require-hashes", "-d", str(work), "-r", str(requirement))
    sdist = work / ("horovod-%s.tar.gz" % HOROVOD_VERSION)
    found = file_digest(sdist)
    if found != SDIST_SHA256:
        raise HorovodBuildError("The Horovod %s sdist has SHA-256 %s, not %s: it is not the released file. Check "
                                "your package index." % (HOROVOD_VERSION, found, SDIST_SHA256))
    return sdist


def open_log(log: Path):
    """The build log, new or emptied, never through a link (another user's link would redirect our writes)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, "w")


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def record_digest(wheel: Path) -> None:
    """Write the wheel's SHA-256 beside it (``<wheel>.sha256``, 0600): a cache hit is checked against it."""
    fd = os.open(str(wheel) + ".sha256", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(file_digest(wheel) + "\n")


def _untrusted(path: Path, kind: str) -> str | None:
    """Why ``path`` (a ``kind``: file or folder) of the cache is not to be trusted, or None."""
    info = os.lstat(path)
    if kind == "folder" and not stat.S_ISDIR(info.st_mode) or kind == "file" and not stat.S_ISREG(info.st_mode):
        return "%s is not a plain %s (a link?)" % (path, kind)
    if info.st_uid != os.geteuid():
        return "%s is owned by uid %d, not by this user (uid %d)" % (path, info.st_uid, os.geteuid())
    if info.st_mode & 0o022:
        return "%s may be written by other users (mode %o)" % (path, stat.S_IMODE(info.st_mode))
    return None


def check_cached_wheel(wheel: Path) -> None:
    """A cached wheel is installed only if it, its folder and its digest file are this user's and
    no one else may write them, and its bytes are the ones built (``record_digest``). A wheel
    cached before digests were recorded gets its digest recorded now (its owner and mode checked)."""
    digest = Path(str(wheel) + ".sha256")
    why = _untrusted(wheel.parent, "folder") or _untrusted(wheel, "file")
    if why is None and not os.path.lexists(digest):
        record_digest(wheel)
    why = why or _untrusted(digest, "file")
    if why is None and digest.read_text().strip() != file_digest(wheel):
        why = "%s differs from the wheel that was built (its SHA-256 changed)" % wheel
    if why is not None:
        raise HorovodBuildError("Not installing the cached Horovod wheel: %s. Remove %s and run `airflow-horovod "
                                "build` again to rebuild it." % (why, wheel.parent))


def build_errors(log: Path, limit: int = 40) -> str:
    """The lines of a build log that say why it failed (compiler and CMake errors), then its tail."""
    lines = log.read_text(errors="replace").splitlines()
    errors = [line for line in lines if re.search(r"error|fatal|undefined reference|multiple definition", line, re.I)]
    return "\n".join(errors[:limit] + ["..."] + lines[-20:])


def cached_wheel(wheelhouse: Path) -> Path | None:
    """The cached wheel for this Python in ``wheelhouse``, if one was built."""
    tag = "cp%d%d" % sys.version_info[:2]
    return next(iter(sorted(wheelhouse.glob("horovod-%s-%s-*.whl" % (HOROVOD_VERSION, tag)))), None)


def install_wheel(wheel: Path) -> None:
    """Install ``wheel`` unless this environment already holds exactly it (stamped by its digest)."""
    stamp = Path(sys.prefix) / ".horovod-wheel"
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text().strip() == digest and installed_version("horovod") == HOROVOD_VERSION:
        return
    # Horovod's runtime needs (its wheel goes in without dependencies, so pip keeps the frameworks as they are)
    run_pip("install Horovod's runtime needs", "install", "cloudpickle", "psutil", "pyyaml", "packaging")
    run_pip("install %s" % wheel, "install", "--no-deps", "--force-reinstall", str(wheel))
    fresh = stamp.with_name(stamp.name + ".new")
    fresh.write_text(digest + "\n")
    fresh.replace(stamp)  # a new file: a hard-linked copy of a virtualenv keeps its original's stamp


def built_with(frameworks: tuple[str, ...]) -> dict[str, dict[str, bool] | str]:
    """Per framework, what its Horovod extension says it was built with ({controller: built}), or
    why it did not load (the end of its stderr). Each framework loads in a process of its own, all
    at once: Horovod's own ``mpi_built()`` and ``gloo_built()``, what ``horovodrun --check-build``
    asks too, without its one new process per question (seven loads of TensorFlow, 49 s here)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    procs = {f: subprocess.Popen([sys.executable, "-c", BUILT_WITH, EXTENSIONS[f]], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env) for f in frameworks}
    found: dict[str, dict[str, bool] | str] = {}
    for framework, proc in procs.items():
        out, err = proc.communicate()
        lines = out.strip().splitlines()
        found[framework] = json.loads(lines[-1]) if proc.returncode == 0 and lines else err[-2000:] or out[-2000:]
    return found


def lacks(found: dict[str, dict[str, bool] | str]) -> list[str]:
    """What ``built_with``'s answer lacks: each framework whose extension did not load, then each
    controller an extension was built without ("PyTorch", "Gloo (TensorFlow)")."""
    missing = [FRAMEWORK_NAMES[f] for f, got in found.items() if isinstance(got, str)]
    return missing + ["%s (%s)" % (c, FRAMEWORK_NAMES[f]) for f, got in found.items() if isinstance(got, dict)
                      for c in CONTROLLERS if not got.get(c)]


def verify(frameworks: tuple[str, ...]) -> str:
    """Fail unless each framework's Horovod extension loads and was built with MPI and Gloo; return
    the summary line."""
    found = built_with(frameworks)
    missing = lacks(found)
    if missing:
        why = "".join("\n%s: %s" % (FRAMEWORK_NAMES[f], got) for f, got in found.items() if isinstance(got, str))
        raise HorovodBuildError("The installed Horovod lacks %s%s\nRebuild it: airflow-horovod build%s"
                                % (", ".join(missing), why, " --with tensorflow" if TENSORFLOW in frameworks else ""))
    return "Horovod %s: %s, each with %s\n" % (HOROVOD_VERSION, ", ".join(FRAMEWORK_NAMES[f] for f in frameworks),
                                               " and ".join(CONTROLLERS))


def build(frameworks: tuple[str, ...], install: bool = True) -> Path:
    """Build (or take from the cache), install and verify Horovod for ``frameworks``; return the wheel.
    With ``install=False`` only the cached wheel is made: ``scripts/setup`` builds it while the rest
    of the environment installs, then installs and verifies it once nothing else writes there."""
    wheel = cached_or_built_wheel(frameworks)
    if not install:
        print("Horovod %s wheel cached at %s" % (HOROVOD_VERSION, wheel))
        return wheel
    install_wheel(wheel)
    print(verify(frameworks), end="")
    print("Horovod %s installed from %s" % (HOROVOD_VERSION, wheel))
    return wheel


def cached_or_built_wheel(frameworks: tuple[str, ...]) -> Path:
    """The cached wheel for ``frameworks`` and the installed framework versions, built first if there is none."""
    versions = {f: installed_version(f) or "" for f in frameworks}
    key = cache_key(frameworks, versions)
    wheelhouse = cache_root() / "wheels" / key
    wheel = cached_wheel(wheelhouse)
    if wheel is not None:
        check_cached_wheel(wheel)
    else:
        log = wheelhouse.parent / (key + ".log")
        log.parent.mkdir(parents=True, exist_ok=True)  # a new machine has no cache yet
        print("Building Horovod %s as %s (5-10 minutes); log: %s" % (HOROVOD_VERSION, key, log), flush=True)
        wheel = build_wheel(frameworks, wheelhouse, log)
    return wheel


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(prog="airflow-horovod", description=__doc__.split("\n")[0])
    commands = cli.add_subparsers(dest="command", required=True)
    build_cmd = commands.add_parser("build", help="build, cache, install and verify Horovod %s" % HOROVOD_VERSION)
    build_cmd.add_argument("--with", dest="extra", action="append", default=[], choices=[TENSORFLOW],
                           help="also build Horovod's TensorFlow extension (TensorFlow must be installed)")
    build_cmd.add_argument("--wheel-only", action="store_true",
                           help="only build (or find) the cached wheel; install and verify nothing")
    return cli


def _exit_on_sigterm(signum, frame) -> None:
    """SIGTERM ends a build as Ctrl-C does: its build folder is removed on the way out."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    frameworks = ("torch", *dict.fromkeys(args.extra))
    try:
        build(frameworks, install=not args.wheel_only)
    except HorovodBuildError as error:
        print("airflow-horovod: %s" % error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # how scripts/setup stops the build it runs in the background
    sys.exit(main())
