"""Model facts from a GGUF header: the bounded reader, the validated facts, tensor names, routers."""

from ggmoe.inspect.facts import ExpertTensor, ModelFacts, MoeLayer, inspect_model

__all__ = ["ExpertTensor", "ModelFacts", "MoeLayer", "inspect_model"]
