"""The hosts of a pod: joining it (jax.distributed), leader sections and peer checks, turning
signals into a clean stop, and `pipeline launch` (a pod of local processes)."""
