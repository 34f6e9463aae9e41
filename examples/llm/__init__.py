"""A small Llama-family inference engine built on cupa's paged KV cache and decode attention.

The same code runs on cupy (GPU) and numpy (CPU): every module takes an array module `xp` instead
of importing one. Nothing here depends on PyTorch.
"""
