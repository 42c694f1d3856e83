"""Model families. Add one by writing its class and one line in `registry._MODEL_CLASSES`."""

from engine.models.registry import SUPPORTED_ARCHITECTURES, get_model_class

__all__ = ["SUPPORTED_ARCHITECTURES", "get_model_class"]
