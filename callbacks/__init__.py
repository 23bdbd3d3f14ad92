"""Lightning callbacks, imported as `vlm_retrofit.callbacks`."""

from .skip_generation import SkipAwareGenerationCallback, compare_generation, generation_pad_id, prompts_from_batch

__all__ = ["SkipAwareGenerationCallback", "compare_generation", "generation_pad_id", "prompts_from_batch"]
