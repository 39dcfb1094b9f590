"""Every object the base and each overlay render is valid for the Kubernetes API:
`kubernetes-validate --strict` (the API's own schemas; strict: a misspelt or misplaced field
is an error, not silently dropped by the API server)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ebb.common.messaging import identity
from ebb.controller.kube.podspec import credentials_secret

from .manifests import BASE, K8S, OVERLAYS, render
from .test_podspec import GOLDEN

# The oldest Kubernetes release still maintained upstream when this was written, and the
# newest the validator knows.
VERSIONS = ["1.31", "1.37"]

# Custom resources, for which the API has no schema of its own: their operators' CRDs.
CUSTOM_GROUPS = {"monitoring.coreos.com/v1"}


def validator() -> str:
    found = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent))
    assert found, "kubernetes-validate is not installed (the dev extra has it)"
    return found


@pytest.mark.parametrize("root", [BASE, *OVERLAYS], ids=lambda p: str(p.relative_to(K8S)))
@pytest.mark.parametrize("version", VERSIONS)
def test_rendered_manifests_validate_strictly(root: Path, version: str, tmp_path: Path) -> None:
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(render(root))
    done = subprocess.run(
        [validator(), "--strict", "--quiet", "-k", version, str(rendered)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Only a custom resource may go unchecked for want of a schema.
    unchecked = [line for line in done.stdout.splitlines() if line.startswith("WARN")]
    assert all(any(g in line for g in CUSTOM_GROUPS) for line in unchecked), unchecked


def test_the_validator_refuses_a_misplaced_field(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        render(BASE).replace("terminationGracePeriodSeconds:", "terminationGracePeriod:", 1)
    )
    done = subprocess.run(
        [validator(), "--strict", "--quiet", "-k", VERSIONS[-1], str(broken)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode != 0 and "terminationGracePeriod" in done.stdout


def test_there_is_a_prod_overlay() -> None:
    assert K8S / "overlays" / "prod" in OVERLAYS


def test_what_the_controller_creates_validates_strictly(tmp_path: Path) -> None:
    """Its worker pods (the golden ones) and a worker's credentials Secret."""
    pods = [json.loads(p.read_text()) for p in sorted(GOLDEN.glob("worker_pod_*.json"))]
    owned = {**pods[0], "metadata": {**pods[0]["metadata"], "uid": "0d1e2f"}}
    secret = credentials_secret(owned, identity.Trust.new("ebb").worker_signer().credentials("w"))
    made = tmp_path / "made.yaml"
    made.write_text(yaml.safe_dump_all([*pods, secret]))
    for version in VERSIONS:
        done = subprocess.run(
            [validator(), "--strict", "--quiet", "-k", version, str(made)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "WARN" not in done.stdout, done.stdout
