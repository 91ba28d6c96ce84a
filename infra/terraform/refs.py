"""What infra/terraform/document.py (the project's venv) and infra/terraform/cdktf_app.py (the cdktf venv) both read:
the stacks and the reference format in the document one hands the other. Standard library only: both venvs import it."""

from __future__ import annotations

import re
from typing import Any

# The stacks of an environment, in the order they are applied.
STAGES = ("gcp", "controllers", "workloads")
# A reference inside a value: ⟦tf:ADDRESS|ATTRIBUTE⟧, the attribute as the Pulumi program names it (camelCase, dots
# for nesting, [KEY] for a map entry, then #FUNCTION for a Terraform function of it); cdktf_app resolves it to the
# construct's own attribute.
REF = re.compile("\u27e6tf:([^|\u27e7]+)\\|([^\u27e7]*)\u27e7")


def ref(address: str, attribute: str = "") -> str:
    return f"\u27e6tf:{address}|{attribute}\u27e7"


def references(value: Any) -> set[str]:
    """The addresses a value (strings, nested in dicts and lists) refers to."""
    if isinstance(value, str):
        return {m.group(1) for m in REF.finditer(value)}
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return set().union(*(references(v) for v in items))
