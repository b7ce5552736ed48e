"""Shared by all unit tests."""
import os
import shutil
import subprocess

import pytest


@pytest.fixture
def namespaces():
    """Skip where the machine cannot make namespaces at all (not root, and no unprivileged user
    namespaces); a broken sandbox on a capable machine still fails the tests."""
    missing = [tool for tool in ("unshare", "setpriv") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"util-linux {' and '.join(missing)} not installed")
    if os.geteuid() == 0:
        return
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "true"], capture_output=True,
                           text=True)
    if probe.returncode != 0:
        pytest.skip(f"no unprivileged user namespaces here: {probe.stderr.strip()}")
