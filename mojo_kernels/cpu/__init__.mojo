"""The CPU target: `pipeline.mojo` runs the six steps as stages over host memory, one file per stage family."""
