"""The lab: the demos, benchmarks and the `fastai-accum` command line (not needed to use the callback)."""
