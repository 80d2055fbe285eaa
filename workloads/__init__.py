"""Workloads: requests with arrival times, segments and output lengths; generators and traces."""

from kvbench.workloads.model import Request, Segment, Workload, segment_token_ids

__all__ = ["Request", "Segment", "Workload", "segment_token_ids"]
