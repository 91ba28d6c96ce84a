"""The one module that imports cdktf: runs in its own venv ($(VENV)/cdktf, tools/cdktf-requirements.txt).

    python -m infra.terraform.cdktf_app OUT DOCUMENT.json [DOCUMENT.json ...]   (from the repository's root)

Each document (infra/terraform/document.py) becomes OUT/<env>/stacks/<stack>/cdk.tf.json through cdktf's prebuilt
provider bindings. Pulumi names arguments as the Terraform provider does, in camelCase, with list blocks pluralised;
each name is matched against the binding's own parameters, so a name the frozen bindings lack fails here, loudly, unless
the document lists it as an override (infra/terraform/document.py OVERRIDES): written raw, with the google provider
pinned to the major version that has it.
"""

from __future__ import annotations

import collections.abc
import importlib
import inspect
import json
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any

from cdktf import (
    App,
    DataResource,
    Fn,
    GcsBackend,
    Precondition,
    TerraformOutput,
    TerraformStack,
    TerraformVariable,
    TerraformVariableValidationConfig,
)
from cdktf_cdktf_provider_google.data_google_container_cluster import DataGoogleContainerCluster
from cdktf_cdktf_provider_google.provider import GoogleProvider
from cdktf_cdktf_provider_helm.provider import HelmProvider, HelmProviderKubernetes, HelmProviderKubernetesExec
from cdktf_cdktf_provider_kubernetes.provider import KubernetesProvider, KubernetesProviderExec
from constructs import Construct

from infra.terraform.refs import REF, references

PACKAGES = {"google": "cdktf_cdktf_provider_google", "helm": "cdktf_cdktf_provider_helm",
            "kubernetes": "cdktf_cdktf_provider_kubernetes"}
# The google provider versions the overrides (infra/terraform/document.py OVERRIDES) need: settings.data_api_access
# arrived in hashicorp/google 7.22.0 (CHANGELOG 7.22.0; absent from resource_sql_database_instance.go at v7.21.0), and
# database_roles earlier (7.19). Every value written is accepted on both sides of 7.33, where deletion_policy became
# the universal field (infra/terraform/document.py TERRAFORM_VALUES), so no later floor. The bindings pin 6.50.0.
GOOGLE_PROVIDER = ">= 7.22, < 8.0"
AUTH_PLUGIN = {"api_version": "client.authentication.k8s.io/v1beta1", "command": "gke-gcloud-auth-plugin"}


class SynthError(Exception):
    pass


def snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _pascal(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def binding(tf_type: str, data: bool = False) -> type:
    """The cdktf class of a Terraform resource (or data source) type: google_sql_user -> SqlUser."""
    provider, _, rest = tf_type.partition("_")
    module, cls = (f"data_{tf_type}", f"Data{_pascal(tf_type)}") if data else (rest, _pascal(rest))
    return getattr(importlib.import_module(f"{PACKAGES[provider]}.{module}"), cls)


def _hints(cls: type) -> dict[str, Any]:
    # A class's own __init__ (mypy's misc check is for an instance's, which a subclass may have replaced).
    return typing.get_type_hints(cls.__init__)  # type: ignore[misc]


def _struct(hint: Any) -> tuple[type | None, bool]:
    """The binding struct a parameter takes (and whether a list of them), or None for a plain value or map."""
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        for arg in typing.get_args(hint):
            found = _struct(arg)
            if found[0] is not None:
                return found
        return None, False
    if origin in (list, tuple, collections.abc.Sequence):
        inner, _ = _struct(typing.get_args(hint)[0]) if typing.get_args(hint) else (None, False)
        return inner, True
    if isinstance(hint, type) and hint.__module__.startswith(tuple(PACKAGES.values())):
        return hint, False
    return None, False


def _param(cls: type, key: str, where: str) -> str:
    params = _hints(cls)
    name = snake(key)
    candidates = [name]
    if name.endswith("ies"):
        candidates.append(name[:-3] + "y")
    if name.endswith("es"):
        candidates.append(name[:-2])
    if name.endswith("s"):
        candidates.append(name[:-1])
    for c in candidates:
        if c in params and c not in ("scope", "id_"):
            return c
    raise SynthError(f"{where}: {cls.__name__} has no such argument (tried {', '.join(candidates)})")


class Renderer:
    def __init__(self, overrides: set[tuple[str, str]]) -> None:
        self.constructs: dict[str, Construct] = {}  # resources, by address: cdktf links them across stacks
        self.local: dict[str, Construct] = {}  # this stack's variables and data sources
        self.overrides = overrides

    # ------------------------------------------------------------ values

    def token(self, address: str, attribute: str) -> str:
        attribute, _, function = attribute.partition("#")
        value = self._token(address, attribute)
        return typing.cast(str, getattr(Fn, function)(value)) if function else value

    def _token(self, address: str, attribute: str) -> str:
        if address.startswith("var."):
            return typing.cast(str, self.local[address].string_value)
        node: Any = self.local.get(address) or self.constructs.get(address)
        if node is None:
            raise SynthError(f"a value refers to {address}, which is not declared")
        for part in filter(None, re.split(r"\.|(?=\[)", attribute)):
            if part.startswith("["):
                node = node.lookup(part[1:-1])
                continue
            name = snake(part)
            if not hasattr(node, name):
                raise SynthError(f"{address} has no attribute {attribute!r} ({name})")
            node = getattr(node, name)
        return typing.cast(str, node)

    def text(self, value: str) -> str:
        """A string as Terraform must read it: its own ${ and %{ escaped, references resolved to tokens."""
        out, last = [], 0
        for m in REF.finditer(value):
            out.append(_escape(value[last:m.start()]))
            out.append(self.token(m.group(1), m.group(2)))
            last = m.end()
        out.append(_escape(value[last:]))
        return "".join(out)

    def raw(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {k: self.raw(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.raw(v) for v in value]
        return value

    def kwargs(self, cls: type, args: dict[str, Any], where: str, tf_type: str, path: str = "",
               overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """Pulumi-named arguments as the binding's keyword arguments, nested structs included."""
        out: dict[str, Any] = {}
        hints = _hints(cls)
        for key, value in args.items():
            here = f"{path}.{key}" if path else key
            if (tf_type, here) in self.overrides and overrides is not None:
                overrides[_tf_path(here)] = self.raw(value)
                continue
            name = _param(cls, key, f"{where}: {here}")
            struct, many = _struct(hints[name])
            if struct is not None and value is not None:
                if many:
                    items = value if isinstance(value, list) else [value]
                    out[name] = [struct(**self.kwargs(struct, v, where, tf_type, here, overrides)) for v in items]
                else:
                    out[name] = struct(**self.kwargs(struct, value, where, tf_type, here, overrides))
            else:
                out[name] = self.raw(value)
        return out

    # ------------------------------------------------------------ resources

    def resource(self, stack: TerraformStack, entry: dict[str, Any]) -> None:
        tf_type, name = entry["type"], entry["name"]
        address = f"{tf_type}.{name}"
        cls = DataResource if tf_type == "terraform_data" else binding(tf_type)
        overrides: dict[str, Any] = {}
        if entry["naming"] == "pulumi":
            args = dict(entry["args"])
            # cls is a class: its own __init__ (as in _hints).
            if "name" not in args and "name" in inspect.signature(cls.__init__).parameters:  # type: ignore[misc]
                # Pulumi names this resource itself (its name plus a random suffix); Terraform gets that name
                # without the suffix rather than a random one of its own.
                args["name"] = entry["autoname"]
            kwargs = self.kwargs(cls, args, address, tf_type, overrides=overrides)
        else:
            kwargs = {k: self.raw(v) for k, v in entry["args"].items()}
            if tf_type == "kubernetes_manifest" and "wait" in kwargs:
                kwargs["wait"] = _manifest_wait(kwargs["wait"])
        life = dict(entry.get("lifecycle") or {})
        if life.get("ignore_changes"):
            life["ignore_changes"] = [self.attribute_path(cls, p, address) for p in life["ignore_changes"]]
        if life.get("precondition"):
            # Written as Terraform expressions (infra/terraform/document.py): wrapped, never escaped.
            life["precondition"] = [Precondition(condition=f"${{{p['condition']}}}", error_message=p["error_message"])
                                    for p in life["precondition"]]
        # cdktf 0.21 writes a construct here as "${terraform_data.x}", which Terraform refuses ("Invalid
        # character": replace_triggered_by takes static references, hashicorp/terraform-cdk#3196, #3645): the
        # addresses go in raw, after the construct exists.
        triggers = list(life.pop("replace_triggered_by", ()))
        if missing := [a for a in triggers if a not in self.constructs]:
            raise SynthError(f"{address}: replace_triggered_by names {missing}, not declared before it")
        if life:
            kwargs["lifecycle"] = life
        if entry.get("timeouts"):
            kwargs["timeouts"] = entry["timeouts"]
        deps = [self.constructs[a] for a in entry.get("depends_on", ())]
        if deps:
            kwargs["depends_on"] = deps
        try:
            # Construct ids are unique per stack, Terraform names per type: a network and its subnetwork share one.
            construct = cls(stack, f"{tf_type}-{name}", **kwargs)
        except TypeError as e:
            raise SynthError(f"{address}: {e}") from None
        construct.override_logical_id(name)
        if triggers:
            construct.add_override("lifecycle.replace_triggered_by", triggers)
        for path, value in overrides.items():
            construct.add_override(path, value)
        self.constructs[address] = construct

    def attribute_path(self, cls: type, path: str, where: str) -> str:
        """A Pulumi property path (settings.diskSize) as Terraform's (settings[0].disk_size)."""
        out, node, parts = [], cls, path.split(".")
        for i, part in enumerate(parts):
            name = _param(node, part, f"{where}: lifecycle {path}")
            struct, _ = _struct(_hints(node)[name])
            out.append(name if i == len(parts) - 1 or struct is None else f"{name}[0]")
            node = struct or node
        return ".".join(out)


def _tf_path(pulumi_path: str) -> str:
    return ".".join(snake(p) for p in pulumi_path.split("."))


def _escape(text: str) -> str:
    return text.replace("${", "$${").replace("%{", "%%{")


def _manifest_wait(wait: dict[str, Any]) -> Any:
    from cdktf_cdktf_provider_kubernetes.manifest import ManifestWait, ManifestWaitCondition
    return ManifestWait(rollout=wait.get("rollout"),
                        condition=[ManifestWaitCondition(**c) for c in wait.get("condition", [])] or None)


def _topological(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_address = {f"{e['type']}.{e['name']}": e for e in entries}
    done: set[str] = set()
    out: list[dict[str, Any]] = []

    def visit(address: str, trail: tuple[str, ...] = ()) -> None:
        if address in done:
            return
        if address in trail:
            raise SynthError(f"a dependency cycle: {' -> '.join((*trail, address))}")
        entry = by_address[address]
        needs = set(entry.get("depends_on", ())) | set((entry.get("lifecycle") or {}).get("replace_triggered_by", ()))
        needs |= {a for a in references(entry["args"]) if a in by_address}
        for dep in sorted(needs):
            if dep in by_address:
                visit(dep, (*trail, address))
        done.add(address)
        out.append(entry)

    for address in by_address:
        visit(address)
    return out


def _cluster_access(stack: TerraformStack, cluster: dict[str, Any]) -> None:
    """The Kubernetes and Helm providers of a stack that runs after the cluster exists: its endpoint from a data
    source, credentials from gke-gcloud-auth-plugin (as the Pulumi program's kubeconfig), so no token lands in the
    plan."""
    found = DataGoogleContainerCluster(stack, "cluster", name=cluster["name"], location=cluster["location"],
                                       project=cluster["project"])
    if cluster["dns_endpoint"]:
        host = f"https://{found.control_plane_endpoints_config.get(0).dns_endpoint_config.get(0).endpoint}"
        ca = None  # the DNS endpoint serves a publicly trusted certificate
    else:
        host = f"https://{found.endpoint}"
        ca = Fn.base64decode(found.master_auth.get(0).cluster_ca_certificate)
    KubernetesProvider(stack, "kubernetes", host=host, cluster_ca_certificate=ca,
                       exec=[KubernetesProviderExec(**AUTH_PLUGIN)])
    HelmProvider(stack, "helm", kubernetes=HelmProviderKubernetes(
        host=host, cluster_ca_certificate=ca, exec=HelmProviderKubernetesExec(**AUTH_PLUGIN)))


def render(app_dir: Path, document: dict[str, Any]) -> App:
    app_dir.mkdir(parents=True, exist_ok=True)
    app = App(outdir=str(app_dir), skip_validation=False)
    backend, providers = document["backend"], document["providers"]
    renderer = Renderer({(t, p) for t, p in document["overrides"]})
    for stage, content in document["stacks"].items():
        stack = TerraformStack(app, stage)
        renderer.local = {}
        GcsBackend(stack, bucket=backend["bucket"], prefix=f"{backend['prefix']}/{stage}")
        GoogleProvider(stack, "google", project=providers["google"]["project"], region=providers["google"]["region"])
        if stage != "gcp":
            _cluster_access(stack, providers["cluster"])
        stack.add_override("terraform.required_providers.google.version", GOOGLE_PROVIDER)
        for name, var in sorted(content["variables"].items()):
            validation = var.get("validation")
            renderer.local[f"var.{name}"] = TerraformVariable(
                stack, name, type=var["type"], description=var.get("description"), sensitive=var.get("sensitive"),
                validation=[TerraformVariableValidationConfig(
                    condition=f"${{{validation['condition']}}}", error_message=validation["error_message"])]
                if validation else None)
        for address, data in sorted(content["data"].items()):
            _, tf_type, name = address.split(".")
            cls = binding(tf_type, data=True)
            renderer.local[address] = cls(stack, name, **renderer.kwargs(cls, data["args"], address, tf_type))
        for entry in _topological(content["resources"]):
            renderer.resource(stack, entry)
        for key, value in sorted(content["outputs"].items()):
            TerraformOutput(stack, key, value=renderer.raw(value))
    return app


def main(argv: list[str]) -> int:
    """Every document is rendered, a refused one too: the errors name each refused environment, and the others are
    written (`synth --all` reports every broken environment at once)."""
    out, code = Path(argv[0]), 0
    for doc_path in argv[1:]:
        document = json.loads(Path(doc_path).read_text())
        try:
            render(out / document["env"], document).synth()
        except SynthError as e:
            print(f"gke-tpu-rl synth {document['env']}: {e}", file=sys.stderr)
            code = 2
    return code


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the jsii kernel's node process would otherwise keep the interpreter waiting
