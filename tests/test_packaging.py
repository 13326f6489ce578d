"""stagetrain installs as a wheel: the schema and the GPU catalog travel inside it, and the
workflow runs from a clone against the installed (not editable) package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from harness.workflow import REPO, SNAKEMAKE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The wheel `pip wheel --no-deps .` builds, and a folder it is installed into (no editable path)."""
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools leaves a build/ folder in the source tree, whose
    # stale files a later build would package.
    source = out / "source"
    for part in ("pyproject.toml", "README.md", "src", "workflow/schemas"):
        copy = shutil.copytree if (REPO / part).is_dir() else shutil.copy
        (source / part).parent.mkdir(parents=True, exist_ok=True)
        copy(REPO / part, source / part, **({"symlinks": True} if copy is shutil.copytree else {}))
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "--no-deps", "-q", ".", "-w", str(out / "dist")],
                   cwd=source, check=True, capture_output=True, timeout=600)  # fmt: skip
    (wheel,) = (out / "dist").glob("stagetrain-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "-q", "--target", str(out / "site"), str(wheel)],
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    return wheel, out / "site"


def test_the_wheel_holds_the_schema_and_the_catalog(installed: tuple[Path, Path]) -> None:
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as archive:
        schema = archive.read("stagetrain/schemas/config.schema.yaml")
        catalog = archive.read("stagetrain/hardware/catalog.yaml")
        names = set(archive.namelist())
    # A copy of the one schema file (the package's is a link to it), not a stale second copy.
    assert schema == (REPO / "workflow" / "schemas" / "config.schema.yaml").read_bytes()
    assert catalog == (REPO / "src" / "stagetrain" / "hardware" / "catalog.yaml").read_bytes()
    assert "stagetrain/hardware/detect.py" in names


def test_the_installed_package_validates_a_config_and_runs_the_workflow(
    installed: tuple[Path, Path], workdir: Path
) -> None:
    _, site = installed
    env = {**os.environ, "PYTHONPATH": str(site)}  # ahead of the editable install's path
    code = (
        "import stagetrain, stagetrain.config.validation as c, stagetrain.hardware.catalog as k;"
        "print(stagetrain.__file__); c.load('config/config.yaml'); print(k.gpu_spec('H100').key)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=workdir, env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    first, key = proc.stdout.split()
    assert first.startswith(str(site)) and key == "H100"
    dry = subprocess.run([SNAKEMAKE, "--cores", "2", "-n", "all"], cwd=workdir, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert "consolidate" in dry.stdout + dry.stderr
