"""haliax, with the one patch it needs on newer JAX (with compile_cache.py, the only places the
engine reaches into JAX's private modules).

haliax 1.4.dev453 (the newest release) calls `jax.core.is_constant_dim`, which jax 0.11 moved to
`jax._src.core`; the GPU machines ship jax 0.11. This module restores the public name before
handing out haliax, so engine modules import haliax from here:

    from engine.jax_compat import hax

Remove the patch once haliax stops calling the old name.
"""

import jax

if not hasattr(jax.core, "is_constant_dim"):
    import jax._src.core

    jax.core.is_constant_dim = jax._src.core.is_constant_dim

import haliax as hax  # noqa: E402 - after the patch

__all__ = ["hax"]
