"""Post-training quantization, the offline tool behind `elastic-local quantize`: calibrate activation
scales on the full model, then write an FP8 or NVFP4 nested checkpoint in the formats of `quant/`."""

from .quantize import quantize_checkpoint

__all__ = ["quantize_checkpoint"]
