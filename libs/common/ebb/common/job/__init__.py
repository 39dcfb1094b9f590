"""The job spec and what it is made of: what a job asks for, checked when it is submitted.

`spec` (`JobSpec`, `parse_job`), its sections in `sections` (input, output, resources, a
tier, fault, tracking) and `pipeline` (stages and their models), what they share in `fields`;
`changes` (which fields decide a job's rows: what an output root keeps), `paths` (a job
file's paths, and the data roots), `tiers` and `placement` (the checks of tiers and of where
workers may run), `accumulators` with `exactsum` (a stage's metrics, each row counted once).
Imports nothing of Ebb but `ebb.common`'s foundation (errors, schema).

The names below are the job spec's public face: import them from here.
"""

from .accumulators import MetricSpec
from .changes import differing_fields, fields_digest
from .fields import (
    FORMAT_SUFFIXES,
    MODEL_SUFFIXES,
    RUNTIME_MODULES,
    InputFormat,
    ModelDtype,
    Pool,
    Runtime,
    arrow_type,
)
from .llm import LLMSpec, SamplingSpec, StructuredSpec
from .paths import check_roots, load_job_file, resolve_paths
from .pipeline import ModelSpec, PipelineSpec, StageSpec, tier_pipeline
from .sections import (
    FaultPolicy,
    InputSpec,
    OutputSpec,
    ResourceSpec,
    TierSpec,
    TrackingSpec,
)
from .spec import JOB_ID_RE, JobSpec, parse_job

__all__ = [
    "FORMAT_SUFFIXES",
    "JOB_ID_RE",
    "MODEL_SUFFIXES",
    "RUNTIME_MODULES",
    "FaultPolicy",
    "InputFormat",
    "InputSpec",
    "JobSpec",
    "LLMSpec",
    "MetricSpec",
    "ModelDtype",
    "ModelSpec",
    "OutputSpec",
    "PipelineSpec",
    "Pool",
    "ResourceSpec",
    "Runtime",
    "SamplingSpec",
    "StageSpec",
    "StructuredSpec",
    "TierSpec",
    "TrackingSpec",
    "arrow_type",
    "check_roots",
    "differing_fields",
    "fields_digest",
    "load_job_file",
    "parse_job",
    "resolve_paths",
    "tier_pipeline",
]
