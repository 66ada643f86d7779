"""Where the engine's arrays live: the device mesh, and how weights, KV cache and batches sit on it.

Owns the two layouts and the rules that pick a mesh shape. It allocates nothing itself and
knows nothing about scheduling (engine.py) or the pipeline's config (the step passes plain
values in).

- host data parallel (`Layout.local`): a 1-D mesh ("data",) over this host's own devices;
  weights replicated on each, batch rows split over them. Hosts never talk to each other.
- global mesh (`Layout.pod`): a 2-D mesh ("data", "model") over every device of the pod
  (`jax.devices()`). Weights are sharded by the haliax axis mapping PARAM_MAPPING: head, MLP
  and vocabulary axes over "model" (tensor parallel), the embedding axis over "data"
  (FSDP-style; a mixture's experts' axis instead, where the weight has one), so each device
  holds 1/(data x model) of a weight whose axes divide evenly.
  A decode call gathers each weight back over "data" (XLA hoists the gathers out of its loop),
  so a device needs 1/model of the weights while it runs (engine/memory.py plans it so).
  The KV cache [batch, kv_heads, ...] is split on both axes; activations keep their batch
  axis on "data", and inside a layer their heads and MLP units on "model" (COMPUTE_MAPPING).
  Every host runs the same programs on the same batches in lockstep; what the host reads back
  is replicated, so each host reads its own copy.

    shape = mesh_shape("auto", num_devices=8, kv_heads=8)      # MeshShape(data=1, model=8)
    layout = Layout.pod(shape)
    layout.param_sharding(model.embed_tokens.axes)             # NamedSharding(..., P('model', 'data'))
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Iterator, Literal

import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from engine.config import InvalidConfig, MeshConfig
from engine.jax_compat import hax

PARAM_MAPPING = {
    "q_heads_dim": "model",
    "kv_heads_dim": "model",
    "kv_heads": "model",
    "mlp": "model",
    "vocab": "model",
    "experts": "data",
    "embed": "data",
}
"""Weight axes (engine/llama.py's names) -> mesh axes in global-mesh mode. q_heads_dim is
(kv_heads, q_per_kv, head_dim) flattened, kv_heads outermost, so a split into `model` parts
(which divides kv_heads) keeps every KV head's query group whole on one device. Where two of a
weight's axes map to one mesh axis, the first takes it (`Layout.param_sharding`): a mixture's
stacked weights and router, experts first, are split over `data` by expert, not by embed.
Gathered by embed, XLA's CPU backend copied each gathered expert weight to another layout
before its product (a prefill program at Mixtral 8x7B's shape on 4 x 1 held 37 GiB more than
the plan counts)."""

COMPUTE_MAPPING = {"batch": "data", "q_heads_dim": "model", "kv_heads_dim": "model", "kv_heads": "model", "mlp": "model",
                   "vocab": "model"}
"""Activation axes -> mesh axes where the model pins them (`hax.auto_sharded`: each projection's
result in `llama.linear`, the logits, a layer's output): rows split over `data`; the heads and the
MLP's hidden units over `model`, as their weights are, so each device computes its own heads and
units (tensor parallel), and the LM head its own part of the vocabulary's logits. Left to XLA's
propagation, the CPU backend gathered every weight whole on each device instead. `kv_heads`
is pinned by nothing of ours, but without it a 125M prefill call over 1 x 4 held a few more MB
of temporaries (scripts/memory_analysis.py --mesh)."""


@dataclasses.dataclass(frozen=True)
class MeshShape:
    data: int
    """Devices each holding a different part of the batch (and 1/data of each weight, FSDP)."""
    model: int
    """Devices splitting every layer's heads and MLP (tensor parallel)."""


def mesh_shape(requested: MeshConfig | Literal["auto"], *, num_devices: int, kv_heads: int) -> MeshShape:
    """Resolve `engine.mesh` for `num_devices` devices. auto (or a side left auto): tensor
    parallel over the largest device count that divides both the devices and the KV heads
    (gcd), data over the rest."""
    requested = MeshConfig() if requested == "auto" else requested
    data, model = requested.data, requested.model
    if model == "auto":
        if data == "auto":
            model = math.gcd(num_devices, kv_heads)
        elif num_devices % data:
            raise InvalidConfig(f"engine.mesh.data must divide the pod's {num_devices} devices, got {data}")
        else:
            model = num_devices // data
    if data == "auto":
        if num_devices % model:
            raise InvalidConfig(f"engine.mesh.model must divide the pod's {num_devices} devices, got {model}")
        data = num_devices // model
    if kv_heads % model:
        raise InvalidConfig(f"engine.mesh.model must divide the number of KV heads ({kv_heads}), got {model}")
    if data * model != num_devices:
        raise InvalidConfig(f"engine.mesh {{data: {data}, model: {model}}} needs {data * model} devices, "
                         f"but the pod has {num_devices} (jax.devices())")
    return MeshShape(data, model)


@dataclasses.dataclass(frozen=True)
class Layout:
    mesh: Mesh
    is_global: bool
    """True: a mesh over every host's devices, run in lockstep; False: this host's devices only."""

    @staticmethod
    def local(devices: list[jax.Device]) -> "Layout":
        return Layout(Mesh(np.array(devices), ("data",)), is_global=False)

    @staticmethod
    def pod(shape: MeshShape) -> "Layout":
        devices = np.array(jax.devices()).reshape(shape.data, shape.model)
        return Layout(Mesh(devices, ("data", "model")), is_global=True)

    @property
    def data_size(self) -> int:
        """Batch rows are split this many ways: batch sizes are multiples of it."""
        return self.mesh.shape["data"]

    @property
    def model_size(self) -> int:
        return self.mesh.shape.get("model", 1)

    @property
    def local_devices(self) -> list[jax.Device]:
        return [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]

    @property
    def batch_sharding(self) -> NamedSharding:
        """Arrays with a leading slot axis: decode state, batch inputs."""
        return NamedSharding(self.mesh, PartitionSpec("data"))

    @property
    def cache_sharding(self) -> NamedSharding:
        """KV cache [batch, kv_heads, seq, head_dim]: rows over data, KV heads over model."""
        return NamedSharding(self.mesh, PartitionSpec("data", "model") if self.is_global else PartitionSpec("data"))

    @property
    def host_sharding(self) -> NamedSharding:
        """Values the host reads back (tokens, done flags): replicated on a pod, so every host has
        them; split over local devices otherwise (reading gathers them anyway)."""
        return self.replicated if self.is_global else self.batch_sharding

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def param_sharding(self, axes: tuple[Axis, ...]) -> NamedSharding:
        """A weight's sharding: PARAM_MAPPING on a pod, for the axes its mesh axis divides evenly,
        each mesh axis to the first such axis of the weight (the rest replicated); replicated for
        host data parallelism."""
        if not self.is_global:
            return self.replicated
        mapping: dict[str, str] = {}
        for a in axes:
            mesh_axis = PARAM_MAPPING.get(a.name)
            if mesh_axis is not None and mesh_axis not in mapping.values() and a.size % self.mesh.shape[mesh_axis] == 0:
                mapping[a.name] = mesh_axis
        return NamedSharding(self.mesh, hax.partitioning.pspec_for_axis(axes, mapping))

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """Context for tracing compiled programs: on a pod, `hax.auto_sharded` inside the model
        keeps activations' batch axis on `data` (a no-op otherwise)."""
        if not self.is_global:
            yield
            return
        with hax.axis_mapping(COMPUTE_MAPPING), jax.set_mesh(self.mesh):
            yield

    def any_host(self, flag: bool) -> bool:
        """True if `flag` is True on any host: an all-reduce on a multi-host pod, so every host
        gets the same answer at the same point (e.g. to stop together after a SIGTERM)."""
        if not self.is_global or jax.process_count() == 1:
            return flag
        n = self.mesh.size
        sharding = NamedSharding(self.mesh, PartitionSpec(("data", "model")))
        flags = jax.make_array_from_callback((n,), sharding, lambda index: np.full(len(range(n)[index[0]]), flag))
        return bool(_any(self.replicated)(flags))


@functools.lru_cache(maxsize=None)
def _any(out_sharding: NamedSharding):
    return jax.jit(jnp.any, out_shardings=out_sharding)
