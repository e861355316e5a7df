"""The layering of docs/architecture.md, enforced: imports only point down; the SDK and the load test never import
torch."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    r = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "5 kept, 0 broken" in r.stdout  # pyproject.toml's five contracts


def test_what_clients_reach_loads_no_torch() -> None:
    """At run time too, directly or not: the SDK, its CLI-free modules and the load test import no torch."""
    code = ("import sys, adaptlm_client, adaptlm_client.keysim, loadtest.slo, server.protocol, server.launch; "
            "bad = sorted(m for m in ('torch', 'models', 'kernels', 'fastapi') if m in sys.modules); "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
