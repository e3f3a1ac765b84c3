"""c2jax: Composer 2's training system in JAX. The layout (c2jax/, models/, rl/, kernels/) is docs/ARCHITECTURE.md's."""

from c2jax import layout as _layout

_layout.install()
