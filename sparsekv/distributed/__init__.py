"""Tensor parallelism over the GPUs of one host: parallel state, sharding, worker launch, the driving engine."""
