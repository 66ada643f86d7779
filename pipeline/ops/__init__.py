"""Operations tooling outside the pod: `pipeline tpu run`, which creates and babysits a Cloud TPU."""
