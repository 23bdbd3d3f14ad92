"""Lightning callbacks, imported as `vlm_retrofit.callbacks`."""
