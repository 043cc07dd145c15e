"""Pipelines: run the stages in order from one TOML file, skipping stages that are up to date."""

from wsi_milssl.pipeline.runner import StageOutcome, run_pipeline, split_train_val
from wsi_milssl.pipeline.spec import (
    RESOLVED_FILENAME,
    SETS,
    STAGES,
    DataSet,
    PipelineSpec,
    load_pipeline,
    resolved_pipeline,
    write_resolved_pipeline,
)

__all__ = ["DataSet", "PipelineSpec", "RESOLVED_FILENAME", "SETS", "STAGES", "StageOutcome", "load_pipeline",
           "resolved_pipeline", "run_pipeline", "split_train_val", "write_resolved_pipeline"]
