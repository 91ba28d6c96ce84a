"""The one harness that runs the real Pulumi program under mocks and records what it registers.

`run_stack` is what `gke-tpu-rl plan` and the mock tests both use: it feeds a stack config map to the
Pulumi runtime the way the CLI would, runs `infra.components.program.main()` inside a root Stack (as the language host
does for `pulumi up`), waits for every output, and returns the resources and stack outputs it saw.
Each run happens in a copied `contextvars` context, so the Pulumi settings, config and root stack it sets
never leak into the caller or the next run.
"""

from __future__ import annotations

import base64
import contextvars
import hashlib
import importlib
import json
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pulumi
from pulumi.runtime import mocks as pmocks
from pulumi.runtime import rpc, settings
from pulumi.runtime.config import set_all_config
from pulumi.runtime.stack import run_in_stack
from pulumi.runtime.sync_await import _sync_await

from envspec.config import EnvironmentSpec
from infra.base import stack_config

PROJECT = "gke-tpu-rl"
SECRET_MASK = "[secret]"
# Stands in for `{secure: ...}` values: ciphertext cannot be decrypted without the stack's secrets provider.
SECURE_PLACEHOLDER = "<secure value: not decrypted offline>"
STACK_TYPE = "pulumi:pulumi:Stack"
# Fake endpoint from TEST-NET-3 (RFC 5737): never a real address.
MOCK_ENDPOINT = "203.0.113.10"
IMAGE_TYPE = "docker-build:index:Image"  # the trainer image the stack builds (infra/components/image.py)
MOCK_VERSION_SUFFIX = "-gke.99999"  # the GKE versions the mocked lookup offers: plausible, visibly not a release
# The DNS endpoint's shape (gke-<uid>.<region>.gke.goog) under the reserved .invalid TLD (RFC 2606).
MOCK_DNS_SUFFIX = "mock.gke.goog.invalid"
MOCK_CA = base64.b64encode(b"mock-cluster-ca").decode()


@dataclass(frozen=True)
class Resource:
    """One registered resource: inputs are as the engine got them, secrets masked, integral floats made ints."""

    urn: str
    type: str
    name: str
    parent: str | None  # parent URN; the stack's URN for top-level resources
    custom: bool
    inputs: dict[str, Any]
    id: str | None = None
    # Resource options the engine acts on: protect, retainOnDelete, provider, dependsOn (URNs), when set.
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def is_component(self) -> bool:
        return not self.custom

    def to_json(self) -> dict[str, Any]:
        return {"urn": self.urn, "type": self.type, "name": self.name, "parent": self.parent,
                "custom": self.custom, "inputs": self.inputs, "options": self.options}


@dataclass(frozen=True)
class PlanResult:
    env: str
    spec: EnvironmentSpec
    stack_urn: str
    resources: list[Resource]  # depth-first from the stack, siblings sorted by (type, name): deterministic
    outputs: dict[str, Any]  # stack outputs, secrets masked
    secret_outputs: frozenset[str] = field(default_factory=frozenset)

    def of_type(self, type_: str) -> list[Resource]:
        return [r for r in self.resources if r.type == type_]

    def get(self, type_: str, name: str) -> Resource:
        for r in self.resources:
            if r.type == type_ and r.name == name:
                return r
        raise KeyError(f"no {type_} named {name!r}; have {[r.name for r in self.of_type(type_)]}")

    def children(self, urn: str) -> list[Resource]:
        return [r for r in self.resources if r.parent == urn]

    def ancestors(self, resource: Resource) -> list[Resource]:
        by_urn = {r.urn: r for r in self.resources}
        chain: list[Resource] = []
        parent = resource.parent
        while parent in by_urn:
            chain.append(by_urn[parent])
            parent = by_urn[parent].parent
        return chain


# ---------------------------------------------------------------- value clean-up


def _unwrap_secrets(value: Any) -> Any:
    if rpc.is_rpc_secret(value):
        return _unwrap_secrets(value["value"])
    if isinstance(value, dict):
        return {k: _unwrap_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unwrap_secrets(v) for v in value]
    return value


def _mask_leaves(value: Any) -> Any:
    # Keep the shape (keys, list lengths) so a masked Secret still reads like one; hide every leaf.
    if isinstance(value, dict):
        return {k: _mask_leaves(v) for k, v in sorted(_unwrap_secrets(value).items())}
    if isinstance(value, list):
        return [_mask_leaves(v) for v in value]
    return SECRET_MASK


def clean(value: Any) -> Any:
    """Masks secrets, turns the floats mocks give back for integers into ints, sorts keys, drops `__` keys."""
    if rpc.is_rpc_secret(value):
        return _mask_leaves(value["value"])
    if isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        # Sorted keys: the wire format does not keep the program's order, and plans must be reproducible.
        return {k: clean(value[k]) for k in sorted(value) if not k.startswith("__")}
    if isinstance(value, list):
        return [clean(v) for v in value]
    if isinstance(value, pulumi.Resource):  # a resource reference input
        return f"<resource {type(value).__name__}>"
    return value


# ---------------------------------------------------------------- mocks


def _fake_state(type_: str, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """Provider-computed outputs a program may read (endpoint, URLs, e-mails), so every output resolves."""
    state = dict(inputs)
    if type_.startswith("gcp:"):
        state.setdefault("name", name)
        state.setdefault("selfLink", f"https://www.googleapis.com/mock/{type_}/{state['name']}")
        project = inputs.get("project", "mock-project")
        if type_ == "gcp:container/cluster:Cluster":
            dns = (inputs.get("controlPlaneEndpointsConfig") or {}).get("dnsEndpointConfig")
            if dns is not None:
                state["controlPlaneEndpointsConfig"] = {
                    **inputs["controlPlaneEndpointsConfig"],
                    "dnsEndpointConfig": {**dns, "endpoint": f"gke-mock-{name}.{MOCK_DNS_SUFFIX}"}}
            state.update(endpoint=MOCK_ENDPOINT, masterAuth={"clusterCaCertificate": MOCK_CA},
                         masterVersion=inputs.get("minMasterVersion") or "1.34.1-gke.1829001")
        elif type_ == "gcp:storage/bucket:Bucket":
            state.update(url=f"gs://{state['name']}")
        elif type_ == "gcp:serviceaccount/account:Account":
            state.update(email=f"{inputs.get('accountId', name)}@{project}.iam.gserviceaccount.com",
                         member=f"serviceAccount:{inputs.get('accountId', name)}@{project}.iam.gserviceaccount.com")
        elif type_ == "gcp:artifactregistry/repository:Repository":
            state.setdefault("repositoryId", name)
    elif type_ == IMAGE_TYPE:
        # A stable fake digest of what the build was asked for; a real build's digest is its content's.
        digest = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()
        state.update(digest=f"sha256:{digest}", ref=f"{(inputs.get('tags') or [name])[0]}@sha256:{digest}")
    elif type_.startswith("kubernetes:"):
        meta = dict(inputs.get("metadata") or {})
        meta.setdefault("name", name)
        state["metadata"] = meta
        if type_.startswith("kubernetes:helm.sh/"):
            state["status"] = {"name": inputs.get("name", name), "namespace": inputs.get("namespace", "default"),
                               "chart": inputs.get("chart"), "version": inputs.get("version"),
                               "status": "deployed", "revision": 1}
    return state


class PlanMocks(pmocks.Mocks):
    """Fake ids and provider state; data-source calls echo their arguments plus a few well-known fields."""

    def new_resource(self, args: pmocks.MockResourceArgs) -> tuple[str | None, dict[str, Any]]:
        return f"{args.name}-id", _fake_state(args.typ, args.name, _unwrap_secrets(args.inputs))

    # A plain dict: MockMonitor.Invoke cannot take (result, None) for "no failures".
    def call(self, args: pmocks.MockCallArgs) -> dict[str, Any]:  # type: ignore[override]
        out = dict(args.args)
        if args.token == "gcp:organizations/getProject:getProject":
            out.update(number="123456789012", projectId=args.args.get("projectId", "mock-project"))
        elif args.token == "gcp:container/getEngineVersions:getEngineVersions":
            # Channel versions with patch 99: plausible for the checks, and visibly not a real GKE release.
            prefix = args.args.get("versionPrefix") or ""
            defaults = {"RAPID": f"1.35.99{MOCK_VERSION_SUFFIX}", "REGULAR": f"1.34.99{MOCK_VERSION_SUFFIX}",
                        "STABLE": f"1.33.99{MOCK_VERSION_SUFFIX}"}
            latest = {ch: f"{prefix}99{MOCK_VERSION_SUFFIX}" if prefix else v for ch, v in defaults.items()}
            out.update(releaseChannelDefaultVersion=defaults, releaseChannelLatestVersion=latest,
                       defaultClusterVersion=defaults["REGULAR"], latestMasterVersion=defaults["RAPID"])
        elif args.token == "gcp:organizations/getClientConfig:getClientConfig":
            out.update(accessToken="mock-access-token", project="mock-project")
        return out


@dataclass
class _Registration:
    seq: int
    urn: str
    type: str
    name: str
    parent: str | None
    custom: bool
    inputs: dict[str, Any]
    id: str | None
    options: dict[str, Any]


def _options(request: Any) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if request.protect:
        opts["protect"] = True
    if request.retainOnDelete:
        opts["retainOnDelete"] = True
    if request.provider:
        opts["provider"] = request.provider.split("::")[0]  # "<provider urn>::<id>"; the id is fake here
    if request.dependencies:
        opts["dependsOn"] = sorted(set(request.dependencies))
    # What `pulumi up` does on the next change: replace instead of update, delete first, how long it waits.
    if request.replaceOnChanges:
        opts["replaceOnChanges"] = list(request.replaceOnChanges)
    if request.deleteBeforeReplace:
        opts["deleteBeforeReplace"] = True
    if request.ignoreChanges:
        opts["ignoreChanges"] = list(request.ignoreChanges)
    timeouts = request.customTimeouts
    if timeouts and (timeouts.create or timeouts.update or timeouts.delete):
        opts["customTimeouts"] = {k: v for k in ("create", "update", "delete") if (v := getattr(timeouts, k))}
    return opts


class RecordingMonitor(pmocks.MockMonitor):
    """A MockMonitor that keeps each registration's parent (URNs alone cannot rebuild the tree) and the
    stack outputs the program registers."""

    def __init__(self, mocks: pmocks.Mocks) -> None:
        super().__init__(mocks)
        self._lock = threading.Lock()
        self.registrations: list[_Registration] = []
        self.stack_urn: str | None = None
        self.stack_outputs: dict[str, Any] = {}

    def RegisterResource(self, request: Any) -> Any:  # noqa: N802 (gRPC method name)
        response = super().RegisterResource(request)
        if request.type == STACK_TYPE:
            self.stack_urn = response.urn
            return response
        pmocks._ensure_event_loop()
        inputs = rpc.deserialize_properties(request.object)
        with self._lock:
            self.registrations.append(_Registration(
                seq=len(self.registrations), urn=response.urn, type=request.type, name=request.name,
                parent=request.parent or None, custom=bool(request.custom), inputs=inputs,
                id=response.id or None, options=_options(request)))
        return response

    def RegisterResourceOutputs(self, request: Any) -> Any:  # noqa: N802
        if request.urn == self.stack_urn:
            pmocks._ensure_event_loop()
            self.stack_outputs = rpc.deserialize_properties(request.outputs)
        return super().RegisterResourceOutputs(request)


# ---------------------------------------------------------------- config


def _namespaced(key: str) -> str:
    return key if ":" in key else f"{PROJECT}:{key}"


def _strip_secure(value: Any) -> tuple[Any, bool]:
    """Replaces `{secure: ...}` (anywhere in a value) with a placeholder; says whether it found one."""
    if isinstance(value, dict):
        if set(value) == {"secure"}:
            return SECURE_PLACEHOLDER, True
        found = False
        out = {}
        for k, v in value.items():
            out[k], f = _strip_secure(v)
            found |= f
        return out, found
    if isinstance(value, list):
        items = [_strip_secure(v) for v in value]
        return [v for v, _ in items], any(f for _, f in items)
    return value, False


def _as_config_string(value: Any) -> str:
    # The CLI hands every config value to the program as a string; structured ones as JSON.
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


def runtime_config(config: Mapping[str, Any], secret_keys: Iterable[str] = ()) -> tuple[dict[str, str], list[str]]:
    """A stack file's `config:` map as the Pulumi runtime sees it: namespaced keys, string values, secret keys.

    Keys without a namespace get `gke-tpu-rl:`. `{secure: ...}` values become a placeholder marked secret."""
    values: dict[str, str] = {}
    secrets = {_namespaced(k) for k in secret_keys}
    for key, raw in config.items():
        full = _namespaced(key)
        value, secure = _strip_secure(raw)
        if secure:
            secrets.add(full)
        values[full] = _as_config_string(value)
    return values, sorted(secrets)


# ---------------------------------------------------------------- running

_NOT_A_STACK = object()


def _default_program() -> None:
    importlib.import_module("infra.components.program").main()


def _tree_order(regs: list[_Registration], stack_urn: str) -> list[_Registration]:
    # Registration order varies with thread scheduling; a sorted depth-first walk does not.
    kids: dict[str | None, list[_Registration]] = {}
    urns = {r.urn for r in regs}
    for r in regs:
        parent = r.parent if r.parent in urns else stack_urn
        kids.setdefault(parent, []).append(r)
    out: list[_Registration] = []

    def walk(urn: str) -> None:
        for child in sorted(kids.get(urn, []), key=lambda r: (r.type, r.name)):
            out.append(child)
            walk(child.urn)

    walk(stack_urn)
    return out


def _run_in_fresh_context(env: str, values: dict[str, str], secrets: list[str], program: Callable[[], Any],
                          monitor: RecordingMonitor) -> EnvironmentSpec:
    # Everything below sets context variables; the caller runs us in a copied context.
    settings.reset_options(project=PROJECT, stack=env, preview=False)
    set_all_config(values, secrets)
    # set_mocks creates and finishes a root Stack of its own when none is set; a placeholder prevents
    # that, so the only Stack is the one run_in_stack makes (as for `pulumi up`), which registers outputs.
    settings.ROOT.set(_NOT_A_STACK)  # type: ignore[arg-type]  # a placeholder, not a Stack
    pulumi.runtime.set_mocks(monitor.mocks, project=PROJECT, stack=env, preview=False, monitor=monitor)
    settings.ROOT.set(None)
    settings.SETTINGS.outputs = set()  # MockSettings leaves this unset; never share the caller's
    _sync_await(run_in_stack(program))
    # The program validated the same config before registering anything; read the spec it used.
    return stack_config.load_spec()


def run_stack(env: str, config: Mapping[str, Any], secret_keys: Iterable[str] = (), *,
              program: Callable[[], Any] | None = None, monitor: RecordingMonitor | None = None,
              mask_secrets: bool = True) -> PlanResult:
    """Runs the Pulumi program for stack `env` under mocks and returns what it registered.

    config: a stack file's `config:` map (`gke-tpu-rl:key` or bare `key` -> value, structured values as
    dicts/lists, `{secure: ...}` allowed). secret_keys: further keys to mark secret (e.g. a plain test token).
    program: defaults to `infra.components.program.main`, what `pulumi up` runs. monitor: pass one to inspect the
    registrations even when the program raises (e.g. ConfigError, which propagates as `pulumi up` gets it: a
    StackConfigError, infra/base/stack_config.py). mask_secrets=False keeps secret inputs' values (the Terraform
    renderer runs with references in place of secrets, which it must keep).
    """
    values, secrets = runtime_config(config, secret_keys)
    monitor = monitor or RecordingMonitor(PlanMocks())
    spec = contextvars.copy_context().run(
        _run_in_fresh_context, env, values, secrets, program or _default_program, monitor)
    stack_urn = monitor.stack_urn or f"urn:pulumi:{env}::{PROJECT}::{STACK_TYPE}::{PROJECT}-{env}"
    resources = [
        Resource(urn=r.urn, type=r.type, name=r.name, parent=r.parent or stack_urn, custom=r.custom,
                 inputs=clean(r.inputs if mask_secrets else _unwrap_secrets(r.inputs)), id=r.id, options=r.options)
        for r in _tree_order(monitor.registrations, stack_urn)
    ]
    raw_outputs = monitor.stack_outputs
    return PlanResult(
        env=env, spec=spec, stack_urn=stack_urn, resources=resources,
        outputs={k: clean(v) for k, v in sorted(raw_outputs.items())},
        secret_outputs=frozenset(k for k, v in raw_outputs.items() if rpc.is_rpc_secret(v)))
