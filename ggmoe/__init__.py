"""ggmoe: GGUF Mixture-of-Experts inference with host-side experts and a predictive GPU expert cache."""

__version__ = "0.1.0"
