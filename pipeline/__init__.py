"""The pipeline around the engine: config, the step runner, storage, the pod, and the CLI.

    pipeline/cli.py        the `pipeline` command (the only place exit codes are decided)
    pipeline/run/          the step runner: config, identity (hashes), plan, markers, status
    pipeline/storage/      fsspec URLs and atomic writes, retries of transient faults, leases
    pipeline/pod/          the hosts of a pod: jax.distributed, leader sections, signals, launch
    pipeline/ops/          operating a Cloud TPU: the `pipeline tpu run` babysitter

The steps themselves live in the top-level `steps` package; the engine in `engine`. README
("Layout") draws which package may import which; tests/test_layers.py enforces it.
"""

import os as _os

# transformers warns "PyTorch was not found" on import: we use it for tokenizers and configs only,
# where torch is never needed, so the advice is noise in every run (issue 14).
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
