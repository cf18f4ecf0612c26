"""Checkpoints: the training state in DCP (sharded, reshardable), atomic publish, safetensors with HF names.

- ``state.py``:   the whole training state as one flat, layout-independent dict, and putting it back
- ``manager.py``: step-N/ folders: atomic save, keep-last-K, async saves, resume discovery, validation
- ``hf.py``:      Hugging Face Llama names, safetensors export and import (initial weights)
- ``export.py``:  ``python -m checkpoint.export --checkpoint DIR --out DIR`` (no process group needed)
"""
