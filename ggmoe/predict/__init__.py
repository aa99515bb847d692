"""Expert predictors: which experts will MoE layer ``il + s`` select? (numpy only, never torch).

Importing this package registers every built-in predictor family in ``PREDICTORS``.
"""

from ggmoe.predict import eam, expert_map, mlp, simple, transition  # noqa: F401 - registration
from ggmoe.predict.base import PREDICTORS, ModelShape, Predictor, make_predictor

__all__ = ["PREDICTORS", "ModelShape", "Predictor", "make_predictor"]
