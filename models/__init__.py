"""Single-device model definitions. Nothing in this package imports torch.distributed."""
