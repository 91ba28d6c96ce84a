"""Entry point `pulumi up` runs (Pulumi.yaml: `main: infra/`)."""

import sys
from pathlib import Path

# Pulumi runs this file by path; make the repo root importable even without an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.components.program import main  # noqa: E402

main()
