"""The service engine's tests run on 8 virtual CPU devices, like tests/trainer; this must happen before anything
touches a JAX backend."""

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
