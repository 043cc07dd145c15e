# wsi-milssl for a GPU workstation: CUDA-enabled PyTorch base, the package on top.
#   docker build -t wsi-milssl .
#   docker run --gpus all --ipc=host --user "$(id -u):$(id -g)" -v /path/to/data:/data wsi-milssl tile /data/slides --out /data/patches
# torch 2.14.1 (CUDA 13.0, cuDNN 9) is the version the test suite ran with; the base image provides it.
FROM pytorch/pytorch:2.14.1-cuda13.0-cudnn9-runtime

# Caches go to /tmp, so the image runs as any user (docker run --user "$(id -u):$(id -g)"): a uid without an entry in
# /etc/passwd gets HOME=/ (Triton's cache for `--compile` on a GPU lives under HOME) and no user name (torch's
# inductor cache folder is named after it).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_HOME=/tmp \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor

WORKDIR /opt/wsi-milssl

# 1. The dependencies alone, from pyproject.toml: this layer is rebuilt when they change, not when the code does.
#    torch is pinned to the base image's version, so pip keeps it. EXTRAS: optional dependency groups, comma-separated
#    (docker build --build-arg EXTRAS=timm -t wsi-milssl . for `features --encoder timm:NAME`).
ARG EXTRAS=""
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; deps = p['dependencies'] + [d for e in '${EXTRAS}'.split(',') if e for d in p['optional-dependencies'][e]]; open('/tmp/requirements.txt', 'w').write('\n'.join(deps) + '\n')" \
    && pip install --no-cache-dir "torch==2.14.1" -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# 2. The code, the ready-made pipelines (/opt/wsi-milssl/pipelines) and the docs pages (both also inside the
#    installed package: wsi_milssl/pipelines and wsi_milssl/docs link to them; `wsi-milssl docs` prints a page).
COPY README.md LICENSE ./
COPY wsi_milssl ./wsi_milssl
COPY pipelines ./pipelines
COPY docs ./docs
RUN pip install --no-cache-dir --no-deps . \
    && useradd --create-home --uid 1000 milssl \
    && mkdir -p /data && chmod 1777 /data

USER 1000
WORKDIR /data
ENTRYPOINT ["wsi-milssl"]
CMD ["--help"]
