"""fastai_accum: gradient accumulation for fastai (and plain PyTorch, Accelerate, Lightning) that gets BatchNorm right."""
__version__ = "0.1.0"
