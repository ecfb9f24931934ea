"""`bentoml build` makes a bento holding both models and a Dockerfile."""

from __future__ import annotations

import subprocess
import tarfile
import sys
from pathlib import Path

from tests.support import ROOT

BENTOML = str(Path(sys.executable).with_name("bentoml"))


def test_bentoml_build_packs_models_and_dockerfile(tmp_path):
    build = subprocess.run([BENTOML, "build", "--output", "tag"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr
    tag = build.stdout.strip().splitlines()[-1].removeprefix("__tag__:")
    try:
        from bentoml.bentos import get

        bento = get(tag)
        assert {model.tag.name for model in bento.info.all_models} == {"rampart-primary", "rampart-fallback"}
        bento_path = Path(bento.path)
        dockerfile = bento_path / "env" / "docker" / "Dockerfile"
        assert dockerfile.is_file() and "bentoml" in dockerfile.read_text().lower()
        packed = {"service.py", "runners/primary.py", "inference/engines.py", "inference/architectures.py"}
        assert all((bento_path / "src" / path).is_file() for path in packed), packed
        requirements = (bento_path / "env" / "python" / "requirements.txt").read_text()
        assert "bentoml==1.4.29" in requirements and "torch==2.14.1" in requirements
        # The exported archive (what `bentoml containerize` and `bentoml push` ship) carries the model files.
        # Exported as a plain tar: the same files as a .bento (a gzipped tar), without the minute that
        # gzip spends on the incompressible weights on 2 cores.
        archive = tmp_path / "rampart.tar"
        subprocess.run([BENTOML, "export", tag, str(archive)], capture_output=True, check=True, timeout=300)
        with tarfile.open(archive) as tar:
            names = [name.removeprefix("./") for name in tar.getnames()]
        for stored, weights in (("rampart-primary", "weights.pt"), ("rampart-fallback", "model.onnx")):
            assert any(n.startswith(f"models/{stored}/") and n.endswith(weights) for n in names), f"{stored} not in the bento"
        assert "env/docker/Dockerfile" in names
    finally:
        subprocess.run([BENTOML, "delete", "-y", tag], capture_output=True)
