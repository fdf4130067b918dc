"""Decode graph runners: CUDA graphs of resident steps, of offloaded steps per KV layout, and segmented graphs."""
