"""The model: the GGUF file, the split over the workers, the stages' graphs and weights, and
the architectures (one short file each, sharing their blocks)."""
