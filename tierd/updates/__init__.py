"""The update engine: optimizer state in buckets, updated inside backward
(fused, on the device), on host threads, or kept resident on the device.

It sits below ``tierd.optim`` (the optimizers users build, which register
their updates here) and the attached model's session and placer, which ask
it only through :class:`tierd.client.optimizers.UpdateEngine`
(:class:`tierd.updates.engine.SessionUpdates`). It uses ``tierd.client``'s
leaf modules (``tiered_param``, ``copy_stream``, ``capacity``,
``placement``...) and imports nothing of ``tierd.optim``
(tests/test_imports.py).
"""
