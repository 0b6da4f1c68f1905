"""The GPU target (NVIDIA sm_90): `pipeline.mojo` plans and launches, one file per kernel family."""
