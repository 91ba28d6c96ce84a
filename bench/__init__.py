"""Benchmarks (not tests): `python -m bench.train_step`, `python -m bench.sampler`; see bench/README.md."""
