"""What a training step needs besides the model and its layout.

- ``optimizer.py``:  AdamW per model part, warmup + cosine
- ``evaluation.py``: the validation loss, forward only, as a global token mean
- ``metrics.py``:    the console line, metrics.jsonl, TensorBoard
- ``throughput.py``: TFLOP/s per device and MFU from models/flops.py, the peak table
- ``comm_share.py``: ``python -m training.comm_share RUN_DIR``: compute / communication / exposed communication
"""
