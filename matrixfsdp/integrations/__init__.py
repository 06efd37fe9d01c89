"""Integrations with training frameworks that drive FSDP2.

- ``matrixfsdp.integrations.torchtitan``: torchtitan 0.3.0 (``pip install -e '.[torchtitan]'``):
  a ``parallelize_fn`` that applies torchtitan's TP / activation checkpointing / compile and then
  ``fully_shard_matrix`` in place of ``apply_fsdp``, an optimizer container for
  ``MatrixOptimizer`` with torchtitan's flat ``param_names``-keyed state, and ``--module``
  configs.

Each submodule imports its framework; this package imports nothing.
"""

from __future__ import annotations

__all__: list[str] = []
