"""Where a pod runs on this machine: its own Linux network namespace on one bridge (the pod network), its own mount
namespace (its volumes at their rendered paths, /etc/hosts from the cluster's DNS), the pod's user, and the image's
working directory and environment.

The one mapping between cluster and machine (documented here, applied nowhere else):
- The pod network is the bridge BRIDGE with HOST_IP in the root namespace; pod i gets POD_NET.<i // 250>.<i % 250 + 2>.
  Every pod, host-network ones too, has a namespace of its own: a host-network pod's namespace stands for its node
  (on GKE each TPU host is a node of its own, so its address is that node's).
- DNS: the names the cluster's DNS gives a pod (JobSet's <hostname>.<subdomain>, with and without
  .<namespace>.svc.cluster.local) and the GCP stand-ins' host names, as lines of each pod's /etc/hosts.
- Services: a TCP proxy on 127.0.0.1 of this machine per Service port (tests/deployed/cluster.py), to Ready pods.
- The image: `python` is this checkout's virtual environment (the package the image pip-installs), the image's
  WORKDIR (/home/trainer) and its ENV; each container's own writable layer is a folder of its own.

Needs root (network namespaces, veths, bind mounts): the harness refuses to start without it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BRIDGE = "gtrbr0"
POD_NET = "10.211"
HOST_IP = f"{POD_NET}.0.1"
PREFIX = 16
# The image (trainer/Dockerfile): its user, working directory and ENV.
IMAGE_UID = 10001
IMAGE_WORKDIR = "/home/trainer"
INIT_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)}
IMAGE_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "PIP_NO_CACHE_DIR": "1",
             "PIP_DISABLE_PIP_VERSION_CHECK": "1", "HOME": IMAGE_WORKDIR}


def exposed() -> list[str]:
    """What the image holds for a pod's user, here: the interpreter's install, the virtual environment, this
    checkout."""
    return [sys.base_prefix, sys.prefix, str(ROOT)]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def can_run() -> str | None:
    """None when this machine can run pods; else why not."""
    if os.geteuid() != 0:
        return "the as-deployed harness needs root (network namespaces, veths, bind mounts)"
    if shutil.which("ip") is None or shutil.which("mount") is None:
        return "the as-deployed harness needs iproute2's `ip` and util-linux's `mount`"
    return None


class Network:
    """The bridge and the pods' namespaces; `close` removes all of them."""

    def __init__(self) -> None:
        self.namespaces: list[str] = []
        self._next = 0
        self.close()  # a previous run that was killed may have left its bridge
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{HOST_IP}/{PREFIX}", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")

    def add(self, name: str) -> str:
        """A new namespace on the bridge; its address."""
        i = self._next
        self._next += 1
        addr = f"{POD_NET}.{i // 250 + 1}.{i % 250 + 2}"
        ns, veth = f"gtr-{name}", f"gtrv{i}"
        _ip("netns", "del", ns, check=False)
        _ip("link", "del", veth, check=False)  # a namespace still held by a dying process keeps its pair alive
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", BRIDGE, "up")
        for args in (("addr", "add", f"{addr}/{PREFIX}", "dev", "eth0"), ("link", "set", "eth0", "up"),
                     ("link", "set", "lo", "up"), ("route", "add", "default", "via", HOST_IP)):
            _ip("-n", ns, *args)
        return addr

    def close(self) -> None:
        listed = _ip("netns", "list", check=False).stdout.split("\n")
        for line in listed:
            ns = line.split(" ")[0]
            if ns.startswith("gtr-"):
                _ip("netns", "del", ns, check=False)
                shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        # Deleting the root end of each veth destroys the pair now, whatever still holds the pod's namespace.
        for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
            link = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
            if link.startswith("gtrv"):
                _ip("link", "del", link, check=False)
        _ip("link", "del", BRIDGE, check=False)
        self.namespaces.clear()


@dataclass
class Container:
    """One container as the runtime starts it: the process and where its output goes."""

    name: str
    argv: list[str]
    env: dict[str, str]
    mounts: list[tuple[str, str, bool]]
    read_only_root: bool
    uid: int
    gid: int
    groups: list[int]
    workdir: str
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    exit_code: int | None = None
    restarts: int = 0
    extra: dict[str, str] = field(default_factory=dict)
    hostname: str = ""

    def _init(self, namespace: str, spec: Path, argv: list[str]) -> list[str]:
        spec.write_text(json.dumps({"mounts": self.mounts, "read_only_root": self.read_only_root, "uid": self.uid,
                                    "gid": self.gid, "groups": self.groups, "workdir": self.workdir,
                                    "argv": argv, "env": self.env, "expose": exposed(),
                                    "hostname": self.hostname}))
        # Its own UTS namespace too: the pod's hostname, as the runtime sets it (gloo resolves gethostname()).
        return ["ip", "netns", "exec", namespace, "unshare", "--uts", sys.executable, "-m",
                "tests.deployed.container_init", str(spec)]

    def start(self, namespace: str, spec_dir: Path) -> None:
        out = self.log.open("ab")
        # PYTHONPATH only for the init step itself (it is a module of this checkout); the container's env is its own.
        self.proc = subprocess.Popen(self._init(namespace, spec_dir / f"{self.name}.json", self.argv), cwd=ROOT,
                                     stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=INIT_ENV)
        out.close()
        self.exit_code = None

    def exec(self, namespace: str, spec_dir: Path, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """`kubectl exec`: another process in the container (its env, mounts, user and namespaces), to its end."""
        return subprocess.run(self._init(namespace, spec_dir / f"{self.name}-exec.json", argv), cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout, env=INIT_ENV)

    def poll(self) -> int | None:
        """The exit code as the runtime reports it (128 + n for a death by signal n), once it has exited."""
        if self.proc is None:
            return self.exit_code
        rc = self.proc.poll()
        if rc is not None and self.exit_code is None:
            self.exit_code = 128 - rc if rc < 0 else rc
        return self.exit_code

    def signal(self, sig: int) -> None:
        """As the runtime signals a container: SIGTERM to its main process only (`ip netns exec` and the init step
        exec, so that is the command itself); SIGKILL to every process of it (they die with its namespaces)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                if sig == signal.SIGKILL:
                    os.killpg(self.proc.pid, sig)
                else:
                    os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


# The name mapping (write_hosts) is /etc/hosts, which the system resolver reads. gRPC's default c-ares resolver goes
# to the DNS server first and waits out the host's unreachable one; the cluster's DNS would answer it at once. gRPC's
# own switch to the system resolver (GRPC_DNS_RESOLVER) makes Ray's GCS client read the same mapping.
NAME_MAPPING_ENV = {"GRPC_DNS_RESOLVER": "native"}


def write_hosts(namespace: str, hosts: dict[str, str]) -> None:
    """/etc/netns/<ns>/hosts, which `ip netns exec` binds over /etc/hosts."""
    folder = Path("/etc/netns") / namespace
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
    by_ip: dict[str, list[str]] = {}
    for name, ip in hosts.items():
        by_ip.setdefault(ip, []).append(name)
    lines += [f"{ip} {' '.join(names)}" for ip, names in by_ip.items()]
    (folder / "hosts").write_text("\n".join(lines) + "\n")
