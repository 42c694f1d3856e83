"""Ray restarts a dead worker actor as often as it dies, by default, as the plain-process runtime
restarts a dead process: a limit would leave the instance down for good after its last restart.
(The restart itself is exercised in tests/deploy/test_ray_cluster.py.)"""

from __future__ import annotations

import pytest

from deploy.runtime.ray.config import RayClusterConfig
from tests.router.tiny_tokenizer import add_tiny_tokenizer
from tests.tiny_models import make_tiny_model


def test_worker_actors_restart_without_limit_unless_configured(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_dir = add_tiny_tokenizer(make_tiny_model(tmp_path_factory.mktemp("ray"), "llama"))
    assert RayClusterConfig(model_dir=model_dir).max_restarts == -1
    assert RayClusterConfig(model_dir=model_dir, max_restarts=5).max_restarts == 5
    with pytest.raises(ValueError, match="max_restarts must be an integer >= -1"):
        RayClusterConfig(model_dir=model_dir, max_restarts=-2)
