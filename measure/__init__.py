"""Measurements: one module per measurement, each with its CLI (``python -m measure.NAME``); no library room imports
this one. Most back a chapter's numbers (the chapter quotes what they print, and the slow suite reruns them); a few
are tools a user runs on their own machine; one is a counter the tests and other measurements share.

By chapter (docs/):
- 1, data parallelism: ``memory_table``, ``fsdp_memory``, ``vocab_units``
- 2, savers: ``grad_traffic``, ``grad_compression``, ``grad_sync_memory``, ``offload_memory``
- 3, tensor parallelism: ``activation_memory``
- 4, pipeline parallelism: ``pipeline_bubble``, ``pipeline_facts``, ``pp_split_memory``, ``schedule_ir``
- 5, expert parallelism: ``ep_layer``, ``ep_placement``, ``moe_capacity``, ``moe_grouped_mm``, ``moe_load``
- 6, context parallelism: ``context_parallel``, ``ring_attention``
- 7, mixed precision and memory: ``logits_memory``
- 8, combining: ``failure_modes``
- 9, checkpoints: ``dcp_files``, ``async_save``, ``hf_import_memory``
- 10, profiling: ``tp_breakdown``, ``attention_gqa``, ``host_syncs``, ``compile_matrix``
- 11, when things go wrong: ``fault_timings``, ``replica_check``
- A, data: ``document_masks``, ``loader_memory``, ``prepare_memory``

Tools: ``gpu_check`` (every GPU check in one command, with a report), ``tokens_per_second`` (throughput of each
layout against one process and a plain PyTorch loop).

Shared counter: ``saved_bytes`` (what a block keeps for its backward), which the tests and chapter 3's measurement
use.
"""
