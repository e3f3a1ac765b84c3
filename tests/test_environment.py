"""conftest.py's JAX setup, which sharding tests rely on."""

import jax


def test_tests_see_eight_cpu_devices_and_a_persistent_cache():
    assert [d.platform for d in jax.devices()] == ["cpu"] * 8
    assert jax.config.jax_compilation_cache_dir
