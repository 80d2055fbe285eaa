"""Workloads: requests with arrival times, segments and output lengths; generators and traces."""

from kvbench.workloads.arrivals import ArrivalProcess
from kvbench.workloads.distributions import LengthDist
from kvbench.workloads.generator import generate
from kvbench.workloads.io import (
    SCHEMA_VERSION,
    load_workload,
    load_workload_arg,
    save_workload,
)
from kvbench.workloads.modalities import (
    IMAGE_RULES,
    ImageChoice,
    audio_token_count,
    image_token_count,
    parse_image_choice,
)
from kvbench.workloads.model import Request, Segment, Workload, segment_token_ids
from kvbench.workloads.presets import generate_preset, get_preset_spec, preset_names
from kvbench.workloads.retime import retime
from kvbench.workloads.spec import RequestClass, WorkloadSpec, parse_spec
from kvbench.workloads.specfile import load_spec_file
from kvbench.workloads.stats import describe, shareable_prefix_fraction
from kvbench.workloads.traces import IMAGE_TRACE_KINDS, TRACE_KINDS, import_trace

__all__ = [
    "IMAGE_RULES",
    "IMAGE_TRACE_KINDS",
    "SCHEMA_VERSION",
    "TRACE_KINDS",
    "ArrivalProcess",
    "ImageChoice",
    "LengthDist",
    "Request",
    "RequestClass",
    "Segment",
    "Workload",
    "WorkloadSpec",
    "audio_token_count",
    "describe",
    "generate",
    "generate_preset",
    "get_preset_spec",
    "image_token_count",
    "import_trace",
    "load_spec_file",
    "load_workload",
    "load_workload_arg",
    "parse_image_choice",
    "parse_spec",
    "preset_names",
    "retime",
    "save_workload",
    "segment_token_ids",
    "shareable_prefix_fraction",
]
