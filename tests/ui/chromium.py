"""A real headless Chromium for the UI tests and the screenshot script.

The Debian package `chromium` is driven by Python `playwright` through its
`executable_path` (playwright's own browser download is never used: it needs
the internet). Missing Chromium is installed with apt-get when we are root,
as CI is; otherwise the caller fails with a message saying what to install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def ensure_chromium() -> Path:
    """`/usr/bin/chromium`, installed with apt-get if missing; RuntimeError if impossible."""
    if CHROMIUM.exists():
        return CHROMIUM
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError(f"{CHROMIUM} is missing: install the Debian package `chromium` "
                           "(apt-get install -y chromium) to run the UI tests")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (["apt-get", "update", "-q"],
                    ["apt-get", "install", "-y", "-q", "chromium"]):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` failed ({done.returncode}):\n"
                               f"{done.stderr[-2000:]}")
    if not CHROMIUM.exists():
        raise RuntimeError(f"apt-get installed chromium but {CHROMIUM} is still missing")
    return CHROMIUM
