"""Pipelines: run the stages in order from one TOML file, skipping stages that are up to date."""

from wsi_milssl.pipeline.runner import StageOutcome, run_pipeline, split_train_val
from wsi_milssl.pipeline.spec import SETS, STAGES, DataSet, PipelineSpec, load_pipeline

__all__ = ["DataSet", "PipelineSpec", "SETS", "STAGES", "StageOutcome", "load_pipeline", "run_pipeline",
           "split_train_val"]
