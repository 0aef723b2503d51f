"""What a set-up script may not touch: the system tools it must not run and the system folders it must not write.

``forbidding`` makes a folder of stand-ins for the system tools, each recording its call and failing, to put first
on PATH; ``snapshot`` lists the entries directly in the system folders a set-up could write to. Shared by
tests/project/test_setup_scripts.py (the scripts with stand-in Python) and tests/project/test_docs.py (the real demo
from a fresh clone).
"""

from __future__ import annotations

import os
from pathlib import Path

SYSTEM_TOOLS = ("apt-get", "apt", "dpkg", "sudo", "podman", "runc", "mmdebstrap", "chromium", "nft", "docker-compose")
WATCHED = (Path("/usr/local/bin"), Path("/usr/local/sbin"), Path("/usr/local/lib"), Path("/etc"),
           Path("/etc/containers"))


def script(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def forbidding(bin_dir: Path, logs: Path, tools: tuple[str, ...] = SYSTEM_TOOLS) -> None:
    """Stand-ins for ``tools`` in ``bin_dir``: each appends its call to ``logs/system`` and fails (status 97);
    ``apt-get update`` succeeds, so that the install it guards is tried (and fails)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    for tool in tools:
        update_ok = '[ "$1" = update ] && exit 0\n' if tool == "apt-get" else ""
        script(bin_dir / tool, f'echo "{tool} $*" >> "{logs}/system"\n{update_ok}'
               f'echo "stand-in {tool}: refused" >&2\nexit 97\n')


def system_calls(logs: Path) -> list[str]:
    path = logs / "system"
    return path.read_text().splitlines() if path.exists() else []


def snapshot() -> dict[str, tuple[int, int]]:
    """Name -> (mtime_ns, size) of every entry directly in the system folders a set-up could write to."""
    seen: dict[str, tuple[int, int]] = {}
    for folder in WATCHED:
        if folder.is_dir():
            for entry in os.scandir(folder):
                st = entry.stat(follow_symlinks=False)
                seen[entry.path] = (st.st_mtime_ns, st.st_size)
    return seen
