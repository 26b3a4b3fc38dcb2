"""What `pip install genq` puts on a machine: one top-level name, `genq`, with every role under it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("producer", "worker", "collector", "checker", "outputs", "sim")


def test_the_wheel_installs_one_name_holding_every_role(tmp_path):
    """The wheel's top_level.txt names genq alone, every file it installs is under genq/ (the roles'
    folders, linked into genq/ in the repository, are real files in it), and its scripts point there."""
    # A copy of the sources (the links kept as links): building in place would leave build/ behind.
    src = tmp_path / "src"
    shutil.copytree(
        ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(".*", "build", "out", "out-*", "*.egg-info")
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--quiet",
            "--wheel-dir",
            str(tmp_path),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (wheel,) = tmp_path.glob("genq-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        info = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert zf.read(info).decode().split() == ["genq"]
        scripts = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    installed = [n for n in names if ".dist-info/" not in n]
    assert all(n.startswith("genq/") for n in installed), [n for n in installed if not n.startswith("genq/")]
    for role in ROLES:
        ours = {n.removeprefix(f"genq/{role}/") for n in installed if n.startswith(f"genq/{role}/")}
        assert ours == {p.name for p in (ROOT / role).glob("*.py")}, role
    assert (
        "genq = genq.commands.cli:main" in scripts and "enqueue = genq.producer.cli:enqueue_main" in scripts
    )
