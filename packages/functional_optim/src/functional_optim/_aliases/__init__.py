"""The eight torch.optim algorithms as chains of transforms, with a fused in-place ``step``."""
