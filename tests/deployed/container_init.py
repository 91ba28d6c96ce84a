"""The container runtime's last step, run inside a pod's network namespace (`ip netns exec`, which also gives it a
mount namespace of its own with /etc/netns/<pod>/hosts bound over /etc/hosts): bind the pod's volumes at their
rendered mount paths, make the root read-only when the container asks for it, take the pod's user and groups, go to
the image's working directory and exec the container's command with its env. Nothing of the command is changed.

`python -m tests.deployed.container_init SPEC.json`; SPEC: {"mounts": [[src, dst, read_only]], "read_only_root",
"uid", "gid", "groups", "workdir", "argv", "env", "expose": [paths]}.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def _expose(paths: list[str]) -> None:
    """Make each of `paths` (the interpreter's install, the virtual environment, this checkout: what the image holds
    for the pod's user) reachable where an ancestor is closed to others (pyenv under /root, a clone in a 0700
    folder): in this namespace only, a tmpfs over that ancestor holding those paths alone."""
    by_ancestor: dict[str, list[str]] = {}
    for path in sorted({os.path.realpath(p) for p in paths}, key=len):
        parts = path.split("/")
        for i in range(2, len(parts) + 1):
            ancestor = "/".join(parts[:i])
            if not os.stat(ancestor).st_mode & 0o001:
                if ancestor != path:
                    by_ancestor.setdefault(ancestor, []).append(path)
                break
    for n, (ancestor, inside) in enumerate(sorted(by_ancestor.items())):
        staged = []
        for k, path in enumerate(inside):
            stage = f"/var/tmp/gtr-expose/{n}-{k}"  # empty folders on the host; each namespace mounts over them
            os.makedirs(stage, exist_ok=True)
            _mount("--bind", path, stage)
            staged.append((stage, path))
        _mount("-t", "tmpfs", "-o", "mode=755", "tmpfs", ancestor)
        for stage, path in staged:
            os.makedirs(path, exist_ok=True)
            _mount("--bind", stage, path)


CLONE_NEWPID = 0x20000000


def _pid_one() -> None:
    """The command becomes PID 1 of a PID namespace of its own, as in a container: a signal it has no handler for
    (SIGTERM included) is then ignored, and only SIGKILL ends it. This process stays outside as its parent: it passes
    the runtime's signals on and ends as the command ends (its exit code, or the same signal)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWPID) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWPID)")
    child = os.fork()
    if child == 0:
        # The namespace's own /proc, as a runtime mounts it: with the host's, /proc/<getpid()> is another process or
        # none (psutil.Process(os.getpid()) raises NoSuchProcess: Ray's dashboard modules die of it).
        _mount("-t", "proc", "-o", "nosuid,nodev,noexec", "proc", "/proc")
        return
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda n, _f: os.kill(child, n))
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    # ip netns exec made the mounts slave already; private keeps ours out of the parent namespace for certain.
    _mount("--make-rprivate", "/")
    if spec.get("hostname"):
        socket.sethostname(spec["hostname"])
    _expose(spec.get("expose", []))
    for src, dst, read_only in spec["mounts"]:
        # The mount point is created on the host's file system (an empty folder: the mount itself stays here).
        os.makedirs(dst, exist_ok=True)
        _mount("--bind", src, dst)
        if read_only:
            _mount("-o", "remount,bind,ro", dst)
    if spec["read_only_root"]:
        _mount("-o", "remount,bind,ro", "/")
    _pid_one()
    os.setgroups(spec["groups"])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
    os.chdir(spec["workdir"])
    argv = spec["argv"]
    os.execvpe(argv[0], argv, spec["env"])


if __name__ == "__main__":
    main()
