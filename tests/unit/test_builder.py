"""The Horovod builder's pieces that need no build: patches, cache key, prerequisites, the check."""

from __future__ import annotations

import dataclasses

import pytest

from airflow_provider_horovod import builder
from airflow_provider_horovod.builder import PATCHES, HorovodBuildError

VERSIONS = {"torch": "2.13.0+cpu", "tensorflow": "2.21.0"}


def fake_sdist(root, patches=PATCHES, indent="    "):
    """A tree where each patched line sits at its line number, among filler lines."""
    for patch in patches:
        path = root / patch.path
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = path.read_text().split("\n") if path.exists() else []
        lines += ["// filler %d" % i for i in range(len(lines), patch.line)]
        lines[patch.line - 1] = indent + patch.old
        path.write_text("\n".join(lines + ["// end"]))
    return root


def test_every_patch_applies_at_its_line_and_keeps_the_indentation(tmp_path):
    apply_root = fake_sdist(tmp_path)
    builder.apply_patches(apply_root, PATCHES)
    for patch in PATCHES:
        lines = (tmp_path / patch.path).read_text().split("\n")
        assert lines[patch.line - 1] == "    " + patch.new
        assert patch.old not in lines  # also the same text on other lines stays as it was
        assert lines[-1] == "// end"


def test_gloo_patch_changes_only_the_process_set_device_line(tmp_path):
    gloo = next(p for p in PATCHES if p.path.endswith("gloo_context.cc"))
    path = tmp_path / gloo.path
    path.parent.mkdir(parents=True)
    lines = ["// filler"] * 300
    lines[106] = lines[143] = lines[gloo.line - 1] = "  device_attr.iface = gloo_iface_;"
    path.write_text("\n".join(lines))
    builder.apply_patches(tmp_path, (gloo,))
    patched = path.read_text().split("\n")
    assert patched[gloo.line - 1] == "  device_attr.iface = global_context.gloo_iface_;"
    assert patched[106] == patched[143] == "  device_attr.iface = gloo_iface_;"


def test_gloo_controller_patch_sizes_the_rank_list_the_stall_check_loops_over(tmp_path):
    """Horovod 0.28.1's GlooController::DoInitialization reserve()d global_ranks_ and allgathered into
    its spare capacity: size() stayed 0, so the stall check found no missing rank under Gloo."""
    ranks = next(p for p in PATCHES if p.path.endswith("gloo_controller.cc"))
    path = tmp_path / ranks.path
    path.parent.mkdir(parents=True)
    lines = ["// filler"] * 120
    lines[ranks.line - 1] = "  global_ranks_.reserve(size_);"
    lines[ranks.line + 4] = "    opts.setOutput(global_ranks_.data(), size_);"
    path.write_text("\n".join(lines))
    builder.apply_patches(tmp_path, (ranks,))
    patched = path.read_text().split("\n")
    assert patched[ranks.line - 1] == "  global_ranks_ = std::vector<int>(size_);"
    assert patched[ranks.line + 4] == "    opts.setOutput(global_ranks_.data(), size_);"
    assert ranks.framework is None  # every build has Gloo


def test_a_patch_whose_line_moved_fails_naming_file_line_and_text(tmp_path):
    patch = PATCHES[0]
    fake_sdist(tmp_path, (dataclasses.replace(patch, line=patch.line + 1),))
    with pytest.raises(HorovodBuildError, match=r"CMakeLists.txt line 19 reads '// filler 18', expected "
                                                r"'set\(CMAKE_CXX_STANDARD 14\)'"):
        builder.apply_patches(tmp_path, (patch,))


def test_torch_build_takes_the_cmake_and_gloo_patches_not_tensorflows():
    torch_only = builder.patches_for(("torch",))
    assert {p.path for p in torch_only} == {"CMakeLists.txt", "horovod/torch/CMakeLists.txt",
                                            "horovod/common/gloo/gloo_context.cc",
                                            "horovod/common/gloo/gloo_controller.cc"}
    assert builder.patches_for(("torch", "tensorflow")) == PATCHES


def test_cache_key_names_the_versions_and_changes_with_the_patch_set(monkeypatch):
    key = builder.cache_key(("torch", "tensorflow"), VERSIONS)
    assert key.startswith("horovod-0.28.1-py3.11-torch-2.13.0+cpu-tensorflow-2.21.0-patches-")
    assert builder.cache_key(("torch",), VERSIONS) != key
    assert builder.cache_key(("torch", "tensorflow"), dict(VERSIONS, torch="2.13.1")) != key
    assert builder.cache_key(("torch", "tensorflow"), VERSIONS) == key
    changed = (dataclasses.replace(PATCHES[2], new="device_attr.iface = other;"),) + PATCHES[3:]
    monkeypatch.setattr(builder, "PATCHES", PATCHES[:2] + changed)
    assert builder.cache_key(("torch", "tensorflow"), VERSIONS) != key


def test_cache_lies_outside_any_checkout(monkeypatch, tmp_path):
    monkeypatch.delenv("AIRFLOW_PROVIDER_HOROVOD_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert builder.cache_root() == tmp_path / "xdg" / "airflow-provider-horovod"
    monkeypatch.setenv("AIRFLOW_PROVIDER_HOROVOD_CACHE", str(tmp_path / "mine"))
    assert builder.cache_root() == tmp_path / "mine"


def test_missing_tools_and_framework_are_named_with_how_to_get_them(monkeypatch):
    monkeypatch.setattr(builder, "installed_version", lambda name: None if name == "torch" else "1")
    absent = {"mpicc", "cmake"}
    missing = builder.missing_prerequisites(("torch",), which=lambda program, path: None if program in absent else program)
    assert missing == [builder.TOOL_HINTS["mpicc"], builder.TOOL_HINTS["cmake"],
                       "torch, installed in this environment first (the build links against it): `pip install torch`"]
    assert "apt-get install openmpi-bin libopenmpi-dev" in missing[0]
    assert "pip install cmake" in missing[1]


def test_build_without_a_compiler_fails_before_downloading_anything(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("AIRFLOW_PROVIDER_HOROVOD_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    monkeypatch.setattr(builder, "run_pip", lambda *args: pytest.fail("pip ran despite a missing compiler"))
    assert builder.main(["build"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("airflow-horovod: Cannot build Horovod 0.28.1; missing:\n  - a C++ compiler")
    assert "apt-get install g++" in err



def test_a_first_build_on_a_new_machine_makes_the_cache_folder_its_log_goes_in(monkeypatch, tmp_path):
    monkeypatch.setenv("AIRFLOW_PROVIDER_HOROVOD_CACHE", str(tmp_path / "new-cache"))  # not there yet
    monkeypatch.setattr(builder, "installed_version", lambda name: "2.13.0+cpu")
    logs = []

    def build_wheel(frameworks, wheelhouse, log):
        log.write_text("pip wheel ...")  # what the real build does first: it failed here on a new machine
        logs.append(log)
        return wheelhouse / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"

    monkeypatch.setattr(builder, "build_wheel", build_wheel)
    monkeypatch.setattr(builder, "install_wheel", lambda wheel: None)
    monkeypatch.setattr(builder, "verify", lambda frameworks: "")
    builder.build(("torch",))
    assert logs and logs[0].parent == tmp_path / "new-cache" / "wheels" and logs[0].read_text() == "pip wheel ..."


def test_what_each_extension_lacks_is_named_per_framework_and_controller():
    assert builder.lacks({"torch": {"MPI": True, "Gloo": False}}) == ["Gloo (PyTorch)"]
    assert builder.lacks({"torch": {"MPI": True, "Gloo": True}, "tensorflow": "ImportError: libtensorflow"}) == ["TensorFlow"]
    assert builder.lacks({"torch": {"MPI": True, "Gloo": True}, "tensorflow": {"MPI": True, "Gloo": True}}) == []


def test_an_extension_that_does_not_load_fails_the_check_with_its_error_and_the_fix(monkeypatch):
    monkeypatch.setitem(builder.EXTENSIONS, "torch", "horovod.no_such_extension")  # a real process fails to import it
    with pytest.raises(HorovodBuildError) as failed:
        builder.verify(("torch",))
    assert "lacks PyTorch" in str(failed.value) and "No module named 'horovod.no_such_extension'" in str(failed.value)
    assert "Rebuild it: airflow-horovod build" in str(failed.value)


def test_build_environment_asks_for_exactly_the_frameworks():
    env = builder.build_env(("torch",))
    assert (env["HOROVOD_WITH_PYTORCH"], env["HOROVOD_WITHOUT_TENSORFLOW"]) == ("1", "1")
    assert "HOROVOD_WITH_TENSORFLOW" not in env
    both = builder.build_env(("torch", "tensorflow"))
    assert (both["HOROVOD_WITH_TENSORFLOW"], both["CMAKE_POLICY_VERSION_MINIMUM"]) == ("1", "3.5")



# -- issue 40, T4-11: what the builder takes from the network, the cache and its log ------------------
def _cached(tmp_path, content=b"a wheel"):
    wheelhouse = tmp_path / "wheels" / "key"
    wheelhouse.mkdir(parents=True, mode=0o700)
    wheel = wheelhouse / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    wheel.write_bytes(content)
    wheel.chmod(0o600)
    builder.record_digest(wheel)
    return wheel


def test_a_cached_wheel_built_here_is_installed_and_one_changed_since_is_refused(tmp_path):
    wheel = _cached(tmp_path)
    builder.check_cached_wheel(wheel)
    wheel.write_bytes(b"another wheel")  # the review: any cached wheel was installed as it was
    with pytest.raises(HorovodBuildError, match="SHA-256 changed.*Remove .* and run `airflow-horovod build`"):
        builder.check_cached_wheel(wheel)


@pytest.mark.parametrize("spoil", ["world-writable wheel", "group-writable folder", "another user's wheel", "a link"])
def test_a_cached_wheel_someone_else_could_have_written_is_refused(tmp_path, spoil):
    import os

    wheel = _cached(tmp_path)
    if spoil == "world-writable wheel":
        wheel.chmod(0o606)
    elif spoil == "group-writable folder":
        wheel.parent.chmod(0o770)
    elif spoil == "another user's wheel":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(wheel, 65534, 65534)
    else:
        real = wheel.with_name("elsewhere.whl")
        wheel.rename(real)
        wheel.symlink_to(real)
    with pytest.raises(HorovodBuildError, match="Not installing the cached Horovod wheel"):
        builder.check_cached_wheel(wheel)


def test_a_wheel_cached_before_digests_gets_one_once_its_owner_and_mode_pass(tmp_path):
    wheel = _cached(tmp_path)
    digest = wheel.with_name(wheel.name + ".sha256")
    digest.unlink()
    builder.check_cached_wheel(wheel)
    assert digest.read_text().strip() == builder.file_digest(wheel)


def test_the_build_log_is_never_opened_through_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("kept")
    log = tmp_path / "build.log"
    log.symlink_to(victim)  # another user's link where the log goes
    with pytest.raises(OSError):
        builder.open_log(log)
    assert victim.read_text() == "kept"


def test_an_sdist_that_is_not_the_released_one_is_refused_by_pip_and_never_unpacked(monkeypatch, tmp_path):
    import tarfile

    index = tmp_path / "index"
    index.mkdir()
    with tarfile.open(index / "horovod-0.28.1.tar.gz", "w:gz") as fake:  # a look-alike on the index
        fake.add(fake_sdist(tmp_path / "horovod-0.28.1"), arcname="horovod-0.28.1")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(HorovodBuildError, match="download the Horovod 0.28.1 sdist with SHA-256 92a43f5a"):
        builder.download_sdist(work)
    assert not (work / "horovod-0.28.1").exists()


def test_wheel_only_builds_the_cached_wheel_and_installs_nothing(monkeypatch, tmp_path, capsys):
    """What scripts/setup runs beside the package's install: nothing may be written to the venv then."""
    monkeypatch.setenv("AIRFLOW_PROVIDER_HOROVOD_CACHE", str(tmp_path))
    monkeypatch.setattr(builder, "installed_version", lambda name: "2.13.0+cpu")
    built = tmp_path / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    monkeypatch.setattr(builder, "build_wheel", lambda frameworks, wheelhouse, log: built)
    monkeypatch.setattr(builder, "install_wheel", lambda wheel: pytest.fail("installed with --wheel-only"))
    monkeypatch.setattr(builder, "verify", lambda frameworks: pytest.fail("verified with --wheel-only"))
    assert builder.main(["build", "--wheel-only"]) == 0
    assert capsys.readouterr().out.endswith("Horovod 0.28.1 wheel cached at %s\n" % built)
