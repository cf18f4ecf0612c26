"""One from-scratch trainer, grown one mechanism per step (plain torch.distributed, 2 gloo ranks, seconds).

    step1_single_process.py           one process: model, data, gradient accumulation, AdamW by hand
    step2_data_parallel.py            + a rank grid (dp) and an all-reduce of the gradients
    step3_sharded_state.py            + parameters and AdamW moments sharded over dp (reduce-scatter, all-gather)
    step4_tensor_parallel.py          + a tp dim: column- and row-parallel blocks with Megatron's f and g
    step5_pipeline_1f1b.py            + a pp dim: stages and a 1F1B schedule over send/recv
    step6_per_block_sharding.py       + the state sharded per block, gathered just in time with prefetch (FSDP by hand)
    step7_sequence_parallel.py        + sequence parallelism on tp (all-gather before w1, reduce-scatter after w2)
    step8_activation_checkpointing.py + each block's forward recomputed in its backward
    step9_grad_clipping.py            + clipping by the global norm, summed over the shards and the tp, dp and pp groups
    step10_ring_attention.py          + attention in each block, and a cp dim: K/V round the ring, log-sum-exp merge
    step11_expert_all_to_all.py       + a mixture of experts in each block, split over tp, with all-to-all dispatch
    step12_resharded_checkpoint.py    + a checkpoint saved on one layout and loaded on another

Each file is the previous one plus its mechanism (``diff step2_data_parallel.py step3_sharded_state.py``)
and imports nothing but torch. tests/test_trainer_steps.py checks that every step trains exactly the model the
step before it trains (steps 10 and 11 change the model, attention and experts: their reference is their own
degree 1); docs/00_foundations.md, section 8, walks through them.
"""
