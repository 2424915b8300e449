"""How a model is split over ranks: parallel styles (instances with typed flags), applying plan rules,
checkpoint slicing of DTensor placeholders, FSDP2 units, the vocabulary-parallel loss, gradient norms."""
