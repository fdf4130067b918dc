"""Attention quality of any SparsePolicy against dense attention, on tensors, without a model.

    from sparsekv.quality import planted_inputs, evaluate
    inputs = planted_inputs(context=8192, block_size=256, needle_depths=[0.5], device="cuda", dtype=torch.bfloat16)
    report = evaluate(policy, inputs)          # {"phases": {"decode": {...}, "prefill": {...}, "resident": {...}}}

Inputs (AttentionInputs) are Q/K/V of one sequence for a few layers: planted ones (planted_inputs: attention
sinks, local windows, vertical stripes and needle blocks the final queries look for) or a checkpoint's real ones
(task=quality captures them). The harness (run_offloaded) drives the real OffloadKVStore with the inputs' Q/K/V in
place of a model: the prompt (all tokens but the last) is prefilled chunk by chunk (store.begin_step / attend per
layer: compute_chunked_prefill, then the chunk's blocks offloaded with the on_prefill_offload hook), then decode
steps up to the last token (compute_chunked_decode; a block that fills is offloaded, firing on_decode_offload).
compute_prefill (offload=none) is evaluated on the whole prompt. Loaded blocks are observed where the ring engine
issues them (RecordingOffloadEngine).

Phases and what is evaluated:
  decode    the last token's query (compute_chunked_decode); selectable = full blocks before its block
  prefill   the last prefill chunk's queries (compute_chunked_prefill); selectable = blocks before the chunk
  resident  every prompt query through compute_prefill (offload=none; keys on the device)
A policy that does not support a phase is reported as skipped for it (the engine pairs it with full attention).

Modules: planted (AttentionInputs, planted_inputs), harness (run_offloaded, run_resident), metrics (evaluate and
its measures, see there), sweep (sweeps, rows, summarize, format_table).
"""
from sparsekv.quality.harness import (PhaseRun, RecordingOffloadEngine, RecordingOffloadStore, block_table,
                                      run_offloaded, run_resident)
from sparsekv.quality.metrics import (PHASES, block_mass, dense_attention, evaluate, needle_probe_values,
                                      needle_scores, oracle_blocks, phase_metrics, recall_of, relative_error)
from sparsekv.quality.planted import AttentionInputs, Layout, layout, needle_block_indices, planted_inputs
from sparsekv.quality.sweep import (SUMMARY_KEYS, TABLE_COLUMNS, format_table, planted_grid, rows, summarize, sweep,
                                   sweep_field)
