"""Bundled Hugging Face `config.json` files of public models (trainer/presets/<repo name>.json).

They let `gke-tpu-rl fit` size a run whose checkpoint is not on this machine: `--model qwen3-8b`, or an
`init.path` whose last component names a preset (`/checkpoints/models/Qwen3-8B`). Sources: presets/README.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"


def names() -> list[str]:
    """The bundled model names (Hugging Face repository names), sorted."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def find(name: str) -> str | None:
    """The preset matching `name` case-insensitively (a bare name or a path ending in one), else None."""
    key = Path(name.strip().rstrip("/")).name.lower()
    return next((n for n in names() if n.lower() == key), None)


def hf_config(name: str) -> dict[str, Any]:
    """The config.json of preset `name` (any case); raises KeyError listing the presets."""
    found = find(name)
    if found is None:
        raise KeyError(f"unknown model {name!r}; bundled: {', '.join(names())}")
    return json.loads((PRESET_DIR / f"{found}.json").read_text())
