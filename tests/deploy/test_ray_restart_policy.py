"""Ray restarts a dead worker actor as often as it dies, by default, as the plain-process runtime
restarts a dead process: a limit would leave the instance down for good after its last restart.
(The restart itself is exercised in tests/deploy/test_ray_cluster.py.)"""

from __future__ import annotations

import pytest

from deploy.config.serve_config import ConfigError
from deploy.runtime.ray.cluster import RayCluster
from tests.deploy.ray_support import serve_spec, tiny_model_with_tokenizer

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers


def test_worker_actors_restart_without_limit_unless_configured(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_dir = tiny_model_with_tokenizer(tmp_path_factory.mktemp("ray"))
    default = RayCluster(serve_spec(model_dir))
    assert default.actor_options()["max_restarts"] == -1
    limited = RayCluster(serve_spec(model_dir, ray={"max_restarts": 5}))
    assert limited.actor_options()["max_restarts"] == 5
    with pytest.raises(ConfigError, match="ray.max_restarts must be an integer >= -1"):
        serve_spec(model_dir, ray={"max_restarts": -2})
