"""Lightning callbacks, imported as `vlm_retrofit.callbacks`."""

from .skip_generation import SkipAwareGenerationCallback, prompts_from_batch

__all__ = ["SkipAwareGenerationCallback", "prompts_from_batch"]
