"""The installed package carries the data files infra/ and envspec/ read (a non-editable `pip install` has nothing
else)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_every_data_file_of_infra_and_envspec(tmp_path: Path) -> None:
    for name in ("pyproject.toml", "README.md", "envspec", "infra", "workloads", "trainer"):
        src = ROOT / name
        (shutil.copytree(src, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
         if src.is_dir() else shutil.copy(src, tmp_path / name))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "w"),
         str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    [wheel] = (tmp_path / "w").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = sorted(p.relative_to(ROOT).as_posix() for package in ("infra", "envspec")
                  for p in (ROOT / package).rglob("*") if p.suffix in (".yaml", ".yml", ".json"))
    assert data and {"infra/offline/tpu_prices.yaml", "envspec/tpu_zones.yaml",
                     "infra/offline/gke_prices.yaml"} <= set(data)
    assert [d for d in data if d not in names] == []
