"""Ray settings objects that accept Horovod's arguments without effect warn about them. No Ray
cluster is started (only the settings are built)."""
from __future__ import annotations

import warnings

import pytest

from tests._spmd import skip_or_fail


@pytest.fixture
def ray_needed():
    try:
        import ray  # noqa: F401
    except ImportError:
        skip_or_fail('Ray is not installed (pip install ".[ray]")', "ray")


def test_horovod_config_warns_about_fields_without_effect(ray_needed):
    """docs/ray.md says they have no effect; HorovodConfig took them silently."""
    from launcher.ray.train import HorovodConfig
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HorovodConfig(nics={"lo"}, timeout_s=60, key=b"k")  # the fields that work
        HorovodConfig(verbose=1, placement_group_timeout_s=100)  # defaults
    with pytest.warns(UserWarning, match=r"^HorovodConfig: verbose, ssh_port, ssh_identity_file, "
                                         r"ssh_str, placement_group_timeout_s have no effect") \
            as caught:
        HorovodConfig(verbose=2, ssh_port=22, ssh_identity_file="id", ssh_str="k",
                      placement_group_timeout_s=5)
    assert len(caught) == 1 and caught[0].filename == __file__
    with pytest.warns(UserWarning, match=r"^HorovodConfig: ssh_port has no effect"):
        HorovodConfig(ssh_port=2222)


def test_elastic_create_settings_warns_about_ssh_identity_file(ray_needed):
    from launcher.ray.elastic import ElasticRayExecutor
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ElasticRayExecutor.create_settings(min_num_proc=1)
    with pytest.warns(UserWarning, match="ssh_identity_file has no effect on Ray") as caught:
        s = ElasticRayExecutor.create_settings(min_num_proc=1, ssh_identity_file="~/.ssh/id")
    assert len(caught) == 1 and caught[0].filename == __file__
    assert s.ssh_identity_file == "~/.ssh/id"
