# wsi-milssl for a GPU workstation: CUDA-enabled PyTorch base, the package on top.
#   docker build -t wsi-milssl .
#   docker run --gpus all -v /path/to/data:/data wsi-milssl tile /data/slides --out /data/patches
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /opt/wsi-milssl
COPY pyproject.toml README.md ./
COPY wsi_milssl ./wsi_milssl
COPY pipelines ./pipelines
# torch comes from the base image; pip keeps it when it satisfies the range.
RUN pip install --no-cache-dir . \
    && useradd --create-home --uid 1000 milssl \
    && mkdir -p /data && chown milssl /data

USER 1000
WORKDIR /data
ENTRYPOINT ["wsi-milssl"]
CMD ["--help"]
