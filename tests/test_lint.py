"""Undefined names and unused imports, found without running the code.

Error paths (a host's exit 75 reaching the leader, a storage outage) run rarely; pyflakes
found a missing import in one of them that every other test had missed.
"""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_pyflakes_finds_nothing():
    folders = [str(REPO / name) for name in ("pipeline", "steps", "engine", "scripts", "tests")]
    result = subprocess.run([sys.executable, "-m", "pyflakes", *folders], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
