"""Admission control: what a request may put on a model's pool before it is routed
(upstream's B1 request caps, B2 token-weighted occupancy, B4 serverless key limits),
from one input estimate per request."""
