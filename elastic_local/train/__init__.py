"""Training: the demo parent from scratch, and elastic distillation with a learnable budget router."""
